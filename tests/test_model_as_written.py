"""The model as its author wrote it (issue #74): a staged step returns the classes the model's forward returns (a
`ModelOutput`-like registered dict, a dataclass, a named tuple) through both tracers, and the aten-level trace takes
in-place layers (`nn.Dropout(inplace=True)` after a view, `nn.ReLU(inplace=True)` on a value read again); float64
against the plain big batch."""
import copy, dataclasses, warnings
from collections import OrderedDict
from typing import NamedTuple, Optional
import pytest, torch
from torch import nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from fastai_accum.core import Accumulation
from fastai_accum.staged_exact import install_staged
from helpers import forced_budget

class Output(OrderedDict):
    "transformers' `ModelOutput` pattern: an ordered dict with attribute access, registered with torch's pytree."
    def __getattr__(self, k):
        try: return self[k]
        except KeyError: raise AttributeError(k)
pytree.register_pytree_node(Output, lambda o: (list(o.values()), list(o.keys())), lambda v, k: Output(zip(k, v)))

@dataclasses.dataclass
class DataOutput:
    logits: torch.Tensor
    features: Optional[torch.Tensor] = None
pytree.register_dataclass(DataOutput)

class TupleOutput(NamedTuple):
    logits: torch.Tensor
    features: torch.Tensor

class Net(nn.Module):
    "conv-BN-ReLU, pooled, a head; its output in class `kind`; `gate`: a branch on a size (torch.fx cannot trace it)."
    def __init__(s, kind, gate=False):
        super().__init__(); s.kind, s.gate = kind, gate
        s.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        s.head = nn.Linear(8, 4)
    def forward(s, x):
        f = s.body(x)
        if s.gate and f.shape[-1] == 0: f = -f
        logits = s.head(f)
        return s.kind(logits=logits, features=f)

def _step(m, x):
    out = m(x)
    (out.logits.pow(2).mean() + out.features.pow(2).mean()).backward()
    return out

@pytest.mark.parametrize('gate', [False, True], ids=['fx', 'aten'])
@pytest.mark.parametrize('kind', [Output, DataOutput, TupleOutput], ids=['model_output', 'dataclass', 'named_tuple'])
def test_a_staged_step_returns_the_models_own_output_class(kind, gate):
    "It returned a plain dict (the graph's output node makes containers dicts): `model(x).logits` raised in the user's loss."
    torch.manual_seed(0); big = Net(kind, gate).double().train(); st = copy.deepcopy(big)
    f = install_staged(st, 2)
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        a, b = _step(big, x), _step(st, x)
    assert type(b) is kind and (f.by_fx != gate or kind is DataOutput)  # a dataclass built in torch.fx's graph: aten
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-12, atol=1e-14)
    for p, q in zip(st.parameters(), big.parameters()): torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-13)

class InPlace(nn.Module):
    "An in-place ReLU on a value read again (the residual), an in-place dropout after a view; a size branch: the aten trace."
    def __init__(s):
        super().__init__()
        s.c1, s.b1, s.c2, s.b2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        s.act, s.drop, s.head = nn.ReLU(inplace=True), nn.Dropout(0.5, inplace=True), nn.Linear(8, 5)
    def forward(s, x):
        y = s.b1(s.c1(x))
        z = s.act(y)  # y is z: the residual reads the written value
        z = s.b2(s.c2(z)) + y
        f = F.adaptive_avg_pool2d(z, 1).flatten(1)
        if f.shape[-1] == 0: f = -f
        return s.head(s.drop(f))

def test_in_place_layers_stage_over_the_aten_trace_as_the_big_batch():
    "They made the aten trace refuse ('an in-place aten.dropout_ on flatten'): staged exact, the big batch's, dropout's masks too (the last stage runs whole)."
    torch.manual_seed(0); big = InPlace().double().train(); ours = copy.deepcopy(big)
    xs = [torch.randn(2, 3, 8, 8, dtype=torch.float64) for _ in range(4)]
    ys = [torch.randn(2, 5, dtype=torch.float64) for _ in range(4)]
    acc = Accumulation(ours, n_step=4, policy='staged', device_memory=forced_budget(ours, xs, 4))
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for xb, yb in acc.batches(list(zip(xs, ys))): acc.backward(F.mse_loss(ours(xb), yb))
    torch.manual_seed(1); F.mse_loss(big(torch.cat(xs)), torch.cat(ys)).backward()
    assert acc.path == 'staged exact' and acc.plan.traced == 'aten', (acc.path, acc.plan.reason)
    for p, q in zip(ours.parameters(), big.parameters()): torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-13)

def test_an_in_place_write_whose_base_is_read_again_is_refused_by_the_aten_trace():
    "Written in place through a view whose base is read after: an out-of-place op would not be the model's step."
    from fastai_accum.staged import aten_graph
    class Writer(nn.Module):
        def forward(s, y):
            y.flatten(1).relu_()  # writes y through a view
            return y
    class Aliased(nn.Module):
        def __init__(s): super().__init__(); s.c, s.bn, s.writer = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), Writer()
        def forward(s, x): return s.writer(s.bn(s.c(x))).sum((2, 3))
    why = aten_graph(Aliased().train(), (torch.randn(2, 3, 8, 8),))
    assert isinstance(why, str) and 'an in-place aten.relu_' in why and 'in writer' in why and 'reads after it' in why, why

@pytest.mark.parametrize('name', ['regnet', 'mobilenet_v2'])
def test_transformers_models_stage_as_the_big_batch_and_return_their_model_output(name):
    "HF vision models from a config (random init, no download): RegNet over the aten trace, MobileNetV2 with its in-place dropout."
    transformers = pytest.importorskip('transformers')
    if name == 'regnet':
        m = transformers.RegNetForImageClassification(transformers.RegNetConfig(
            num_labels=3, hidden_sizes=[8, 16, 24, 32], embedding_size=8, depths=[1, 1, 1, 1]))
    else:
        m = transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config(
            num_labels=3, depth_multiplier=0.35, image_size=32))
    torch.manual_seed(0); big = m.double().train(); ours = copy.deepcopy(big)
    for d in list(big.modules()) + list(ours.modules()):
        if isinstance(d, nn.Dropout): d.p = 0.
    x = torch.randn(8, 3, 32, 32, dtype=torch.float64)
    acc = Accumulation(ours, n_step=4, policy='staged', device_memory=forced_budget(ours, [x[:2]], 4))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for xb in acc.batches(list(x.split(2))):
            out = ours(xb)
            assert type(out).__name__ == 'ImageClassifierOutputWithNoAttention'
            acc.backward(out.logits.pow(2).mean())
    big(x).logits.pow(2).mean().backward()
    assert acc.path == 'staged exact', acc.plan.reason
    scale = max(q.grad.abs().max() for q in big.parameters())
    assert max((p.grad - q.grad).abs().max() for p, q in zip(ours.parameters(), big.parameters())) <= 1e-10 * scale

class EvalOnlyPool(nn.Module):
    "pretrainedmodels' dpn68 pattern: a fixed 7x7 pooling in eval mode only, too large for a 6x6 map (its eval forward crashes)."
    def __init__(s):
        super().__init__()
        s.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))
        s.head = nn.Linear(8, 5)
    def forward(s, x):
        x = s.body(x)
        x = F.avg_pool2d(x, 7) if not s.training else F.adaptive_avg_pool2d(x, 1)
        return s.head(x.flatten(1))

@pytest.mark.parametrize('policy', ['window', 'auto', 'staged'])
def test_the_plan_measures_the_forward_the_fit_runs(policy):
    "Every measurement runs the training forward (running statistics and random state kept): it ran `eval()`, which crashed ('Output size is too small')."
    torch.manual_seed(0); m = EvalOnlyPool().double().train()
    xs = [torch.randn(2, 3, 8, 8, dtype=torch.float64) for _ in range(8)]
    before = {k: v.clone() for k, v in m.state_dict().items()}
    acc = Accumulation(m, n_step=4, policy=policy, device_memory=forced_budget(m, xs, 4))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for xb in acc.batches(xs): acc.backward(m(xb).pow(2).mean())
    assert acc.path == ('window' if policy == 'window' else 'staged exact'), (acc.path, acc.plan.reason if acc.plan else None)
    assert int(m.body[1].num_batches_tracked) == 2  # two windows, each committed once: the measuring moved nothing
    assert not torch.equal(before['body.1.running_mean'], m.body[1].running_mean)

def test_the_preflight_says_which_tracer_took_the_model_and_why_the_others_did_not():
    "torch.fx's own words where the aten-level trace took the model (it said 'torch.fx cannot trace the model' alone)."
    torch.manual_seed(0); m = InPlace().double().train()
    xs = [torch.randn(2, 3, 8, 8, dtype=torch.float64) for _ in range(4)]
    acc = Accumulation(m, n_step=4, policy='staged', device_memory=forced_budget(m, xs, 4))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for xb in acc.batches(xs): acc.backward(m(xb).pow(2).mean())
    line = str(acc)
    assert "staged over an aten-level trace" in line and '(torch.fx: TraceError: symbolically traced variables' in line, line
