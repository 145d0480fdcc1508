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
