"""BatchNorm's arithmetic has one home (`fastai_accum.stats`, nbs/00_stats): the momentum step with its finite check
(`commit_stats`) and the exact backward from sums (`channel_sums`, `project_`). No other module takes a momentum step,
tests statistics for finiteness or defines a projection of its own: a second copy is found here."""
import ast
from pathlib import Path

PKG = Path(__file__).parents[1]/'fastai_accum'
HOME = 'stats.py'
ARITHMETIC = ('momentum_step', 'stats_finite', 'commit_stats', 'channel_sums', 'project_')

def _second_homes(tree) -> list:
    "Lines where a module does BatchNorm's arithmetic itself: defines one of its functions, steps or checks statistics."
    found = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in ARITHMETIC: found.append(n.lineno)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == 'momentum_step': found.append(n.lineno)
        # `torch.isfinite(st.m2)`: the window statistics' finite check
        if isinstance(n, ast.Attribute) and n.attr == 'm2' and isinstance(n.ctx, ast.Load): found.append(n.lineno)
    return found

def _modules():
    return [p for p in PKG.rglob('*.py') if p.name not in (HOME, '_modidx.py', 'single_file.py')]

def test_batchnorm_arithmetic_has_one_home():
    "The commit (momentum step, finite check) and the projection are defined in stats.py and called from elsewhere."
    home = ast.parse((PKG/HOME).read_text())
    assert {n.name for n in home.body if isinstance(n, ast.FunctionDef)} >= set(ARITHMETIC)
    found = [f'{p.relative_to(PKG)}:{l}' for p in _modules() for l in _second_homes(ast.parse(p.read_text()))]
    assert not found, found
    users = {p.name for p in _modules() if any(f in p.read_text() for f in ('commit_stats(', 'project_('))}
    assert {'batchnorm.py', 'window_stats.py'} <= users  # the accumulating layers and the staged step's statistics alike

def test_the_scan_finds_a_second_home():
    code = ("def project_(f): pass\n"
            "momentum_step(bn, mean, var)\n"
            "ok = torch.isfinite(st.mean).all() & torch.isfinite(st.m2).all()\n")
    assert _second_homes(ast.parse(code)) == [1, 2, 3]
