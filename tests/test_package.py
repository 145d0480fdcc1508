"Packaging: version single-sourced, console script, public API."
import subprocess, sys
import pytest
from configparser import ConfigParser
from pathlib import Path
import fastai_accum

ROOT = Path(__file__).parents[1]

def test_version_matches_settings():
    cfg = ConfigParser(); cfg.read(ROOT/'settings.ini')
    assert fastai_accum.__version__ == cfg['DEFAULT']['version']

def test_console_script_help_and_version():
    exe = str(Path(sys.executable).parent/'fastai-accum')  # installed by `pip install -e .`
    r = subprocess.run([exe, '--version'], capture_output=True, text=True)
    assert r.returncode == 0 and fastai_accum.__version__ in r.stdout
    r = subprocess.run([exe, '--help'], capture_output=True, text=True)
    assert r.returncode == 0 and 'fastai-accum' in r.stdout

def test_all_exports_public_api():
    import fastai_accum.all as a
    for name in ['ChannelStats', 'AccumulateBatchNorm', 'wrap_bn', 'unwrap_bn', 'update_bn_stats']:
        assert name in a.__all__ and hasattr(a, name)

def test_ci_runs_the_readme_test_command():
    readme, ci = (ROOT/'README.md').read_text(), (ROOT/'.ci/run').read_text()
    cmd = next(l for l in readme.splitlines() if 'pytest' in l and l.startswith('python3 -m venv'))
    assert cmd in ci.splitlines()

IMPORT_ORDER = '''
{imports}
import torch
from torch.utils.data import TensorDataset
assert GradientAccumulation.__module__ == 'fastai_accum.callback', GradientAccumulation.__module__
x = torch.randn(32, 4); y = x.sum(1, keepdim=True)
dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=2), DataLoader(TensorDataset(x[:8], y[:8]), bs=2))
learn = Learner(dls, nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)), loss_func=MSELossFlat())
ga = GradientAccumulation(n_step=8, preflight=False)
learn.fit(1, 1e-2, cbs=ga)
assert (ga.n_steps, ga.path) == (2, 'exact'), (ga.n_steps, ga.path)
print('OK')
'''

@pytest.mark.parametrize('imports', ['from fastai_accum.all import *\nfrom fastai.vision.all import *',
                                     'from fastai.vision.all import *\nfrom fastai_accum.all import *'],
                         ids=['ours_first', 'fastai_first'])
def test_either_import_order_gives_this_callback(imports):
    r = subprocess.run([sys.executable, '-c', IMPORT_ORDER.format(imports=imports)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and 'OK' in r.stdout, r.stderr[-3000:]

def test_declared_requirements_cover_imports_and_keep_adapters_extra():
    "psutil (every fit's memory plan) is declared; accelerate, timm and Lightning are extras, as only their adapters or tests need them."
    import configparser
    cfg = configparser.ConfigParser(); cfg.read(Path(__file__).parents[1]/'settings.ini')
    base = cfg['DEFAULT']['requirements'].split()
    names = {r.split('>')[0].split('<')[0].split('=')[0] for r in base}
    assert 'psutil' in names and not names & {'accelerate', 'timm', 'pytorch-lightning'}
    for extra in ('accelerate', 'timm', 'lightning'): assert cfg['DEFAULT'][f'{extra}_requirements']

def test_module_imports_form_no_circle():
    "The package's modules import each other as a DAG: relative imports at any depth and `import_module('fastai_accum.X')` counted."
    import ast, re
    pkg = Path(fastai_accum.__file__).parent
    names = {p.stem for p in pkg.glob('*.py')}
    graph = {}
    for p in pkg.glob('*.py'):
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module: deps.add(node.module.split('.')[0])
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith('fastai_accum.'): deps.add(node.module.split('.')[1])
        deps |= set(re.findall(r"['\"]fastai_accum\.(\w+)['\"]", p.read_text()))
        graph[p.stem] = (deps & names) - {p.stem}
    state = {}
    def visit(n, path):
        if state.get(n) == 'done': return
        assert state.get(n) != 'open', f"import circle: {' -> '.join(path + [n])}"
        state[n] = 'open'
        for d in sorted(graph[n]): visit(d, path + [n])
        state[n] = 'done'
    for n in sorted(graph): visit(n, [])
