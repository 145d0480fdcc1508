"The window policy's pre-pass: exact window statistics in one pass, within the training footprint (issue #14)."
import copy, warnings
import pytest, torch
from torch import nn
from fastai_accum.batchnorm import wrap_bn, bn_layers, update_bn_stats
from fastai_accum.prepass import window_prepasses, prepass_plan, prepass_info, bn_preflight

def window_error(layers, ref) -> float:
    "max over layers/channels of |d mean|/std + |log var ratio| against `ref` [(mean, biased var)]."
    e = 0.
    for m, (mu, var) in zip(layers, ref):
        wm, wv = m.window_stats
        e = max(e, ((wm - mu).abs() / var.sqrt() + (wv / var).log().abs()).max().item())
    return e

def grads(model): return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

def train_window(model, xbs, ys, **kw):
    "One window: the pre-pass, then forward/backward of every micro-batch (gradients accumulate), then the commit."
    window_prepasses(model, xbs, **kw)
    info = prepass_info(model)
    for xb, y in zip(xbs, ys): nn.functional.cross_entropy(model(*xb), y).backward()
    stats = [tuple(t.clone() for t in m.window_stats) for m in bn_layers(model)]
    update_bn_stats(model)
    return info, stats

@pytest.mark.parametrize('name', ['resnet18', 'efficientnet_b0', 'densenet121'])
def test_staged_prepass_is_exact_on_timm_models(name):
    "Window of 32 = 16 micro-batches of 2, float64, 32px, random init: default (memory-bounded) vs the whole window."
    timm = pytest.importorskip('timm')
    torch.manual_seed(0)
    staged = timm.create_model(name, num_classes=4).double()
    wrap_bn(staged, 'window'); staged.train()
    whole = copy.deepcopy(staged)
    g = torch.Generator().manual_seed(1)
    xbs = [(torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64),) for _ in range(16)]
    ys = [torch.randint(0, 4, (2,), generator=g) for _ in range(16)]
    i_whole, ref = train_window(whole, xbs, ys, memory=float('inf'))
    i_staged, got = train_window(staged, xbs, ys, meter=True)
    assert i_whole['mode'] == 'whole' and i_staged['mode'] == 'staged', (i_whole, i_staged)
    plan = prepass_plan(staged, xbs[0])
    assert i_staged['device_bytes'] <= plan.train_bytes  # within what training holds at the micro-batch
    err = max(max(((a[0] - b[0]).abs() / b[1].sqrt() + (a[1] / b[1]).log().abs()).max().item() for a, b in zip(got, ref)), 0.)
    assert err <= 1e-6, err
    gs, gw = grads(staged), grads(whole)
    assert ((gs - gw).abs().max() / gw.abs().max()).item() <= 1e-6
    for a, b in zip(bn_layers(staged), bn_layers(whole)):
        torch.testing.assert_close(a.running_mean, b.running_mean, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(a.running_var, b.running_var, rtol=1e-9, atol=1e-12)

def deep_net(depth=30):
    "conv-BN-ReLU x depth, 4 channels: deep enough that fixed-point passes over chunks would not converge."
    layers = [m for _ in range(depth) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())]
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), *layers, nn.Flatten(), nn.Linear(4 * 16, 2))

def test_chunks_are_exact():
    torch.manual_seed(0)
    net = deep_net().double(); big = copy.deepcopy(net).train()
    xs = [torch.randn(2, 1, 4, 4, dtype=torch.float64) * 3 + 1 for _ in range(8)]
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, i: seen.append(i[0])) for m in bn_layers(big)]
    with torch.no_grad(): big(torch.cat(xs))
    for h in hooks: h.remove()
    ref = [(x.mean((0, 2, 3)), x.var((0, 2, 3), correction=0)) for x in seen]
    wrap_bn(net, 'window')
    for chunk in (2, 6, 16):
        window_prepasses(net, [(x,) for x in xs], chunk=chunk, store='cpu' if chunk == 6 else None)
        assert prepass_info(net)['mode'] == ('whole' if chunk >= 16 else 'staged')
        assert window_error(bn_layers(net), ref) <= 1e-9
    update_bn_stats(net)
    for a, b in zip(bn_layers(net), bn_layers(big)): torch.testing.assert_close(a.running_var, b.running_var)

def test_memory_cap_picks_the_mode_and_bounds_the_device_bytes():
    torch.manual_seed(0)
    net = deep_net(6); wrap_bn(net, 'window'); net.train()
    xbs = [(torch.randn(2, 1, 4, 4),) for _ in range(16)]
    plan = prepass_plan(net, xbs[0])
    assert plan.traced and plan.train_bytes > 0 and plan.stage_per_sample <= plan.whole_per_sample
    window_prepasses(net, xbs[:1], meter=True)  # 2 samples: training's own micro-batch fits
    assert prepass_info(net)['mode'] == 'whole'
    cap = int(plan.stage_per_sample * 4)
    window_prepasses(net, xbs, memory=cap, meter=True)
    info = prepass_info(net)
    assert (info['mode'], info['chunk']) == ('staged', 4) and info['device_bytes'] <= cap, info
    window_prepasses(net, xbs, memory=float('inf'), meter=True)
    assert prepass_info(net)['mode'] == 'whole' and prepass_info(net)['device_bytes'] > cap
    t = bn_preflight(net, *xbs[0], window=32)
    assert set(t.prepass) == {prepass_plan(net, xbs[0]).describe(32)} and 'staged' in t.prepass[0]

class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3)
    def forward(self, x):
        if x.sum() > -1e9: x = self.conv(x)  # data-dependent control flow: torch.fx cannot trace it
        return self.bn(x)

def test_untraceable_model_warns_and_runs_the_whole_window():
    torch.manual_seed(0)
    net = Untraceable(); big = copy.deepcopy(net).train()
    wrap_bn(net, 'window'); net.train()
    xbs = [(torch.randn(2, 1, 6, 6),) for _ in range(4)]
    with pytest.warns(UserWarning, match='cannot trace Untraceable'): window_prepasses(net, xbs, chunk=2)
    assert prepass_info(net)['mode'] == 'whole'
    with torch.no_grad(): big(torch.cat([x for x, in xbs]))
    update_bn_stats(net)
    torch.testing.assert_close(net.bn.running_var, big.bn.running_var)
