import os, subprocess, sys
from pathlib import Path
import pytest

pytest.register_assert_rewrite('helpers')  # shared test helpers (tests/helpers.py): their asserts report as a test module's do

ROOT = Path(__file__).parents[1]
V1_DIR = ROOT/'.v1'  # fastai 1.0.61 overlay, installed by the README's test command / .ci/run

def run_v1(code:str, timeout=600) -> subprocess.CompletedProcess:
    "Run `code` in a fresh interpreter where `import fastai` gives fastai 1.0.61 (the overlay first on sys.path)."
    if not (V1_DIR/'fastai').exists():
        pytest.fail(f'fastai v1 overlay missing: pip install --target {V1_DIR} --no-deps -r tests/v1-requirements.txt')
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(V1_DIR), str(ROOT)])}
    r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if r.returncode: print(r.stdout, r.stderr, sep='\n')
    return r

# Tiny CPU models: one thread is as fast and does not stall when the 2 cores are shared.
import torch
torch.set_num_threads(1)
