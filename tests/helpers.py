"Helpers shared by the test modules (tiny fastai Learners, float64 windows, big-batch references): no test module imports another."
from contextlib import nullcontext
import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, MSELossFlat, Callback
from fastai.callback.fp16 import MixedPrecision
import fastai.callback.schedule  # noqa: F401  (patches fit_one_cycle, fine_tune, lr_find onto Learner)
import fastai_accum.all  # noqa: F401  (as in these helpers' first home, tests/test_callback.py: the package's fastai patches loaded)
from fastai_accum.core import Accumulation
from fastai_accum.exact import staging_budget
from dist_helpers import mlp, bn_net  # noqa: F401  (their one home: shared with the distributed scripts)

# A fastai Learner on a small regression problem (from tests/test_callback.py)

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

def params(learn): return torch.cat([p.detach().flatten() for p in learn.model.parameters()])
def rel(a, b): return ((a - b).abs().max() / b.abs().max()).item()

class CountSteps(Callback):
    order = 100
    def before_fit(self): self.steps = 0
    def after_step(self): self.steps += 1

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

# The plain-loop core against the big batch, under a device budget that forces a staged step (from tests/test_exact_or_says_so.py)

def _rel(a, b) -> float:
    "Relative difference; zero below 1e-12 absolute (tensors whose reference is rounding noise, such as biases before a BatchNorm)."
    d = (a - b).abs().max().item()
    return 0. if d <= 1e-12 else d / b.abs().max().item()

def windows(n_win=2, n_step=4, bs=2, seed=0):
    "Micro-batches of (image, target) in float64, `n_step` per window."
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 3, 8, 8, generator=g, dtype=torch.float64) * 2 + 1, torch.randn(bs, 5, generator=g, dtype=torch.float64))
            for _ in range(n_win * n_step)]

def forced_budget(model, micro, n_step):
    "A device budget between one chunk's need and the whole window's: the plan must stage."
    return staging_budget(model, (micro[0],), n_step * micro[0].shape[0])

def train_both(make, policy, n_step=4, context=nullcontext, loss=F.mse_loss, **kw):
    "(max relative difference of parameters and BatchNorm buffers from the big batch after two windows, the core): SGD with momentum."
    batches = windows(n_step=n_step)
    torch.manual_seed(0); big = make().double().train()
    ours = make().double().train(); ours.load_state_dict(big.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (big, ours)]
    acc = Accumulation(ours, n_step=n_step, policy=policy, device_memory=forced_budget(ours, batches[0], n_step), **kw)
    torch.manual_seed(1)
    with context():
        for i in range(0, len(batches), n_step):
            x, y = (torch.cat(t) for t in zip(*batches[i:i + n_step]))
            loss(big(x), y).backward(); opts[0].step(); opts[0].zero_grad()
    torch.manual_seed(1)
    with context():
        for x, y in acc.batches(batches):
            if acc.backward(loss(ours(x), y)): opts[1].step(); opts[1].zero_grad()
    diffs = [_rel(a, b) for a, b in zip(ours.state_dict().values(), big.state_dict().values()) if a.is_floating_point()]
    counts = [[int(b) for n, b in m.state_dict().items() if n.endswith('num_batches_tracked')] for m in (ours, big)]
    assert counts[0] == counts[1], counts
    return max(diffs), acc

def cli_command() -> list:
    "The installed `fastai-accum` console script (next to this interpreter), else its entry point."
    import shutil, sys
    from pathlib import Path
    exe = Path(sys.executable).parent/'fastai-accum'
    if exe.exists(): return [str(exe)]
    found = shutil.which('fastai-accum')
    return [found] if found else [sys.executable, '-c', 'import sys; from fastai_accum.lab.cli import main; sys.exit(main())']

class Dense(nn.Module):
    "A DenseNet block: each layer's BatchNorm reads all the features before it, so each feature is read by every later stage."
    def __init__(self, n=4, g=4, out=3):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bns = nn.ModuleList(nn.BatchNorm2d(8 + i * g) for i in range(n))
        self.convs = nn.ModuleList(nn.Conv2d(8 + i * g, g, 3, padding=1) for i in range(n))
        self.head = nn.Linear(8 + n * g, out)
    def forward(self, x):
        feats = [self.stem(x)]
        for bn, conv in zip(self.bns, self.convs): feats.append(conv(F.relu(bn(torch.cat(feats, 1)))))
        return self.head(torch.cat(feats, 1).mean((2, 3)))


class _Made(list):
    "Staged steps, held weakly: a test's list keeps no step (nor the model copy a check staged) alive."
    def __getitem__(self, i): return super().__getitem__(i)()

def staged_config(monkeypatch, **changes) -> list:
    "Every staged step made from here on runs with `changes` to its `StagedConfig` (a knob a test turns); the steps made."
    import weakref
    from fastai_accum.staged_exact import StagedStep
    init, made = StagedStep.__init__, _Made()
    def changed(self, *a, **k):
        init(self, *a, **k)
        for key, v in changes.items(): setattr(self.config, key, v)
        made.append(weakref.ref(self))
    monkeypatch.setattr(StagedStep, '__init__', changed)
    return made
