"""Ghost batches (`bn_batch=k`): one window step equals the big batch whose BatchNorm layers normalize per group of k
consecutive samples (a hand-written float64 reference, running statistics stepped once per group), for micro-batches of
2 and 4, k from 2 to the whole window, a BatchNorm CNN and a timm model, through the plain-loop core and the v2 callback."""
import copy, warnings
import pytest, torch
from torch import nn
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, MSELossFlat
from torch.utils.data import TensorDataset
from fastai_accum.all import *
from fastai_accum.batchnorm import _after_norm

W = 16  # samples per window

class GhostRef(nn.Module):
    "BatchNorm `bn` (its parameters and buffers) normalizing each group of k samples by hand: `x.view(W // k, k, ...)`."
    def __init__(self, bn, k): super().__init__(); self.bn, self.k = bn, k
    def forward(self, x):
        bn, k, (n, c) = self.bn, self.k, x.shape[:2]
        if not bn.training: return bn(x)  # validation: the running statistics
        g = x.reshape(n // k, k, c, -1)
        mean, var = g.mean((1, 3), keepdim=True), g.var((1, 3), unbiased=False, keepdim=True)
        m = k * g.shape[3]
        with torch.no_grad():
            for i in range(n // k):
                bn.running_mean.mul_(1 - bn.momentum).add_(bn.momentum * mean[i].flatten())
                bn.running_var.mul_(1 - bn.momentum).add_(bn.momentum * var[i].flatten() * m / (m - 1))
            bn.num_batches_tracked += n // k
        y = ((g - mean) / (var + bn.eps).sqrt() * bn.weight.view(1, 1, c, 1) + bn.bias.view(1, 1, c, 1)).view_as(x)
        return _after_norm(bn, y)

def ghost_reference(model, k):
    "A copy of `model` with every BatchNorm layer behind a `GhostRef` of `k` samples."
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        for cname, child in list(m.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm): setattr(m, cname, GhostRef(child, k))
    return ref

def cnn(): return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, bias=False), nn.BatchNorm2d(4),
                                nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
def timm_net():
    import timm
    return timm.create_model('resnet10t', num_classes=1, pretrained=False)

MODELS = {'cnn': (cnn, 8), 'timm': (timm_net, 32)}  # builder, image size

def data(size, n=W):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, size, size, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2, n, dtype=torch.float64).view(n, 1, 1, 1)
    return x, torch.randn(n, 1, generator=g, dtype=torch.float64)

def rel(a, b): return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
def state(m): return [t.detach().double() for t in m.state_dict().values() if t.is_floating_point()]
def grads(m): return [p.grad for p in m.parameters()]

def grid(test):
    "Run `test` for k in 2, 4, 8, 16 (the window), micro-batches of 2 and 4, the BatchNorm CNN and the timm model."
    for name, values in (('k', [2, 4, 8, 16]), ('micro', [2, 4]), ('model', ['cnn', 'timm'])): test = pytest.mark.parametrize(name, values)(test)
    return test

def assert_equal(got, ref):
    "Every tensor within 1e-9 of its reference, relative to the largest value of the reference tensors together."
    scale = max(b.abs().max().item() for b in ref)
    for a, b in zip(got, ref): assert (a - b).abs().max().item() <= 1e-9 * max(b.abs().max().item(), 1e-3 * scale)

@grid
def test_core_window_step_equals_ghost_reference(model, micro, k):
    "One window of 16 through `Accumulation(bn_batch=k)`: gradients, then parameters and running statistics after SGD."
    build, size = MODELS[model]
    torch.manual_seed(0); net = build().double().train()
    ref = ghost_reference(net, k)
    x, y = data(size)
    nn.functional.mse_loss(ref(x), y).backward()
    acc = Accumulation(net, n_step=W // micro, bn_batch=k)
    for xb, yb in acc.batches([(x[i:i + micro], y[i:i + micro]) for i in range(0, W, micro)]):
        assert acc.backward(nn.functional.mse_loss(net(xb), yb))  # the window arrives as one batch
    assert acc.path == 'exact'
    assert_equal(grads(net), grads(ref))
    for m in (net, ref):
        with torch.no_grad():
            for p in m.parameters(): p -= 0.1 * p.grad
    assert_equal(state(net), state(ref))
    assert all(type(m).forward is m.forward.__func__ for m in net.modules() if isinstance(m, nn.BatchNorm2d))  # plain layers after

@grid
def test_v2_callback_two_windows_equal_ghost_reference(model, micro, k):
    "fastai v2 `GradientAccumulation(bn_batch=k)`: two windows of 16 (SGD) equal the reference trained at batch 16."
    build, size = MODELS[model]
    x, y = data(size, 2 * W)
    def learner(bs, model, cbs=None):
        dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=bs), DataLoader(TensorDataset(x[:8], y[:8]), bs=bs))
        return Learner(dls, model, loss_func=MSELossFlat(), opt_func=SGD, cbs=cbs)
    torch.manual_seed(0); net = build().double()
    ref = learner(W, ghost_reference(net, k))
    learn = learner(micro, net, GradientAccumulation(n_step=W // micro, bn_batch=k, preflight=False))
    for l in (ref, learn):
        with l.no_bar(), l.no_logging(): l.fit(1, 0.1)
    assert learn.gradient_accumulation.steps == 2
    assert_equal(state(learn.model), state(ref.model))

def test_wrong_bn_batch_is_refused_before_the_first_step():
    x, y = data(8)
    for k, msg in [(3, 'must divide the window of 16'), (32, 'must divide'), (1, 'BatchNorm1d layer would normalize one value')]:
        acc = Accumulation(cnn().double(), n_step=8, bn_batch=k)
        with pytest.raises(ValueError, match=msg):
            for _ in acc.batches([(x[i:i + 2], y[i:i + 2]) for i in range(0, W, 2)]): pass
    with pytest.raises(ValueError, match='bn_batch must be a positive integer'): Accumulation(cnn(), n_step=8, bn_batch=2.5)
    with pytest.raises(ValueError, match="policy must be 'auto' or 'exact'"): GradientAccumulation(n_step=8, bn_batch=4, policy='window')
    acc = Accumulation(cnn().double(), n_step=8, bn_batch=4, device_memory=1)  # the window does not fit as one batch
    with pytest.raises(Exception, match=r'ghost batches larger than the micro-batch \(2\) need each window trained as one batch'):
        for _ in acc.batches([(x[i:i + 2], y[i:i + 2]) for i in range(0, W, 2)]): pass

def test_window_too_big_ghost_batches_within_the_micro_batch_train_micro_batch_by_micro_batch():
    "A device budget below the window: k dividing the micro-batch trains each micro-batch on its own, still the reference."
    torch.manual_seed(0); net = cnn().double().train()
    ref = ghost_reference(net, 2)
    x, y = data(8)
    nn.functional.mse_loss(ref(x), y).backward()
    acc = Accumulation(net, n_step=4, bn_batch=2, device_memory=1)
    for xb, yb in acc.batches([(x[i:i + 4], y[i:i + 4]) for i in range(0, W, 4)]): acc.backward(nn.functional.mse_loss(net(xb), yb))
    assert acc.path == 'ghost micro-batches' and 'each micro-batch of 4 trains on its own' in acc.preflight((x[:4],))
    assert_equal(grads(net), grads(ref))
    assert_equal(state(net), state(ref))
