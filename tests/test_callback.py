"GradientAccumulation (fastai v2): exact steps, BatchNorm statistics, window hygiene, fastai integrations."
import math, warnings
import pytest, torch
from torch import nn
from torch.utils.data import TensorDataset
from fastai.basics import DataLoaders, DataLoader, SGD, Adam, Callback, CancelFitException, CancelEpochException
import fastai.callback.schedule  # noqa: F401  (patches fit_one_cycle, fine_tune, lr_find onto Learner)
from fastai.callback.training import GradientClip, BnFreeze
from fastai_accum.all import *
from fastai_accum.batchnorm import bn_layers
from helpers import make_learner, mlp, bn_net, params, rel, CountSteps, counted_mixed_precision

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
    assert len(ga.losses) == ga.steps == 9
    tracked = [bn.num_batches_tracked.item() for bn in bn_layers(learn.model)]
    learn.validate()
    assert [bn.num_batches_tracked.item() for bn in bn_layers(learn.model)] == tracked

def norm_types(model): return {type(m) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}

@pytest.mark.parametrize('policy', ['auto', 'exact', 'window', 'micro', 'running', 'frozen'])
def test_plain_torch_norm_layers_between_fits_whatever_the_policy(policy):
    learn = make_learner(2, bn_net, image=True, cbs=GradientAccumulation(n_step=2, policy=policy, preflight=False))
    learn.fit(1, lr=0.01)
    assert norm_types(learn.model) == {nn.BatchNorm2d, nn.BatchNorm1d}
    learn.get_preds(); learn.validate()
    assert norm_types(learn.model) == {nn.BatchNorm2d, nn.BatchNorm1d}
    try: learn.fit(1, lr=0.01, cbs=Interrupt(KeyboardInterrupt()))
    except KeyboardInterrupt: pass
    assert norm_types(learn.model) == {nn.BatchNorm2d, nn.BatchNorm1d}

def test_layers_wrapped_by_the_user_keep_their_policy():
    learn = make_learner(2, bn_net, image=True, cbs=GradientAccumulation(n_step=2, wrap=False, policy='micro'))
    wrap_bn(learn.model, 'running')
    learn.fit(1, lr=0.01)
    assert [m.policy for m in bn_layers(learn.model, accumulating=True)] == ['running', 'running']
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

def write_images(root, n=8, size=32):
    "A two-class image folder (train/valid) of small random PNGs, the classes told apart by their red channel."
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, k in (('train', n), ('valid', n // 2)):
        for c, shade in (('a', 200), ('b', 30)):
            (root/split/c).mkdir(parents=True, exist_ok=True)
            for i in range(k):
                a = rng.integers(0, 255, (size, size, 3), dtype=np.uint8); a[..., 0] = shade
                Image.fromarray(a).save(root/split/c/f'{i}.png')
    return root

LOAD_WITHOUT_PACKAGE = '''
import sys, warnings; warnings.simplefilter('ignore')
sys.modules['fastai_accum'] = None  # as in a process where the package is not installed
import torch
from fastai.vision.all import *
learn = load_learner(sys.argv[1])
assert not any('fastai_accum' in type(c).__module__ for c in learn.cbs), learn.cbs
assert not any('fastai_accum' in type(m).__module__ for m in learn.model.modules())
files = sorted(get_image_files(Path(sys.argv[2])))
torch.save(learn.get_preds(dl=learn.dls.test_dl(files))[0], sys.argv[3])
'''

def test_export_loads_without_the_package_and_trains_on_with_it(tmp_path):
    import subprocess, sys
    from fastai.vision.all import ImageDataLoaders, vision_learner, resnet18, load_learner, get_image_files
    path = write_images(tmp_path)
    dls = ImageDataLoaders.from_folder(path, bs=2, num_workers=0)
    ga = GradientAccumulation(n_step=4, policy='window', preflight=False)  # 'window' wraps BatchNorm during fits
    learn = vision_learner(dls, resnet18, pretrained=False, cbs=ga)
    learn.fit(1, 1e-3); learn.get_preds(); learn.tta(n=1)
    assert not any(isinstance(m, AccumulateBatchNorm) for m in learn.model.modules())
    learn.export('export.pkl')
    r = subprocess.run([sys.executable, '-c', LOAD_WITHOUT_PACKAGE, str(path/'export.pkl'), str(path/'valid'), str(path/'preds.pt')],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(get_image_files(path/'valid'))
    preds = learn.get_preds(dl=learn.dls.test_dl(files))[0]
    assert torch.allclose(torch.load(path/'preds.pt'), preds, atol=1e-6)
    loaded = load_learner(path/'export.pkl')  # here the package is installed: the same callback, and training goes on
    cb = loaded.gradient_accumulation
    assert type(cb) is GradientAccumulation and (cb.n_step, cb.policy, cb.preflight) == (4, 'window', False) and cb.learn is loaded
    loaded.dls = dls
    loaded.fit(1, 1e-3)
    assert cb.steps == 2

def test_untraceable_model_reason_said_once_in_one_line(capsys):
    "fastai's DynamicUnet (its hooks) defeats torch.fx: the pre-flight says why in one full line, once, not in every row."
    from fastai.vision.all import unet_learner, resnet18, CrossEntropyLossFlat
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 2, (8, 32, 32), generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=2), DataLoader(TensorDataset(x[:4], y[:4]), bs=2))
    learn = unet_learner(dls, resnet18, pretrained=False, n_out=2, loss_func=CrossEntropyLossFlat(axis=1),
                         cbs=GradientAccumulation(n_step=2, policy='window'))
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always'); learn.fit(1, 1e-3)
    out = capsys.readouterr().out
    said = [l for l in out.splitlines() if 'cannot trace' in l]
    assert len(said) == 1 and said[0].startswith('GradientAccumulation: torch.fx cannot trace DynamicUnet (') and \
           said[0].endswith('its activations grow with the window.'), out
    assert 'Error' not in out.replace(said[0], '') and 'whole window (not traceable)' in out
    assert not [w for w in ws if 'cannot trace' in str(w.message)]  # said once: not also as a warning

class ValueGate(nn.Module):
    "A branch on the values it computes: neither torch.fx nor the aten-level trace can follow it."
    def __init__(self): super().__init__(); self.body = bn_net()
    def forward(self, x): return self.body(x) if x.abs().sum() >= 0 else -self.body(x)

def test_untraceable_model_without_room_for_the_window_says_why_not_staged(capsys):
    "Neither tracer follows the model, the default policy, a budget below the whole window: window BN, and why."
    ga = GradientAccumulation(n_step=2, device_memory=2**12)
    learn = make_learner(4, ValueGate, image=True, cbs=ga)
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore'); learn.fit(1, 1e-3)
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if "policy 'auto' ->" in l)
    assert line.startswith("GradientAccumulation: policy 'auto' -> window BatchNorm: ") and \
           'staged exact cannot run: neither torch.fx (TraceError' in line and 'nor an aten-level trace (' in line, out
    assert out.count('TraceError') == 1 and ga.path == 'window'

def test_each_fit_chooses_its_path_from_the_modes_it_trains_in(capsys):
    "Three fits in a row, and a fit after validate: each 'exact' (fastai leaves the model in eval mode after a fit)."
    ga = GradientAccumulation(n_step=4)
    learn = make_learner(2, bn_net, image=True, cbs=ga)
    paths = []
    for _ in range(3): learn.fit(1, lr=0.01); paths.append(ga.path)
    learn.validate(); learn.fit(1, lr=0.01); paths.append(ga.path)
    assert paths == ['exact'] * 4
    assert capsys.readouterr().out.count("-> 'exact'") == 1
    for m in bn_layers(learn.model): m.requires_grad_(False)
    learn.fit(1, lr=0.01, cbs=BnFreeze())  # every BatchNorm layer frozen now: the fit says it trains otherwise
    out = capsys.readouterr().out
    assert "trains otherwise than the one before ('exact' -> 'frozen BatchNorm')" in out and 'are frozen (eval mode)' in out

def test_staged_window_inputs_wait_where_inputs_on_says(monkeypatch):
    """On an accelerator a staged window's model inputs wait in host memory (`Accumulation.inputs_on`): the loader joins
    them there and fastai's `_set_device` leaves them alone, targets going to the device. On the CPU inside
    `emulated_accelerator` (the accelerator's branches): fastai gets the loader's input tensor itself, training is still
    the big batch (float64) and the fit leaves no patch behind."""
    from fastai_accum.callback import WindowPrefetch
    from fastai_accum.helpers import emulated_accelerator
    kept, set_device = [], WindowPrefetch._set_device
    def spy(self, b):
        out = set_device(self, b)
        if self.learn.dl is self.loader: kept.append(out[0] is b[0])
        return out
    monkeypatch.setattr(WindowPrefetch, '_set_device', spy)
    big = make_learner(16, bn_net, image=True, dtype=torch.float64)
    ga = GradientAccumulation(n_step=4, policy='staged', preflight=False)
    acc = make_learner(4, bn_net, image=True, dtype=torch.float64, cbs=ga)
    with big.no_bar(), big.no_logging(): big.fit(1, 1e-2)
    with acc.no_bar(), acc.no_logging(), emulated_accelerator(): acc.fit(1, 1e-2)
    assert kept and all(kept) and len(kept) == ga.steps == 5 and ga.plan.on_accelerator
    assert ga.path == 'staged exact' and '_set_device' not in acc.__dict__
    assert rel(params(acc), params(big)) < 1e-9
