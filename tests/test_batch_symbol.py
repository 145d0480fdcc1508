"""Models that fold the batch into their patches, tokens or channel groups: a real trace bakes the batch size in, so
torch.export traces them once more with the batch a symbol; they stage as the big batch (float64, a device budget that
forces chunks), a model that truly mixes samples is still refused naming the layer, and the graph is traced once."""
import copy, warnings
import pytest, torch
from torch import nn
import torch.nn.functional as F
from fastai_accum.core import Accumulation
from fastai_accum.exact import ExactModeRefusedError
from fastai_accum.staged import staged_graph, traced_by, same_trace
import fastai_accum.staged as staged
from helpers import train_both, windows, forced_budget

def stem(c): return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())

class Patches(nn.Module):
    "MobileViT's pattern: the batch folded with patch positions (`reshape(B * P, N, C)`), attention within a sample, unfolded."
    def __init__(s, c=6, p=2):
        super().__init__()
        s.p, s.stem, s.mix, s.bn, s.head = p, stem(c), nn.Linear(c, c), nn.BatchNorm1d(c), nn.Linear(c, 5)
    def forward(s, x):
        x = s.stem(x)
        B, C, H, W = x.shape
        if H % s.p or W % s.p: x = F.interpolate(x, size=(H // s.p * s.p, W // s.p * s.p))  # torch.fx stops here
        P, N = s.p * s.p, (H // s.p) * (W // s.p)
        t = x.reshape(B, C, H // s.p, s.p, W // s.p, s.p).permute(0, 3, 5, 2, 4, 1).reshape(B * P, N, C)
        t = t + torch.softmax(t @ t.transpose(1, 2) / C ** .5, -1) @ s.mix(t)
        t = s.bn(t.reshape(B * P * N, C)).reshape(B, P * N, C)  # a BatchNorm over the batch folded with every token
        return s.head(t.mean(1))

class Grouped(nn.Module):
    "A view that moves the batch into a channel grouping: CondConv's per-sample kernels (`reshape(1, B * C, H, W)`, `groups=B`)."
    def __init__(s, c=6, e=3):
        super().__init__()
        s.stem, s.route, s.experts = stem(c), nn.Linear(c, e), nn.Parameter(torch.randn(e, c * c * 9) / (3 * c))
        s.bn, s.head = nn.BatchNorm2d(c), nn.Linear(c, 5)
    def forward(s, x):
        x = s.stem(x)
        B, C, H, W = x.shape
        w = torch.sigmoid(s.route(x.mean((2, 3)))) @ s.experts if H > 1 else None  # torch.fx stops here
        x = F.conv2d(x.reshape(1, B * C, H, W), w.reshape(B * C, C, 3, 3), padding=1, groups=B).reshape(B, C, H, W)
        return s.head(F.relu(s.bn(x)).mean((2, 3)))

class Regions(Patches):
    "EfficientViT's pattern besides: attention in float32 under `torch.autocast(enabled=False)` (torch.export wraps the region)."
    def forward(s, x):
        x = s.stem(x)
        B, C, H, W = x.shape
        t = x.flatten(2).transpose(1, 2).reshape(B * H, W, C) if H > 1 else None  # torch.fx stops here
        with torch.autocast(x.device.type, enabled=False):
            t = t + torch.softmax(t @ t.transpose(1, 2), -1) @ s.mix(t)
        return s.head(s.bn(t.reshape(B * H * W, C)).reshape(B, H * W, C).mean(1))

class BatchAttention(nn.Module):
    "Attention over every token of the batch."
    def __init__(s, c): super().__init__(); s.mix = nn.Linear(c, c)
    def forward(s, t): return t + torch.softmax(t @ t.T / t.shape[1] ** .5, -1) @ s.mix(t)

class AcrossBatch(nn.Module):
    "Tokens of all samples folded together and attended over as one sequence: samples mix, no chunking is exact."
    def __init__(s, c=6):
        super().__init__()
        s.stem, s.attn, s.bn, s.head = stem(c), BatchAttention(c), nn.BatchNorm1d(c), nn.Linear(c, 5)
    def forward(s, x):
        x = s.stem(x)
        B, C, H, W = x.shape
        t = s.attn(x.flatten(2).transpose(1, 2).reshape(B * H * W, C) if H > 1 else x)  # torch.fx stops here
        return s.head(s.bn(t).reshape(B, H * W, C).mean(1))

@pytest.mark.parametrize('policy', ['staged', 'auto'])
@pytest.mark.parametrize('make', [Patches, Grouped, Regions], ids=['patches', 'grouped', 'regions'])
def test_batch_folding_models_stage_as_the_big_batch(make, policy):
    "Parameters, running statistics and the step through torch.export's graph, within float64's rounding of the big batch's."
    diff, acc = train_both(make, policy)
    assert acc.path == 'staged exact', (acc.path, acc.plan.reason)
    assert acc.plan.traced == 'torch.export' and acc.plan.trace_time > 0
    assert diff < 1e-10, diff
    assert "staged over torch.export's graph with the batch a symbol" in str(acc) and ' traced in ' in str(acc)

def test_a_real_trace_of_such_a_model_is_fixed_to_its_batch():
    "Why the symbolic rung exists: make_fx's real-mode graphs of `Patches` at 2 and 3 samples differ."
    m, x = Patches().double().train(), torch.randn(2, 3, 8, 8, dtype=torch.float64)
    (a, *_), (b, *_) = staged._trace_aten(m, (x,)), staged._trace_aten(m, (torch.cat([x, x[:1]]),))
    assert staged._same_graph(a.graph, b.graph) is not None

def test_mixing_across_the_batch_is_refused_naming_the_layer():
    "The check of sample independence runs on torch.export's graph too: the layer that mixes is named."
    with pytest.raises(ExactModeRefusedError, match=r"combines the samples of a batch") as e:
        train_both(AcrossBatch, 'staged')
    assert 'in layer attn (BatchAttention)' in str(e.value) and 'torch.export' not in str(e.value).split('combines')[1]
    diff, acc = train_both(AcrossBatch, 'auto')  # 'auto' falls back and says why
    assert acc.path != 'staged exact' and 'combines the samples' in str(acc)

def test_a_branch_on_the_batch_size_is_refused_in_both_tracers_words():
    "No symbol can take `if x.shape[0] > 2`: torch.export refuses, and the reason names the batch size."
    class Sized(nn.Module):
        def __init__(s): super().__init__(); s.bn = nn.BatchNorm1d(2)
        def forward(s, x): return s.bn(x) if x.shape[0] > 2 else x
    why = staged_graph(Sized().train(), (torch.randn(2, 2),))
    assert 'depends on the batch size (2 vs 3 samples' in why and 'torch.export cannot make it a symbol' in why

def test_traced_once_per_model_and_input_shape(monkeypatch):
    "Two fits and a copy of the model: torch.export runs once; the time and tracer are kept (`traced_by`)."
    calls = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, 'export', lambda *a, **k: calls.append(1) or export(*a, **k))
    model = Patches().double().train()
    batches = windows()
    acc = Accumulation(model, n_step=4, policy='staged', device_memory=forced_budget(model, batches[0], 4))
    for fit in range(2):
        for x, y in acc.batches(batches):
            if acc.backward(F.mse_loss(model(x), y)): model.zero_grad()
    assert acc.path == 'staged exact' and len(calls) == 1
    by, seconds = traced_by(model, (batches[0][0],))
    assert by == 'torch.export' and seconds > 0
    other = copy.deepcopy(model)
    same_trace(model, other)
    assert staged_graph(other, (batches[0][0],)) is staged_graph(model, (batches[0][0],)) and len(calls) == 1

def test_mobilevit_stages_as_the_big_batch():
    "timm's mobilevit_xxs (the family the pattern comes from): torch.export's graph, float64 equal to the big batch."
    timm = pytest.importorskip('timm')
    torch.manual_seed(0)
    big = timm.create_model('mobilevit_xxs', num_classes=5).double().train()
    ours = copy.deepcopy(big)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 64, 64, dtype=torch.float64, generator=g), torch.randint(0, 5, (8,), generator=g)
    batches = [(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (big, ours)]
    acc = Accumulation(ours, n_step=4, policy='staged', device_memory=forced_budget(ours, batches[0], 4))
    F.cross_entropy(big(x), y).backward(); opts[0].step()
    for xb, yb in acc.batches(batches):
        if acc.backward(F.cross_entropy(ours(xb), yb)): opts[1].step()
    assert acc.path == 'staged exact' and traced_by(ours, (x[:2],))[0] == 'torch.export'
    for (k, a), b in zip(ours.state_dict().items(), big.state_dict().values()):
        if a.is_floating_point(): assert (a - b).abs().max() <= 1e-12 + 1e-10 * b.abs().max(), k
