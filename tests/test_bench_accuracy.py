"The accuracy benchmark's --quick mode: CI fails if the default BatchNorm policy falls behind naive accumulation."
import subprocess, sys
from pathlib import Path

def test_bench_accuracy_quick_default_policy_not_behind_naive(tmp_path):
    exe = str(Path(sys.executable).parent/'fastai-accum')
    r = subprocess.run([exe, 'bench', 'accuracy', '--quick', '--out', str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'naive' in r.stdout and 'ours:auto' in r.stdout
    assert (tmp_path/'bench_accuracy.png').exists() and (tmp_path/'bench_accuracy.csv').exists()
    import pandas as pd
    t = pd.read_csv(tmp_path/'bench_accuracy.csv').set_index('setting')
    assert t.loc['ours:auto', 'acc'] >= t.loc['naive', 'acc']
