"The copy-paste file: in sync with the modules, and alone (fastai_accum not importable) bit for bit the package's callback."
import ast, subprocess, sys, textwrap
from pathlib import Path
import pytest, torch
from fastai_accum.single_file import single_file_source

ROOT = Path(__file__).parents[1]
FILE = ROOT/'fastai_accum_single.py'

def test_in_sync():
    assert FILE.exists() and FILE.read_text() == single_file_source(), \
        'fastai_accum_single.py is out of date: run `fastai-accum build-single-file` in the repository root'

TRAIN = '''
import sys, torch
torch.set_num_threads(1)
source, policy, out = sys.argv[1], sys.argv[2], sys.argv[3]
if source == 'file':
    sys.modules['fastai_accum'] = None  # as on Kaggle: the package is not installed
    try: import fastai_accum
    except ImportError: pass
    else: raise SystemExit('fastai_accum is importable')
    exec(compile(open('fastai_accum_single.py').read(), 'fastai_accum_single.py', 'exec'))  # as a pasted notebook cell
    assert GradientAccumulation.__module__ == 'fastai_accum_single'  # the pasted cell's own module
else:
    from fastai_accum.callback import GradientAccumulation
from torch import nn
from torch.utils.data import TensorDataset
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, MSELossFlat, set_seed
set_seed(0)
x = torch.randn(48, 6); y = x[:, :1] * 2 + 0.1 * torch.randn(48, 1)
dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=4, shuffle=True), DataLoader(TensorDataset(x[:8], y[:8]), bs=4))
model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
learn = Learner(dls, model, loss_func=MSELossFlat(), opt_func=SGD)
kw = {} if policy == 'default' else dict(policy=policy)
learn.fit(2, lr=0.05, cbs=GradientAccumulation(n_step=4, preflight=False, **kw))
torch.save({k: v.clone() for k, v in learn.model.state_dict().items()}, out)
'''

@pytest.mark.parametrize('policy', ['default', 'window'])
def test_alone_matches_package_bit_for_bit(policy, tmp_path):
    script = tmp_path/'train.py'; script.write_text(TRAIN)
    (tmp_path/'fastai_accum_single.py').write_text(FILE.read_text())
    for source in ('file', 'package'):
        r = subprocess.run([sys.executable, '-I', str(script), source, policy, str(tmp_path/f'{source}.pt')] if source == 'file'
                           else [sys.executable, str(script), source, policy, str(tmp_path/f'{source}.pt')],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a, b = torch.load(tmp_path/'file.pt'), torch.load(tmp_path/'package.pt')
    assert a.keys() == b.keys()
    for k in a: assert torch.equal(a[k], b[k]), k

PASTE_THEN_FASTAI = '''
import sys
sys.modules['fastai_accum'] = None  # the package is not installed
exec(compile(open('fastai_accum_single.py').read(), 'fastai_accum_single.py', 'exec'))  # the cell, pasted first
pasted = GradientAccumulation
from fastai.vision.all import *  # then the usual imports
assert GradientAccumulation is pasted, GradientAccumulation
assert GradientAccumulation(n_step=8).n_step == 8
print('OK')
'''

def test_paste_cell_before_the_fastai_imports(tmp_path):
    (tmp_path/'fastai_accum_single.py').write_text(FILE.read_text())
    r = subprocess.run([sys.executable, '-I', '-c', PASTE_THEN_FASTAI], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and 'OK' in r.stdout, r.stderr[-3000:]

OPTIONAL_OUTSIDE = '''
import sys
sys.modules['fastai_accum'] = None  # the package is not installed
exec(compile(open('fastai_accum_single.py').read(), 'fastai_accum_single.py', 'exec'))
cb = GradientAccumulation(n_step=4, bn_batch=2)
print('bn_batch', cb.bn_batch, 'import importlib' in open('fastai_accum_single.py').read())
'''

def test_holds_every_path_the_callback_plans(tmp_path):
    "What the planner can choose is in the file, ghost batches too (imported plainly, no `importlib`): no package needed."
    assert 'def install_ghost' in FILE.read_text() and 'def install_staged' in FILE.read_text()
    (tmp_path/'fastai_accum_single.py').write_text(FILE.read_text())
    r = subprocess.run([sys.executable, '-I', '-c', OPTIONAL_OUTSIDE], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and 'bn_batch 2 False' in r.stdout, r.stdout + r.stderr[-3000:]

def test_readme_states_the_length_and_where_the_callback_starts():
    "README's figures for the paste file are the file's: its length, its first class, the line `GradientAccumulation` starts on."
    import ast, re
    readme, src = (ROOT/'README.md').read_text().replace('\n', ' '), FILE.read_text()
    n = int(re.search(r'([\d,]+) lines; its docstring lists', readme).group(1).replace(',', ''))
    first = re.search(r'the first class is `(\w+)`', readme).group(1)
    at = int(re.search(r'`GradientAccumulation` starts at line ([\d,]+)', readme).group(1).replace(',', ''))
    inner = next(c for c in ast.walk(ast.parse(src)) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                 and 'class GradientAccumulation' in c.value)  # the library's source, run as a module of its own
    classes = [c for c in ast.parse(inner.value).body if isinstance(c, ast.ClassDef)]
    line = lambda c: inner.lineno + c.lineno - 1  # its lines in the file
    assert (n, first, at) == (len(src.splitlines()), classes[0].name, next(line(c) for c in classes if c.name == 'GradientAccumulation'))
    assert src.splitlines()[at - 1].startswith('class GradientAccumulation(')

NAMESPACE = '''
import sys
sys.modules['fastai_accum'] = None  # the package is not installed
from fastai.vision.all import *  # a notebook's usual first cell
before = dict(globals())
exec(compile(open('fastai_accum_single.py').read(), 'fastai_accum_single.py', 'exec'))  # the pasted cell
new = sorted(k for k in globals() if k not in before and k != 'before' and not k.startswith('__'))
changed = sorted(k for k in before if not k.startswith('__') and globals()[k] is not before[k])
print('NEW', new); print('CHANGED', changed)
print('PRIVATE', [k for k in new if k.startswith('_') and k != '_fastai_accum'])
print('COPY', copy([1]) == [1])
'''

def test_the_pasted_cell_leaves_the_notebook_namespace_alone(tmp_path):
    "It added 174 public names (317 before that, rebinding fastai's `copy`); now the listed ones and the module."
    (tmp_path/'fastai_accum_single.py').write_text(FILE.read_text())
    r = subprocess.run([sys.executable, '-I', '-c', NAMESPACE], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    said = dict(l.split(' ', 1) for l in r.stdout.splitlines() if l.split(' ', 1)[0] in ('NEW', 'CHANGED', 'PRIVATE', 'COPY'))
    public = set(ast.literal_eval(said['NEW'])) - {'_fastai_accum'}
    assert public == {'Accumulation', 'StagedMismatchError', 'ExactModeMemoryError', 'ExactModeRefusedError',
                      'fastai_accum'}, public  # and `GradientAccumulation`, fastai's name: changed
    assert said['PRIVATE'] == '[]' and said['COPY'] == 'True'
    assert ast.literal_eval(said['CHANGED']) == ['GradientAccumulation'], said['CHANGED']  # ours, in place of fastai's

IPYTHON_CELL = '''
import sys, traceback
sys.modules['fastai_accum'] = None  # a fresh notebook where the package is not installed
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell('from fastai.basics import *', store_history=True)
before = set(shell.user_ns)
if sys.argv[1] == 'paste': r = shell.run_cell(open('fastai_accum_single.py').read(), store_history=True)  # the pasted cell
else: r = shell.run_cell('%run fastai_accum_single.py', store_history=True)  # uploaded, then run
assert r.success, r.error_in_exec or r.error_before_exec
added = sorted(k for k in set(shell.user_ns) - before if not k.startswith('_'))
print('ADDED', added)
shell.run_cell("""
import torch
from torch import nn
from torch.utils.data import TensorDataset
x = torch.randn(32, 6); y = x[:, :1] * 2
dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=4, shuffle=True), DataLoader(TensorDataset(x[:8], y[:8]), bs=4))
learn = Learner(dls, nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)), loss_func=MSELossFlat())
cb = GradientAccumulation(n_step=4, preflight=False)
learn.fit(1, cbs=cb)
fitted = cb.path
def f(x:int): return x
""", store_history=True)
print('FIT', shell.user_ns['fitted'])
print('ANNOTATION', shell.user_ns['f'].__annotations__['x'] is int)
try: shell.user_ns['GradientAccumulation'](n_step=4, policy='nope')
except ValueError as e:
    frame = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == '<fastai_accum_single>'][-1]
    print('LINE', frame.lineno, repr(frame.line))
'''

@pytest.mark.parametrize('route', ['paste', 'run'])
def test_the_pasted_cell_as_a_notebook_runs_it(tmp_path, route):
    """Run as an IPython cell in a fresh interpreter without the package, then a fit: later cells' annotations are
    theirs (IPython kept the cell's `from __future__ import annotations` for every later cell), only the listed names
    are added, and a traceback names the line of the pasted file that raised (it was 48 lines off)."""
    (tmp_path/'fastai_accum_single.py').write_text(FILE.read_text())
    r = subprocess.run([sys.executable, '-I', '-c', IPYTHON_CELL, route], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    said = dict(l.split(' ', 1) for l in r.stdout.splitlines() if l.split(' ', 1)[0] in ('ADDED', 'FIT', 'ANNOTATION', 'LINE'))
    assert ast.literal_eval(said['ADDED']) == sorted(['GradientAccumulation', 'Accumulation', 'StagedMismatchError',
                                                     'ExactModeMemoryError', 'ExactModeRefusedError', 'fastai_accum'])
    assert said['FIT'] == 'exact' and said['ANNOTATION'] == 'True', said
    line, text = said['LINE'].split(' ', 1)
    assert FILE.read_text().splitlines()[int(line) - 1].strip() == ast.literal_eval(text).strip() and 'raise' in text
