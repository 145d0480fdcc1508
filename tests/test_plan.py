"The path a fit trains on is decided in one place, `fastai_accum/plan.py`, and every reader takes it from there."
import ast, copy, pathlib
import pytest, torch
from torch import nn
import fastai_accum
from fastai_accum.core import Accumulation
from fastai_accum.plan import TrainingPlan, plan_training

PKG = pathlib.Path(fastai_accum.__file__).parent
PATH_POLICIES = {'auto', 'exact', 'staged'}  # the policies that name a path rather than what a BatchNorm layer does
BUDGET_READS = {'device_budget', 'host_budget', 'fits', 'device_needed', 'host_needed', 'staged_device_needed',
                'staged_host_needed'}
DECIDERS = {'choose_exact', 'auto_picks_exact', 'plan_exact'}  # the planner's own steps
# Modules allowed to name a path policy in a comparison, and why
NAMES_POLICIES = {'plan.py': 'the planner',
                  'check.py': "check_accumulation replays the policy it is asked to check on copies of the model; "
                              "its 'auto' is resolved by the planner (`resolve_auto`)"}
READS_BUDGETS = {'plan.py': 'the planner', 'exact.py': "the memory plan's own arithmetic and description"}

def _modules():
    return [p for p in sorted(PKG.rglob('*.py')) if p.name not in ('_modidx.py',)]

def _path_policy_comparisons(tree) -> list:
    "Line numbers of comparisons of a policy (a name or attribute that says `policy`) with 'auto', 'exact' or 'staged'."
    def names_path(node):
        if isinstance(node, ast.Constant): return node.value in PATH_POLICIES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)): return any(names_path(e) for e in node.elts)
        return False
    def is_policy(node): return 'policy' in ast.unparse(node)  # `policy`, `self.policy`, `s.policy`, `default_policy()`
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
            and any(names_path(x) for x in [n.left, *n.comparators]) and any(is_policy(x) for x in [n.left, *n.comparators])]

def _budget_reads(tree) -> list:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in BUDGET_READS]

def _decider_calls(tree) -> list:
    def name(f): return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and name(n.func) in DECIDERS]

def test_the_path_is_decided_in_the_planner_only():
    "No module but the planner compares path policies, reads memory budgets or calls the planner's own steps."
    found = []
    for p in _modules():
        tree, rel = ast.parse(p.read_text()), p.relative_to(PKG).as_posix()
        if rel == 'single_file.py': continue
        if rel not in NAMES_POLICIES: found += [f'{rel}:{l} compares a path policy' for l in _path_policy_comparisons(tree)]
        if rel not in READS_BUDGETS: found += [f'{rel}:{l} reads a memory budget' for l in _budget_reads(tree)]
        if rel not in ('plan.py', 'exact.py'): found += [f'{rel}:{l} calls a step of the planner' for l in _decider_calls(tree)]
    assert not found, '\n'.join(found)

def test_the_scan_finds_a_second_decision():
    "The scan above is not blind: each kind of second decision is found."
    code = ("policy = 'window' if self.policy == 'auto' else self.policy\n"
            "if plan.device_budget is not None and plan.fits: pass\n"
            "exact, plan = choose_exact('auto', model, peek, 4)\n"
            "if mode == 'staged' or p in ('auto',): pass\n")  # a pre-pass mode, a list of settings: not a path policy
    tree = ast.parse(code)
    assert (_path_policy_comparisons(tree), _budget_reads(tree), _decider_calls(tree)) == ([1], [2, 2], [3])

def bn_net(): return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

@pytest.mark.parametrize('device_memory,path', [(None, 'exact'), (1, 'window')])
def test_the_core_trains_and_the_preflight_prints_what_the_plan_says(device_memory, path):
    "The core's path, memory plan and pre-flight are the plan's (whole window, or window BN with the reason)."
    torch.manual_seed(0)
    model = bn_net()
    data = [(torch.randn(4, 6), torch.randn(4, 1)) for _ in range(4)]
    acc = Accumulation(model, n_step=2, device_memory=device_memory)
    for xb, yb in acc.batches(data):
        if acc.how is not None and acc.steps == 0 and acc.window.empty:
            assert isinstance(acc.how, TrainingPlan) and (acc.path, acc.plan, acc.exact) == (acc.how.path, acc.how.memory, acc.how.exact)
            assert acc.preflight((xb,)).startswith(acc.how.headline())
        acc.backward(nn.functional.mse_loss(model(xb), yb))
    assert acc.how.path == path and acc.steps == 2

def test_the_planner_and_the_checker_agree():
    "`check_accumulation`'s 'auto' is the planner's decision."
    from fastai_accum.check import resolve_auto
    model, xb = bn_net().train(), (torch.randn(4, 6),)
    assert resolve_auto(model, xb, 8)[0] == ('exact' if plan_training('auto', model, lambda: xb, n_acc=8).exact else 'window')

def test_the_core_notebook_reads_in_cells_of_at_most_60_lines():
    "`nbs/02d_core.ipynb`, the story of one window: no code cell over 60 lines."
    import json
    nb = json.loads((PKG.parent/'nbs'/'02d_core.ipynb').read_text())
    long = {c['id']: n for c in nb['cells'] if c['cell_type'] == 'code' and (n := len(''.join(c['source']).splitlines())) > 60}
    assert not long, long

@pytest.mark.parametrize('policy', ['staged', 'exact'])
def test_a_whole_window_policy_on_a_model_without_batchnorm_trains_plainly(policy):
    "Nothing to be exact about (no BatchNorm trains): plain accumulation is the big batch's step, without a staged step's cost."
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 1)).double()
    big = copy.deepcopy(model)
    data = [(torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.randn(2, 1, dtype=torch.float64)) for _ in range(4)]
    acc = Accumulation(model, n_step=4, policy=policy)
    for xb, yb in acc.batches(data):
        assert 'forward' not in vars(model)  # no staged step installed
        acc.backward(nn.functional.mse_loss(model(xb), yb))
    x, y = (torch.cat(t) for t in zip(*data))
    nn.functional.mse_loss(big(x), y).backward()
    assert acc.path == 'no BatchNorm' and acc.steps == 1
    for p, q in zip(model.parameters(), big.parameters()): assert (p.grad - q.grad).abs().max() <= 1e-12 * q.grad.abs().max()
