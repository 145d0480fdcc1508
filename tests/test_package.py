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

def test_all_exports_what_a_user_calls():
    "At most 26 names (25, and `StagedMismatchError`, which the README names: issue #76), each used in README or a notebook's example (a cell nbdev does not export), none of them v1-only."
    import json, re
    import fastai_accum.all as a
    assert len(a.__all__) <= 26 and len(set(a.__all__)) == len(a.__all__)
    examples = [(ROOT/'README.md').read_text()]
    for nb in (ROOT/'nbs').glob('*.ipynb'):
        examples += [''.join(c['source']) for c in json.loads(nb.read_text())['cells']
                     if c['cell_type'] == 'code' and not ''.join(c['source']).lstrip().startswith('#| export')]
    for name in a.__all__:
        assert hasattr(a, name), name
        assert any(re.search(rf'\b{name}\b', e) for e in examples), f'{name} is exported but no example uses it'
    assert a.GradientAccumulation.__module__ == 'fastai_accum.callback'  # under fastai v2: the v2 callback
    assert not any(n.endswith('V1') or n.startswith('mnist') for n in a.__all__)

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
assert (ga.steps, ga.path) == (2, 'exact'), (ga.steps, ga.path)
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
    "The package's modules, the `lab` subpackage's too, import each other as a DAG (relative imports at any depth, absolute ones and `import_module('fastai_accum.X')` counted), and the library imports nothing of the lab."
    import ast, re
    pkg = Path(fastai_accum.__file__).parent
    def name(p):  # 'callback', 'lab.cli', 'lab' (a package's __init__), '' (the root's)
        parts = p.relative_to(pkg).with_suffix('').parts
        return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
    files = {name(p): p for p in pkg.rglob('*.py') if p.name != '_modidx.py'}  # nbdev's index names every module, imports none
    assert {'lab', 'lab.cli', 'lab.experiments', 'lab.demo'} <= set(files), sorted(files)
    def module(dotted):  # the longest prefix of `dotted` that is one of the package's modules
        parts = dotted.split('.')
        return next(('.'.join(parts[:k]) for k in range(len(parts), 0, -1) if '.'.join(parts[:k]) in files), None)
    graph = {}
    for n, p in files.items():
        here = [s for s in n.split('.') if s] if p.name == '__init__.py' else n.split('.')[:-1]  # the package `p` is in
        src, targets = p.read_text(), []
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = here[:len(here) - node.level + 1]
                targets += ['.'.join(base + node.module.split('.'))] if node.module else ['.'.join(base + [a.name]) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('fastai_accum.'):
                targets.append(node.module.removeprefix('fastai_accum.'))
            elif isinstance(node, ast.Import):
                targets += [a.name.removeprefix('fastai_accum.') for a in node.names if a.name.startswith('fastai_accum.')]
        targets += re.findall(r"['\"]fastai_accum\.([\w.]+)['\"]", src)
        graph[n] = {module(t) for t in targets} - {None, n}
    lib_to_lab = {(n, d) for n, ds in graph.items() if n.split('.')[0] != 'lab' for d in ds if d.split('.')[0] == 'lab'}
    assert not lib_to_lab, f"the library imports the lab: {sorted(lib_to_lab)}"
    state = {}
    def visit(n, path):
        if state.get(n) == 'done': return
        assert state.get(n) != 'open', f"import circle: {' -> '.join(path + [n])}"
        state[n] = 'open'
        for d in sorted(graph[n]): visit(d, path + [n])
        state[n] = 'done'
    for n in sorted(graph): visit(n, [])

def _parsers(p, path=()):
    "Every (command path, parser) under argparse parser `p`, itself first."
    import argparse
    yield path, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items(): yield from _parsers(sub, path + (name,))

def test_the_cli_help_reads_as_fastai_s():
    "Every command has a first line and an example that parses; every option says what it does; the top names the demo."
    from fastai_accum.lab.cli import _load_commands, _parser
    _load_commands()
    top = _parser()
    assert 'fastai-accum demo mnist' in top.format_help()
    for path, p in _parsers(top):
        if not path: continue
        assert p.description, path
        subs = [a for a in p._actions if a.__class__.__name__ == '_SubParsersAction']
        if subs: continue  # `bench`: its commands below each have theirs
        assert p.epilog and p.epilog.startswith('Example:'), path
        for line in p.epilog.splitlines()[1:]:
            args = top.parse_args(line.split()[1:])  # parses: the example is a command this CLI takes
            assert args.command == path[0], (line, path)
        for a in p._actions:
            if a.dest != 'help': assert a.help and a.help.strip(), (path, a.option_strings or a.dest)
        assert all(len(l) <= 100 for l in p.format_help().splitlines()), path
