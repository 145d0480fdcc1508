"""Every Python block of README.md runs as written, offline: the fastai v2 blocks in order in one fresh process (as a
reader pastes them into one notebook), the fastai v1 block in the v1 overlay. Only the network is replaced:
`untar_data` returns a small MNIST_SAMPLE-shaped folder written from sklearn's digits, and torchvision finds
resnet18's 'pretrained' weights (random ones) in a temporary torch cache."""
import re, subprocess, sys, textwrap
from pathlib import Path
from conftest import run_v1

ROOT = Path(__file__).parents[1]

def readme_blocks() -> list[str]:
    "The ```python blocks of README.md, in order."
    return re.findall(r'^```python\n(.*?)^```', (ROOT/'README.md').read_text(), flags=re.S | re.M)

def is_v1(block:str) -> bool: return 'from fastai.vision import *' in block  # fastai v1's import

# Writes the stand-ins; then `untar_data(URLs.MNIST_SAMPLE)` (v1 or v2) gives the folder. Formatted with `root`.
OFFLINE = '''
import os, warnings; warnings.simplefilter('ignore')
from pathlib import Path
import numpy as np, torch, torchvision
from PIL import Image
from sklearn.datasets import load_digits
root = Path({root!r})
os.environ['TORCH_HOME'] = str(root/'torch')  # torch's cache: random 'pretrained' weights, so nothing is downloaded
url = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url
(root/'torch'/'hub'/'checkpoints').mkdir(parents=True, exist_ok=True)
torch.save(torchvision.models.resnet18().state_dict(), root/'torch'/'hub'/'checkpoints'/url.rsplit('/', 1)[1])
mnist, digits = root/'mnist_sample', load_digits()
for label in (3, 7):
    imgs = digits.images[digits.target == label]
    for split, ids in (('train', range(40)), ('valid', range(40, 50))):  # 40 micro-batches: more than one window
        (mnist/split/str(label)).mkdir(parents=True, exist_ok=True)
        for i in ids: Image.fromarray((imgs[i]*16).astype(np.uint8)).resize((28, 28)).save(mnist/split/str(label)/f'{{i}}.png')
def untar_data(url, *args, **kwargs): return mnist
'''

V2_OFFLINE = OFFLINE + '''
import fastai.data.external, fastai.vision.all
fastai.data.external.untar_data = fastai.vision.all.untar_data = untar_data
'''

V1_OFFLINE = OFFLINE + '''
import fastai.datasets, fastai.vision
fastai.datasets.untar_data = fastai.vision.untar_data = untar_data
'''

def numbered(blocks:list[str]) -> str:
    "The blocks as one script, each announced, so that a failure names its block."
    return '\n'.join(f"print('README block {i}', flush=True)\n{b}" for i, b in blocks)

def test_readme_has_the_blocks_a_user_reads():
    blocks = readme_blocks()
    assert sum(map(is_v1, blocks)) == 1 and len(blocks) >= 3, blocks
    assert any('Accumulation(model' in b for b in blocks)  # the plain-PyTorch loop

def test_readme_fastai_v2_and_plain_pytorch_blocks_run_as_written(tmp_path):
    blocks = [(i, b) for i, b in enumerate(readme_blocks()) if not is_v1(b)]
    code = V2_OFFLINE.format(root=str(tmp_path)) + numbered(blocks) + "\nprint('README OK')\n"
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0 and 'README OK' in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])

def test_readme_fastai_v1_block_runs_as_written(tmp_path):
    blocks = [(i, b) for i, b in enumerate(readme_blocks()) if is_v1(b)]
    r = run_v1(V1_OFFLINE.format(root=str(tmp_path)) + numbered(blocks) + "\nprint('README OK')\n", timeout=900)
    assert r.returncode == 0 and 'README OK' in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])

def test_the_places_the_readme_cites_exist():
    "Every `tests/...::name`, test file and notebook README names as where a claim is checked exists."
    readme = (ROOT/'README.md').read_text()
    for f, name in re.findall(r'(tests/test_\w+\.py)::(\w+)', readme):
        assert f'def {name}(' in (ROOT/f).read_text(), f'{f}::{name}'
    for f in set(re.findall(r'(tests/\w+\.py)', readme)): assert (ROOT/f).exists(), f
    for nb in set(re.findall(r'nbs/(\w+)', readme)): assert list((ROOT/'nbs').glob(nb + '*')), nb

def test_readme_is_a_front_page_whose_claims_are_the_code_s():
    "At most 2,500 words, the fastai quick start within the first 60 lines; the figures it states are those the code has."
    from fastai_accum.lab.demo import demo_defaults, quick_settings
    readme = (ROOT/'README.md').read_text()
    assert len(readme.split()) <= 2500
    assert readme.splitlines().index('## Quick start: fastai v2') < 60
    flat = ' '.join(readme.split())
    d = demo_defaults['mnist']
    assert f"The default rows are {', '.join(quick_settings[:-1])} and {quick_settings[-1]} on {d['n_train']} images for {d['epochs']} epochs" in flat
    floor = re.search(r'torch>=([\d.]+)', (ROOT/'settings.ini').read_text()).group(1)
    assert f'torch >= {floor}' in readme and f'oldest torch the package declares ({floor}' in flat
    import torch
    from torch import nn
    from fastai_accum.core import Accumulation
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    acc = Accumulation(model, n_step=2, name='GradientAccumulation')  # as the callback speaks
    batch = (torch.randn(2, 1, 8, 8), torch.zeros(2, dtype=torch.long))
    next(iter(acc.batches([batch] * 2)))
    said = acc.preflight(batch[:1]).split(' a window of')[0]  # the example's words, up to its numbers
    assert said.startswith("GradientAccumulation: policy 'auto' -> 'exact'") and said in flat
    assert (ROOT/'nbs'/'images'/'demo_mnist.png').exists()

def test_try_it_comes_first_and_the_quick_start_is_offline_ready():
    "A newcomer reads 'Try it' (its one command) within the first 40 lines, before the quick start; the quick start says how to run offline."
    lines = (ROOT/'README.md').read_text().splitlines()
    at = {l: i for i, l in enumerate(lines) if l.startswith('## ')}
    assert at['## Try it'] < at['## Quick start: fastai v2'] < at['## The guarantee'] < at['## Results']
    assert any('fastai-accum demo mnist' in l for l in lines[:40])
    quick = '\n'.join(lines[at['## Quick start: fastai v2']:at['## Quick start: fastai v1']])
    assert 'val_bs=' in quick and 'pretrained=False' in quick and 'mnist_sample().path' in quick

def test_each_result_opens_with_what_it_shows():
    "Results: every table and figure follows a bold line saying what it shows; commit hashes live in the notebooks."
    readme = (ROOT/'README.md').read_text()
    results = readme[readme.index('## Results'):readme.index('\n## ', readme.index('## Results') + 1)]
    paragraphs = results.split('\n\n')[1:]
    claims = [p for p in paragraphs if p.startswith('**')]
    assert len(claims) >= 5 and all(c.find('**', 2) > 2 for c in claims), claims
    for i, p in enumerate(paragraphs):  # a table's paragraph: a claim or its continuation comes before it
        if p.startswith('|'): assert any(q.startswith('**') for q in paragraphs[max(0, i - 2):i]), p[:80]
    assert not re.search(r'\bcommit [0-9a-f]{7}\b|\bat [0-9a-f]{7}\b', readme), re.findall(r'commit [0-9a-f]{7}', readme)

def test_every_error_class_the_readme_names_is_importable_from_all():
    "`StagedMismatchError`, named in the guarantee, was not in `fastai_accum.all` (issue #76)."
    import re
    import fastai_accum.all as everything
    named = set(re.findall(r'`(\w+Error)`', (Path(__file__).parents[1]/'README.md').read_text()))
    assert {'StagedMismatchError', 'ExactModeMemoryError', 'ExactModeRefusedError'} <= named
    assert named <= set(everything.__all__), named - set(everything.__all__)

def bash_blocks() -> list[str]:
    "The ```bash blocks of README.md, in order."
    return re.findall(r'^```bash\n(.*?)^```', (ROOT/'README.md').read_text(), flags=re.S | re.M)

# The network's three doors, and nothing else, replaced: the clone (this checkout), pip's indexes (an empty one; the
# packages pip would download are this environment's, seen through a .pth file) and the demo's data (offline)
SHORT_DEMO = ' --offline --epochs 1 --n-step 4 --n-train 32 --n-valid 16 --quiet'

def _sees_this_environment(venv:Path):
    "Let the fresh virtualenv `venv` see this environment's packages: a .pth file, its own older setuptools taken out."
    import sysconfig, shutil
    site = Path(subprocess.run([str(venv/'bin'/'python'), '-c', "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site/'_this_environment.pth').write_text(sysconfig.get_paths()['purelib'] + '\n')
    for p in list(site.glob('setuptools*')) + list(site.glob('pkg_resources')) + list(site.glob('_distutils_hack')):
        shutil.rmtree(p)
    (site/'distutils-precedence.pth').unlink(missing_ok=True)

def test_the_readme_commands_run_as_written_in_a_fresh_virtualenv(tmp_path):
    """Try it's commands, each line as written, in a fresh shell: the clone, a fresh virtualenv, the CPU torch line, the
    install of the checkout, its console script and the demo (shortened: offline, 32 images, one epoch). The other bash
    block is the test command CI runs as written (`tests/test_package.py::test_ci_runs_the_readme_test_command`); the
    upload-and-run route of the one-file library: `tests/test_single_file.py::test_the_pasted_cell_as_a_notebook_runs_it`."""
    import os, sys
    blocks = bash_blocks()
    try_it = next(b for b in blocks if 'fastai-accum demo mnist' in b)
    assert all(b is try_it or '-m pytest tests' in b for b in blocks), blocks
    lines = try_it.strip().splitlines()
    assert lines[0].startswith('git clone https://github.com/fastai-accum/fastai_accum ') and 'python3 -m venv .venv' in lines[0]
    first = lines[0].replace('git clone https://github.com/fastai-accum/fastai_accum', f'git clone -q {ROOT} fastai_accum')
    rest = [l.replace('--index-url https://download.pytorch.org/whl/cpu', f'--index-url {(tmp_path/"index").as_uri()}')
             .replace('fastai-accum demo mnist', 'fastai-accum demo mnist' + SHORT_DEMO) for l in lines[1:]]
    assert len(rest) == 2 and '--index-url file:' in rest[0] and SHORT_DEMO in rest[1]
    (tmp_path/'index').mkdir()
    env = {**os.environ, 'PIP_NO_INDEX': '1', 'PIP_NO_BUILD_ISOLATION': '0', 'PIP_DISABLE_PIP_VERSION_CHECK': '1',
           'FASTAI_HOME': str(tmp_path/'fastai_home'), 'TORCH_HOME': str(tmp_path/'torch_home'),
           'FASTAI_ACCUM_DATA': str(tmp_path/'data'), 'PATH': f"{Path(sys._base_executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop('PYTHONPATH', None)
    sh = lambda cmd, cwd: subprocess.run(['bash', '-c', cmd], capture_output=True, text=True, timeout=900, cwd=cwd, env=env)
    r = sh(first, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    _sees_this_environment(tmp_path/'fastai_accum'/'.venv')
    r = sh('set -e\n' + '\n'.join(rest), tmp_path/'fastai_accum')  # as typed, line by line
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert re.search(r'^\s*ours\s', r.stdout, re.M) and 'offline stand-in' in r.stdout, r.stdout[-3000:]
    which = subprocess.run([str(tmp_path/'fastai_accum'/'.venv'/'bin'/'python'), '-c', 'import fastai_accum; print(fastai_accum.__file__)'],
                           capture_output=True, text=True, cwd='/', env=env).stdout
    assert which.startswith(str(tmp_path/'fastai_accum')), which  # the checkout's package, installed in the fresh one
