"""Contrastive training (issue #48, part): a loss that couples the samples of a window (InfoNCE with in-batch negatives)
is the big batch's on the paths that train the window as one batch — the loss sees the window's outputs — and a path
that computes it per micro-batch says so (float64, an encoder with BatchNorm2d and BatchNorm1d, two views per image)."""
import warnings
import pytest, torch
from torch import nn
import torch.nn.functional as F
from fastai_accum.core import Accumulation

class Encoder(nn.Module):
    "Two views per image folded into the batch: (n, 2, 3, H, W) -> 2n embeddings, views of one image side by side."
    def __init__(s):
        super().__init__()
        s.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        s.proj = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    def forward(s, x): return s.proj(s.body(x.flatten(0, 1)))

def info_nce(z, *_, t=0.2):
    "NT-Xent: embeddings 2i and 2i+1 are one image's views; every other embedding of the batch is a negative."
    z = F.normalize(z, dim=1)
    logits = (z @ z.T / t).masked_fill(torch.eye(len(z), dtype=torch.bool), float('-inf'))
    return F.cross_entropy(logits, torch.arange(len(z)) ^ 1)

def encoder():
    torch.manual_seed(0)
    return Encoder().double().train()

def views(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 3, 8, 8, generator=g, dtype=torch.float64)
    return torch.cat([x, x + 0.3 * torch.randn(x.shape, generator=g, dtype=torch.float64)], 1), torch.zeros(n)

def big_batch(model, x, n_acc, steps=2):
    "SGD steps, each on one plain batch of `n_acc` images."
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(0, steps * n_acc, n_acc):
        info_nce(model(x[i:i + n_acc])).backward(); opt.step(); opt.zero_grad()
    return model

def assert_same(a, b):
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()): assert torch.allclose(v, w, atol=1e-9), k

@pytest.mark.parametrize('policy', ['exact', 'auto'])
def test_a_coupled_loss_is_the_big_batchs_in_the_plain_loop(policy):
    x, y = views()
    ours = encoder()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulation(ours, n_step=4, policy=policy)
    for xb, yb in acc.batches(list(zip(x.split(2), y.split(2)))):
        if acc.backward(info_nce(ours(xb))): opt.step(); opt.zero_grad()
    assert acc.path == 'exact' and acc.steps == 2
    assert_same(ours, big_batch(encoder(), x, 8))

def _learner(policy, x, y):
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders, TfmdDL
    from fastai.optimizer import SGD
    from fastai_accum.callback import GradientAccumulation
    dls = DataLoaders(TfmdDL(list(zip(x, y)), bs=2), TfmdDL(list(zip(x[:4], y[:4])), bs=2))
    loss = lambda z, *y: info_nce(z).float()  # fastai's recorder smooths the loss in float32
    learn = Learner(dls, encoder(), loss_func=loss, opt_func=SGD, lr=0.1)
    ga = GradientAccumulation(n_step=4, policy=policy)
    with warnings.catch_warnings(record=True) as said, learn.no_logging(), learn.no_bar():
        warnings.simplefilter('always')
        learn.fit(1, cbs=ga)
    return learn, ga, [str(w.message) for w in said if 'couples' in str(w.message)]

def test_a_coupled_loss_is_the_big_batchs_in_a_learner_and_said_where_it_is_split():
    x, y = views()
    learn, ga, said = _learner('exact', x, y)
    assert ga.path == 'exact' and said == []
    ref = encoder()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)  # fastai's SGD: no momentum
    for i in (0, 8): info_nce(ref(x[i:i + 8])).backward(); opt.step(); opt.zero_grad()
    assert_same(learn.model, ref)
    learn, ga, said = _learner('window', x, y)
    assert len(said) == 1 and "On the 'window' path it is computed per micro-batch of 2, not over the window of 4 micro-batches" in said[0]

# Models that fold views into the batch, each its own way: the staged step chunks them by sample
class SideBySide(Encoder):
    "`flatten(0, 1)`: a sample's views side by side; the embeddings put back as (n, 2, d)."
    def forward(s, x): return super().forward(x).view(x.size(0), 2, -1)

class ViewAfterView(Encoder):
    "`cat` of the views: every image's first view, then every image's second."
    def forward(s, x): return s.proj(s.body(torch.cat([x[:, 0], x[:, 1]])))

class SplitBack(Encoder):
    "`cat` of the views, then split back and stacked: (n, 2, d)."
    def forward(s, x):
        a, b = s.proj(s.body(torch.cat([x[:, 0], x[:, 1]]))).chunk(2)
        return torch.stack([a, b], 1)

class ThreeViews(Encoder):
    "`repeat_interleave`: three views made inside the model (a brightness per view), side by side."
    def forward(s, x):
        v = x[:, 0].repeat_interleave(3, 0)
        return s.proj(s.body(v * torch.tensor([1., 0.5, -1.], dtype=v.dtype).repeat(x.size(0)).view(-1, 1, 1, 1)))

class Untraceable(Encoder):
    "torch.fx cannot trace it (a branch on a shape): the aten-level tracer does; views one after the other."
    def forward(s, x):
        if x.shape[-1] % 2 == 0: x = x * 1.0
        return s.proj(s.body(torch.cat([x[:, 0], x[:, 1]])))

def nt_xent(z, *_):
    "`info_nce` on (n, 2, d) or 2n (views side by side) or view-after-view embeddings: the positives as they lie."
    if z.dim() == 3: return info_nce(z.flatten(0, 1))
    z = F.normalize(z, dim=1)
    n = len(z) // 2
    logits = (z @ z.T / 0.2).masked_fill(torch.eye(len(z), dtype=torch.bool), float('-inf'))
    return F.cross_entropy(logits, (torch.arange(len(z)) + n) % len(z))

folding = [SideBySide, ViewAfterView, SplitBack, ThreeViews, Untraceable, Encoder]
def three_view_loss(z, *_):
    "Each image's three views positives of each other (SupCon-style), every other embedding a negative."
    z = F.normalize(z, dim=1)
    same = torch.arange(len(z)) // 3
    logits = (z @ z.T / 0.2).masked_fill(torch.eye(len(z), dtype=torch.bool), float('-inf'))
    pos = (same[:, None] == same[None]) & ~torch.eye(len(z), dtype=torch.bool)
    return -(logits.log_softmax(1).masked_fill(~pos, 0).sum(1) / pos.sum(1)).mean()

loss_of = {ThreeViews: three_view_loss, Encoder: info_nce}

class OneView(Encoder):
    "Images, one view each."
    def forward(s, x): return s.proj(s.body(x))

def _model(cls):
    torch.manual_seed(0)
    return cls().double().train()

@pytest.mark.parametrize('cls', folding, ids=lambda c: c.__name__)
@pytest.mark.parametrize('policy', ['staged', 'auto'])
def test_models_folding_views_into_the_batch_train_staged_as_the_big_batch(cls, policy):
    "Under a device budget that forces chunks: 'staged' chunks each folded value by sample; both equal the big batch."
    from fastai_accum.exact import staging_budget
    x, y = views()
    loss = loss_of.get(cls, nt_xent)
    ours, big = _model(cls), _model(cls)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, big)]
    acc = Accumulation(ours, n_step=4, policy=policy, device_memory=staging_budget(ours, (x[:2],), 8))
    for xb, yb in acc.batches(list(zip(x.split(2), y.split(2)))):
        if acc.backward(loss(ours(xb))): opts[0].step(); opts[0].zero_grad()
    for i in (0, 8): loss(big(x[i:i + 8])).backward(); opts[1].step(); opts[1].zero_grad()
    assert acc.path in (('staged exact',) if policy == 'staged' else ('staged exact', 'exact')), acc.path
    assert_same(ours, big)

@pytest.mark.parametrize('cls', [SideBySide, ViewAfterView], ids=lambda c: c.__name__)
def test_folded_views_cross_the_host_link_by_sample(cls):
    "On an accelerator (emulated) the store keeps a folded value one row a sample: the step is the big batch's, in chunks of 1."
    from fastai_accum.helpers import emulated_accelerator
    from fastai_accum.staged_exact import install_staged, uninstall_staged
    x = views()[0][:6]
    ours, big = _model(cls), _model(cls)
    with emulated_accelerator():
        f = install_staged(ours, 1)
        f.step.config.set(grow=False)
        try: nt_xent(ours(x)).backward()
        finally: uninstall_staged(ours)
    nt_xent(big(x)).backward()
    assert f.step.ledger.copies > 0 and f.step.ledger.blocking_copies == 0
    for p, q in zip(ours.parameters(), big.parameters()): assert torch.allclose(p.grad, q.grad, atol=1e-12)
    for p, q in zip(ours.buffers(), big.buffers()): assert torch.allclose(p.double(), q.double(), atol=1e-12)

def test_batch_layouts_and_the_memory_plan_count_a_samples_views():
    "Each folded value's layout; a sample's store bytes and saved activations: twice a one-view model's (two views)."
    from fastai_accum.probes import batch_layouts, store_per_sample
    from fastai_accum.exact import measure_footprint
    from fastai_accum.staged import staged_graph
    x = views()[0][:2]
    side, after = batch_layouts(_model(SideBySide), (x,)), batch_layouts(_model(ViewAfterView), (x,))
    assert side['flatten'] == (2, 'sample') and set(side.values()) == {(2, 'sample')}
    assert after['cat'] == (2, 'view') and set(after.values()) == {(2, 'view')}
    folded, plain = _model(ViewAfterView), _model(OneView)
    per_view = store_per_sample(plain, staged_graph(plain, (x[:, 0],)), (x[:, 0],))
    assert store_per_sample(folded, staged_graph(folded, (x,)), (x,)) == pytest.approx(2 * per_view, rel=0.05)
    assert measure_footprint(folded, x).saved == pytest.approx(2 * measure_footprint(plain, x[:, 0]).saved, rel=0.05)

class Centred(Encoder):
    "Embeddings centred over the batch outside BatchNorm: an op mixing samples, which no staged step can chunk."
    def forward(s, x):
        z = super().forward(x)
        return z - z.mean(0)

def test_auto_says_why_it_could_not_compute_a_coupled_loss_over_the_window():
    "Under a budget the whole window does not fit, on a model no staged step can chunk: 'auto' trains window BN and says why."
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders, TfmdDL
    from fastai.optimizer import SGD
    from fastai_accum.callback import GradientAccumulation
    from fastai_accum.exact import staging_budget
    x, y = views()
    model = _model(Centred)
    dls = DataLoaders(TfmdDL(list(zip(x, y)), bs=2), TfmdDL(list(zip(x[:4], y[:4])), bs=2))
    learn = Learner(dls, model, loss_func=lambda z, *y: info_nce(z).float(), opt_func=SGD, lr=0.1)
    ga = GradientAccumulation(n_step=4, device_memory=staging_budget(_model(Encoder), (x[:2],), 8, at=0.2))
    with warnings.catch_warnings(record=True) as said, learn.no_logging(), learn.no_bar():
        warnings.simplefilter('always')
        learn.fit(1, cbs=ga)
    said = [str(w.message) for w in said if 'couples' in str(w.message)]
    assert ga.path == 'window' and len(said) == 1, (ga.path, said)
    assert "'auto' could not train the window as one batch (a window of 8 samples as one batch needs" in said[0]
    assert 'a staged step would not be the big batch: mean (call_method mean) combines the samples' in said[0]

def test_the_memory_plan_counts_the_loss_over_the_window():
    "What the loss keeps over the window's outputs is in the plan: a similarity matrix grows as the window squared."
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders, TfmdDL
    from fastai.optimizer import SGD
    from fastai_accum.callback import GradientAccumulation
    from fastai_accum.meters import fmt_bytes
    x, y = views(64)
    plans = {}
    for n_step in (8, 16):
        dls = DataLoaders(TfmdDL(list(zip(x, y)), bs=2), TfmdDL(list(zip(x[:4], y[:4])), bs=2))
        learn = Learner(dls, _model(Encoder), loss_func=lambda z, *y: info_nce(z).float(), opt_func=SGD, lr=0.1)
        ga = GradientAccumulation(n_step=n_step, preflight=False)
        with learn.no_logging(), learn.no_bar(): learn.fit(1, cbs=ga)
        plans[n_step] = ga.plan
    small, big = plans[8].loss, plans[16].loss
    assert big >= (16 * 2 * 2) ** 2 * 8  # at least the similarity matrix of 64 embeddings in float64
    assert 3 < big / small <= 4  # twice the window: four times the matrix (linear terms would double)
    assert plans[16].device_needed >= plans[16].model_needed + big and ga.path == 'exact'
    assert f"the loss keeps {fmt_bytes(big)} over the window's outputs" in plans[16].describe()  # the pre-flight says it
