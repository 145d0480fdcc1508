"""Every path speaks once, briefly: a one-line pre-flight for each fit (lr_find and a model without BatchNorm included),
micro-batch policies summarised with the full table on request, a warning when a window outgrows the epoch, the
plain-loop core's opt-in pre-flight and its repr, `bn_preflight` printing in full, the paste file's first lines."""
import warnings
from pathlib import Path
import pytest, torch
from torch import nn
import torch.nn.functional as F
from helpers import make_learner, mlp, bn_net, windows, params
from fastai_accum.callback import GradientAccumulation
from fastai_accum.core import Accumulation
from fastai_accum.prepass import bn_preflight

def fit(learn, *args, how='fit', **kw):
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        getattr(learn, how)(*args, **kw)
    return [str(w.message) for w in ws]

def test_a_model_without_batchnorm_says_plain_accumulation_once(capsys):
    learn = make_learner(4, mlp, cbs=GradientAccumulation(n_step=2))
    assert not [w for w in fit(learn, 1, 0.01) if 'GradientAccumulation' in w]  # no warning
    fit(learn, 1, 0.01)
    out = capsys.readouterr().out
    assert out.count("GradientAccumulation: no BatchNorm layer: plain accumulation, each window's gradient (2 micro-batches) is the big batch's.") == 1, out

def test_lr_find_says_how_it_trains(capsys):
    learn = make_learner(4, bn_net, image=True, cbs=GradientAccumulation(n_step=2))
    fit(learn, how='lr_find', num_it=10, show_plot=False)
    assert "GradientAccumulation: policy 'auto' -> 'exact'" in capsys.readouterr().out
    fit(learn, 1, 0.01)  # the fit after it says it again: lr_find's output is a throwaway
    assert capsys.readouterr().out.count("GradientAccumulation: policy 'auto' -> 'exact'") == 1

def test_window_policy_says_a_summary_and_gives_the_table_on_request(capsys):
    ga = GradientAccumulation(n_step=4, policy='window')
    learn = make_learner(2, bn_net, image=True, cbs=ga)
    fit(learn, 1, 0.01); fit(learn, 1, 0.01)
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if 'BatchNorm layers' in l]
    assert len(lines) == 1 and lines[0].startswith("GradientAccumulation: policy 'window' on 2 BatchNorm layers: each micro-batch")
    assert "1 of them sees < 32 values per channel per micro-batch (the window's statistics normalize them)" in lines[0]
    assert '`preflight_table()`' in lines[0] and 'at_risk' not in out  # the table is not printed
    t = ga.preflight_table()
    assert t.values_per_channel.tolist() == [32, 2] and t.at_risk.tolist() == [False, True]
    assert t.backward.tolist() == ['micro-batch, mapped to the window'] * 2  # 2 values: the micro-batch projects
    assert "mapped to the window" in repr(t) and '...' not in repr(t)

def test_bn_preflight_prints_every_column_in_full():
    import torchvision
    t = bn_preflight(torchvision.models.resnet18(num_classes=3).train(), torch.randn(2, 3, 32, 32), window=64)
    text = repr(t)
    assert '...' not in text and len(text.splitlines()) == len(t) + 1 and 'micro-batch stats (512 values), stats updated per micro-batch' in text

@pytest.mark.parametrize('partial,then', [('step', 'one optimizer step per epoch'), ('drop', 'no optimizer step at all')])
def test_a_window_larger_than_the_epoch_is_warned(partial, then):
    learn = make_learner(4, mlp, cbs=GradientAccumulation(n_acc=10000, partial=partial))
    said = [w for w in fit(learn, 1, 0.01) if 'more than an epoch' in w]
    assert said == [f"GradientAccumulation: one window (n_acc=10000 samples) is more than an epoch (72 samples in 18 micro-batches): "
                    f"each epoch is part of one window, {then}" + (" (partial='drop' drops it)" if partial == 'drop' else ', on that part')]
    acc = Accumulation(nn.Linear(2, 1), n_step=10)
    with pytest.warns(UserWarning, match=r'Accumulation: one window \(n_step=10 micro-batches\) is more than an epoch \(4 micro-batches\)'):
        list(acc.batches([(torch.randn(2, 2), torch.randn(2, 1))] * 4))

def test_the_plain_loop_core_says_how_it_trains_when_asked(capsys):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    data = [(torch.randn(4, 3, 8, 8), torch.randint(0, 2, (4,))) for _ in range(8)]
    for say in (False, True):
        acc = Accumulation(m, n_step=4, preflight=say)
        assert repr(acc) == "Accumulation(n_step=4, n_acc=None, policy='auto', steps=0; chosen at the first window)"
        for x, y in acc.batches(data): acc.backward(nn.functional.cross_entropy(m(x), y))
        out = capsys.readouterr().out
        assert out.count("policy 'auto' -> 'exact'") == int(say), out
    assert repr(acc).startswith("Accumulation(n_step=4, n_acc=None, policy='auto', steps=2; exact: a window of 16 samples as one batch needs")

def test_the_paste_file_says_where_it_goes():
    "Its first lines: a cell of its own, or uploaded and run; no future import outside its module (IPython would keep it)."
    text = (Path(__file__).parents[1]/'fastai_accum_single.py').read_text()
    head = text.splitlines()[:5]
    assert any('a notebook cell of its own' in l for l in head) and any('%run fastai_accum_single.py' in l for l in head), head
    assert not text.startswith('from __future__') and '\nfrom __future__' not in text.split("_load_module(r\'\'\'")[0]

def test_a_plan_measured_with_part_of_the_model_frozen_says_so():
    "fine_tune's frozen phase saves fewer activations than the unfrozen one: the same window's estimate differs, and the pre-flight says why."
    import torchvision
    from fastai_accum.exact import plan_exact
    m, x = torchvision.models.resnet18(num_classes=3), torch.randn(2, 3, 32, 32)
    whole = plan_exact(m, (x,), 16)
    for p in list(m.parameters())[:-10]: p.requires_grad_(False)
    frozen = plan_exact(m, (x,), 16)
    assert frozen.host_needed < whole.host_needed and 'frozen' not in whole.describe()
    assert frozen.describe().endswith('; measured with part of the model frozen (unfrozen, it saves more)')

def test_the_preflight_starts_its_own_line_under_a_terminal_progress_bar(capsys):
    "fastprogress's console bar ends its line with no newline: the pre-flight starts a line of its own, not glued to it."
    learn = make_learner(2, bn_net, image=True, cbs=GradientAccumulation(n_step=2))
    learn.fit(1)  # with fastai's progress bar, drawn as in a terminal
    out = capsys.readouterr().out
    assert '|' in out and 'GradientAccumulation:' in out
    assert all(line.startswith('GradientAccumulation:') for line in out.split('\n') if 'GradientAccumulation:' in line), out[:600]

def test_a_staged_plan_says_its_predicted_time_on_each_named_card():
    """On a CPU the staged path's time against naive accumulation's is predicted on the named card classes, labelled a
    prediction; `print(acc)` keeps it, and the ratios are the cost model's on the plan's own measurements."""
    from helpers import train_both
    from fastai_accum.cost import cards, estimate_counts, predict
    make = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                 nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(512, 5))
    _, acc = train_both(make, 'staged')
    plan = acc.plan
    assert acc.path == 'staged exact' and plan.footprint.flops > 0 and plan.footprint.ops > 0
    line = "predicted time per window against naive accumulation's (estimated from one forward; a prediction, not a measurement): "
    assert line in str(acc) and line in plan.describe()
    counts = estimate_counts(plan.window, plan.micro, plan.chunks_a_stage(3), plan.footprint.flops, plan.footprint.ops,
                             plan.staged_host_needed, 4 * 3 * 8 * 8 * 8 * 2, plan.footprint.saved * plan.window)
    for name, card in cards.items():
        p = predict(counts, card)
        assert f"{name} class {p.ratio():.1f}x (bound by {p.bound})" in plan.predicted
    model = make().double()
    whole = Accumulation(model, n_step=2, policy='auto')  # the whole window fits: there is nothing to predict
    for x, y in whole.batches(windows(n_win=1, n_step=2)): whole.backward(F.mse_loss(model(x), y))
    assert whole.path == 'exact' and whole.plan.predicted is None and 'predicted time' not in str(whole)

def test_the_preflight_benchmark_runs():
    """`nbs/bench_preflight.py` (the pre-flight's line beside the ledger's count, nbs/01c) on its smallest row, so that it
    does not rot: a staged plan, each stage estimated in fewer chunks than the micro-batches (the step sizes each stage's
    chunk from its own bytes), its line said."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location('bench_preflight', Path(__file__).parents[1]/'nbs'/'bench_preflight.py')
    bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench)
    r = bench.preflight('resnet18', 64, 16, 150_000_000)
    assert r['path'] == 'staged exact' and 1 <= r['chunks'] < 16 / 2 and r['need'] <= r['budget'], r
    assert 'RTX-3060-12GB class' in r['predicted'], r['predicted']

def test_a_plan_on_a_card_whose_link_binds_makes_stages_again(monkeypatch):
    """On a measured card whose host link binds the staged step (a slow link stands in for a GPU's), the plan asks the
    cost model which stages to make again (`RemadeTime`), says so in its time line, the step makes some again, and
    training is still the big batch's (float64, under `emulated_accelerator`); where compute binds, none."""
    import dataclasses
    import fastai_accum.plan as plan_module
    from fastai_accum.cost import cards, RemadeTime
    from fastai_accum.helpers import emulated_accelerator
    from helpers import staged_config, train_both
    make = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                 nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                                 nn.Flatten(), nn.Linear(512, 5))
    steps = staged_config(monkeypatch)
    for link, made in ((1e-3, True), (1e6, False)):
        card = dataclasses.replace(cards['H200'], link_GBps=link, link_both_GBps=link, measured=('link',))
        monkeypatch.setattr(plan_module, '_this_card', lambda *a, **k: [card])
        diff, acc = train_both(make, 'staged', context=emulated_accelerator)
        assert acc.path == 'staged exact' and diff < 1e-9, diff
        assert isinstance(acc.plan.remade, RemadeTime) == made and ('stages are made again' in str(acc)) == made
        assert 'H200, measured' in acc.plan.predicted
        assert bool(steps[-1].window.remade_stages) == made and steps[-1].config.remade_time == acc.plan.remade

def test_the_class_passed_where_an_instance_belongs_says_what_to_do():
    "`cbs=GradientAccumulation`: fastai makes one with the defaults, silently (issue #76); now a warning at the user's line."
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        learn = make_learner(4, mlp, cbs=GradientAccumulation)
    w = [x for x in said if 'passed as a class' in str(x.message)]
    assert len(w) == 1 and 'cbs=GradientAccumulation(n_step=...)' in str(w[0].message)
    assert w[0].filename.endswith('tests/helpers.py')  # pointed at the line that made the Learner (`make_learner`'s)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        GradientAccumulation(); GradientAccumulation(n_step=4)  # made by the user: nothing to say
    assert not [x for x in said if 'passed as a class' in str(x.message)]

def test_a_window_larger_than_the_epoch_is_said_at_the_users_fit():
    "It pointed at fastai/callback/core.py."
    learn = make_learner(4, mlp, cbs=GradientAccumulation(n_acc=10000, preflight=False))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        learn.fit(1, 0.01)
    w = [x for x in said if 'more than an epoch' in str(x.message)]
    assert len(w) == 1 and w[0].filename == __file__, [(x.filename, x.lineno) for x in w]

def test_the_fit_says_the_progress_bar_counts_windows(capsys):
    "A window trained as one batch is one step of the progress bar: 18 micro-batches show as 5 (it was unsaid)."
    learn = make_learner(4, bn_net, image=True, cbs=GradientAccumulation(n_step=4))
    learn.fit(1, 0.01)
    out = capsys.readouterr().out
    assert "-> 'exact'" in out and 'the progress bar counts windows' in out, out

def test_a_window_larger_than_the_epoch_is_planned_and_said_as_the_epoch(capsys):
    "n_acc=10000 over 72 samples trains one step per epoch on those 72: the plan and the fit's line are for 72 (they said 10,000)."
    learn = make_learner(4, bn_net, image=True, cbs=GradientAccumulation(n_acc=10000))
    before = params(learn)
    fit(learn, 1, 0.01)
    out = capsys.readouterr().out
    assert 'a window of 72 samples' in out and '10000' not in out, out
    assert learn.gradient_accumulation.steps == 1 and not torch.equal(params(learn), before)
