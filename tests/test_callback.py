"GradientAccumulation (fastai v2): exact steps, BatchNorm statistics, window hygiene, fastai integrations."
import math, warnings
import pytest, torch
from torch import nn
from torch.utils.data import TensorDataset
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, Adam, MSELossFlat, Callback, CancelFitException, CancelEpochException
from fastai.callback.fp16 import MixedPrecision
import fastai.callback.schedule  # noqa: F401  (patches fit_one_cycle, fine_tune, lr_find onto Learner)
from fastai.callback.training import GradientClip, BnFreeze
from fastai_accum.all import *

def make_data(n=72, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g); y = (x @ torch.randn(d, 1, generator=g) + 0.1*torch.randn(n, 1, generator=g))
    return x, y

def make_learner(bs, model_fn, n=72, opt_func=SGD, seed=0, cbs=None, image=False, dtype=torch.float32, **kw):
    x, y = make_data(n, seed=seed)
    x, y = x.to(dtype), y.to(dtype)
    if image: x = x.repeat_interleave(8, 1).view(n, 3, 4, 4)  # 48 values -> (3,4,4)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=bs), DataLoader(TensorDataset(x[:16], y[:16]), bs=bs))
    torch.manual_seed(seed)
    return Learner(dls, model_fn().to(dtype), loss_func=MSELossFlat(), opt_func=opt_func, cbs=cbs, **kw)

def mlp(): return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
def bn_net(): return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                   nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

def params(learn): return torch.cat([p.detach().flatten() for p in learn.model.parameters()])
def rel(a, b): return ((a - b).abs().max() / b.abs().max()).item()

class CountSteps(Callback):
    order = 100
    def before_fit(self): self.steps = 0
    def after_step(self): self.steps += 1

@pytest.mark.parametrize('opt_func', [SGD, Adam], ids=['SGD', 'Adam'])
@pytest.mark.parametrize('mode', [dict(n_step=4), dict(n_acc=16)], ids=['n_step', 'n_acc'])
def test_bn_free_model_matches_big_batch(opt_func, mode):
    "72 samples: micro 4 x 4 (last window 2 micro-batches = 8 samples) vs bs 16 (last batch 8): same parameters."
    acc = make_learner(4, mlp, opt_func=opt_func)
    big = make_learner(16, mlp, opt_func=opt_func)
    acc.fit(2, lr=0.05, cbs=GradientAccumulation(**mode))
    big.fit(2, lr=0.05)
    assert rel(params(acc), params(big)) <= 1e-6

@pytest.mark.parametrize('partial,expected', [('step', math.ceil(18/4)), ('drop', 18//4)])
def test_optimizer_steps_per_epoch(partial, expected):
    count = CountSteps()
    learn = make_learner(4, mlp, cbs=count)  # 72/4 = 18 micro-batches per epoch
    learn.fit(2, lr=0.01, cbs=GradientAccumulation(n_step=4, partial=partial))
    assert count.steps == 2 * expected

def test_sum_reduction_loss_is_not_weighted():
    "With reduction='sum' the window's summed loss is the big batch's summed loss: no weights, same parameters."
    acc, big = make_learner(4, mlp), make_learner(16, mlp)
    for l in (acc, big): l.loss_func = nn.MSELoss(reduction='sum')
    acc.fit(1, lr=1e-3, cbs=GradientAccumulation(n_step=4)); big.fit(1, lr=1e-3)
    assert rel(params(acc), params(big)) <= 1e-6

class RecordBNInputs(Callback):
    "Records, per BN layer, the float64 input of every training micro-batch with the window (optimizer step) it fell in."
    order = 100
    def before_fit(self):
        self.records = {bn: [] for bn in bn_layers(self.model)}
        self.hooks = [bn.register_forward_pre_hook(self._hook) for bn in self.records]
        self.window = 0
    def _hook(self, bn, inp):
        if bn.training and bn._prepass is None:  # training forwards only, not the window policy's pre-passes
            self.records[bn].append((self.epoch, self.window, inp[0].detach().double()))
    def after_step(self): self.window += 1
    def after_epoch(self): self.window = 0
    def after_fit(self): [h.remove() for h in self.hooks]

@pytest.mark.parametrize('policy,count', [('micro', dict(n_step=4)), ('window', dict(n_step=4)), ('window', dict(n_acc=8))],
                         ids=['micro', 'window', 'window_n_acc'])
def test_bn_running_stats_equal_float64_reference_from_same_windows(policy, count):
    rec = RecordBNInputs()
    learn = make_learner(2, bn_net, image=True)
    learn.fit(2, lr=0.01, cbs=[GradientAccumulation(policy=policy, **count), rec])  # 36 micro-batches/epoch: 9 windows
    for bn, items in rec.records.items():
        ref = nn.BatchNorm1d(bn.num_features).double()
        windows = {}
        for e, w, x in items: windows.setdefault((e, w), []).append(x)
        for k in sorted(windows):
            x = torch.cat(windows[k]); ref(x.reshape(x.shape[0], x.shape[1], -1))
        assert bn.num_batches_tracked.item() == ref.num_batches_tracked.item() == 18
        assert rel(bn.running_mean.double(), ref.running_mean) <= 1e-5
        assert rel(bn.running_var.double(), ref.running_var) <= 1e-5

def no_pending_state(learn):
    grads_clear = all(p.grad is None or not p.grad.any() for p in learn.model.parameters())
    return grads_clear and all(bn.pending.count == 0 for bn in bn_layers(learn.model, accumulating=True))

class Interrupt(Callback):
    order = 100
    def __init__(self, exc, at=5): self.exc, self.at = exc, at
    def after_batch(self):
        if self.training and self.iter == self.at: raise self.exc

@pytest.mark.parametrize('exc', [KeyboardInterrupt(), RuntimeError('boom'), CancelFitException(), CancelEpochException()],
                         ids=['KeyboardInterrupt', 'RuntimeError', 'CancelFit', 'CancelEpoch'])
def test_interrupted_fit_leaves_no_pending_state_and_next_fit_starts_fresh(exc):
    learn = make_learner(2, bn_net, image=True)
    try: learn.fit(1, lr=0.01, cbs=[GradientAccumulation(n_step=4), Interrupt(exc)])  # stops mid-window (6th micro-batch)
    except (KeyboardInterrupt, RuntimeError): pass
    assert no_pending_state(learn)
    assert '_do_epoch' not in learn.__dict__
    # the next fit equals a fresh learner started from the same weights and statistics
    fresh = make_learner(2, bn_net, image=True)
    wrap_bn(fresh.model)
    fresh.model.load_state_dict(learn.model.state_dict())
    learn.fit(1, lr=0.01, cbs=GradientAccumulation(n_step=4))
    fresh.opt = None
    fresh.fit(1, lr=0.01, cbs=GradientAccumulation(n_step=4))
    assert rel(params(learn), params(fresh)) <= 1e-6

def test_partial_drop_does_not_leak_into_next_fit():
    a, b = make_learner(4, mlp), make_learner(4, mlp)
    for _ in range(2): a.fit(1, lr=0.05, cbs=GradientAccumulation(n_step=4, partial='drop'))
    assert no_pending_state(a)
    b.fit(1, lr=0.05, cbs=GradientAccumulation(n_step=4, partial='drop'))
    b.opt.zero_grad(); b.fit(1, lr=0.05, cbs=GradientAccumulation(n_step=4, partial='drop'))
    assert rel(params(a), params(b)) == 0

def counted_mixed_precision(monkeypatch):
    "A bf16 `MixedPrecision` whose scaler steps are counted in `steps`, and a count of gradient clips in `clips`."
    clips, steps = [], []
    orig = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, 'clip_grad_norm_', lambda *a, **k: clips.append(1) or orig(*a, **k))
    mp = MixedPrecision(amp_mode='bf16')
    orig_fit = mp.before_fit
    def before_fit():
        orig_fit()
        s = mp.learn.scaler.step
        mp.learn.scaler.step = lambda *a, **k: steps.append(1) or s(*a, **k)
    mp.before_fit = before_fit
    return mp, steps, clips

def test_mixed_precision_and_gradient_clip_once_per_window(monkeypatch):
    mp, steps, clips = counted_mixed_precision(monkeypatch)
    learn = make_learner(4, mlp, cbs=[mp, GradientClip(max_norm=0.05)])
    learn.fit(1, lr=0.05, cbs=GradientAccumulation(n_step=4))
    assert len(steps) == len(clips) == math.ceil(18/4)

def test_gradient_clip_clips_the_accumulated_gradient():
    acc = make_learner(4, mlp, cbs=GradientClip(max_norm=0.05))
    big = make_learner(16, mlp, cbs=GradientClip(max_norm=0.05))
    acc.fit(1, lr=0.1, cbs=GradientAccumulation(n_step=4)); big.fit(1, lr=0.1)
    assert rel(params(acc), params(big)) <= 1e-6

def test_validation_never_accumulates_and_window_losses_recorded():
    ga = GradientAccumulation(n_step=4)
    learn = make_learner(2, bn_net, image=True, cbs=ga)
    learn.fit(1, lr=0.01)
    assert len(ga.losses) == ga.n_steps == 9
    tracked = [bn.num_batches_tracked.item() for bn in bn_layers(learn.model)]
    learn.validate()
    assert [bn.num_batches_tracked.item() for bn in bn_layers(learn.model)] == tracked

def test_stays_wrapped_after_fit_and_unwrap_gives_plain_bn():
    learn = make_learner(2, bn_net, image=True, cbs=GradientAccumulation(n_step=2, policy='window'))
    learn.fit(1, lr=0.01)
    assert all(isinstance(m, AccumulateBatchNorm) for m in bn_layers(learn.model))
    assert unwrap_bn(learn.model) == 2 and type(learn.model[1]) is nn.BatchNorm2d
    learn2 = make_learner(2, bn_net, image=True, cbs=GradientAccumulation(n_step=2, wrap=False))
    learn2.fit(1, lr=0.01)
    assert not any(isinstance(m, AccumulateBatchNorm) for m in learn2.model.modules())

def test_fit_one_cycle_fine_tune_lr_find_and_bnfreeze():
    def splitter(m): return [list(m[:2].parameters()), list(m[2:].parameters())]
    learn = make_learner(2, bn_net, image=True, cbs=GradientAccumulation(n_step=4, policy='window'), splitter=splitter)
    learn.fit_one_cycle(1, 1e-2)
    learn.fine_tune(1, 1e-2, freeze_epochs=1)
    assert no_pending_state(learn)
    with pytest.warns(UserWarning, match='num_it'): learn.lr_find(num_it=20, stop_div=False, show_plot=False)

def test_bnfreeze_keeps_frozen_bn_statistics():
    "fastai's BnFreeze puts BatchNorm of frozen groups in eval mode: wrapped layers then never move; the others accumulate."
    def splitter(m): return [list(m[:2].parameters()), list(m[2:].parameters())]
    learn = make_learner(2, bn_net, image=True, cbs=GradientAccumulation(n_step=4), splitter=splitter, train_bn=False)
    learn.freeze()
    before = learn.model[1].running_mean.clone()
    learn.fit(1, lr=1e-2, cbs=BnFreeze())
    assert torch.equal(learn.model[1].running_mean, before)
    assert learn.model[1].num_batches_tracked.item() == 0
    assert learn.model[5].num_batches_tracked.item() == 9

def test_model_without_bn_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        make_learner(4, mlp).fit(1, lr=0.01, cbs=GradientAccumulation(n_step=2))

def test_preflight_table_printed_once(capsys):
    ga = GradientAccumulation(n_step=4, policy='window')
    learn = make_learner(2, bn_net, image=True, cbs=ga)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, lr=0.01)
    out = capsys.readouterr().out
    assert out.count('GradientAccumulation: 2 BatchNorm layers, 1 with < 32 values per channel') == 1
    assert "previous window's means" in out and 'micro-batch, mapped to the window' in out
    assert bn_preflight(learn.model, torch.randn(2, 3, 4, 4)).values_per_channel.tolist() == [32, 2]
