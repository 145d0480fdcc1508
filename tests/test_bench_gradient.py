"""The gradient screen on deep networks: one window's gradient under the default policy (and 'window') against the big
batch's on the same samples, at random init and once settled (random-init fastai resnet18 with its BatchNorm1d head,
timm mobilenetv3_small_100), digits at 32 px, windows of 16 in 8 micro-batches of 2.

Measured (cosine with the big-batch gradient, first window / after 10 big-batch AdamW steps):
default ('auto' -> 'exact' here) 1.000 / 1.000 on both; 'window' resnet18 0.311 / 0.503, mobilenetv3 -0.444 / 0.365.
At windows of 64 (2 x 32) and 50-100 steps see nbs/22_bench_gradient.ipynb."""
import pytest
import torch
from torch import nn
from fastai_accum.check import gradient_screen
from fastai_accum.bench_gradient import digits_windows

SETTLE = 10  # big-batch AdamW steps (lr 1e-3) before the settled measurement
# 'window' cosine at (first window, settled): measured resnet18 0.311 / 0.503, mobilenetv3 -0.444 / 0.365 (torch 2.14
# CPU, 1 thread); asserted with margin. Far below 0.98: the window policy's estimated backward terms are the open problem
# (issue 13); the default meets 0.98 because it trains each window as one batch.
WINDOW_MIN = {'resnet18': (0.2, 0.35), 'mobilenetv3': (-1., 0.25)}


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

def resnet18():
    "fastai `vision_learner`'s model: torchvision resnet18 body, `create_head` with BatchNorm1d, random init, 1 channel."
    from torchvision.models import resnet18
    from fastai.vision.learner import create_vision_model
    torch.manual_seed(0)
    return create_vision_model(resnet18, 10, pretrained=False, n_in=1)

def mobilenetv3():
    timm = pytest.importorskip('timm')
    torch.manual_seed(0)
    return timm.create_model('mobilenetv3_small_100', pretrained=False, num_classes=10, in_chans=1)

def screen(make):
    s = gradient_screen(make(), digits_windows(16, 32)[:SETTLE + 1], 8, nn.CrossEntropyLoss(),
                        policies=('auto', 'window'), at=(0, SETTLE), progress=False)
    print(s)
    return s.table.set_index(['step', 'policy'])


@pytest.mark.parametrize('make', [resnet18, mobilenetv3], ids=['resnet18', 'mobilenetv3'])
def test_default_policy_gradient(make):
    t = screen(make)
    # the default ('auto') is 'exact' on CPU when the window fits: each window one batch, the big batch's gradient
    for k in (0, SETTLE):
        assert t.loc[(k, 'auto'), 'ran'] == 'exact'
        assert t.loc[(k, 'auto'), 'cosine'] >= 0.98 and t.loc[(k, 'auto'), 'rel_err'] < 1e-3
    # 'window' (micro-batches of 2 with the window's forward statistics, estimated backward terms)
    w0, w1 = t.loc[(0, 'window'), 'cosine'], t.loc[(SETTLE, 'window'), 'cosine']
    assert w0 >= WINDOW_MIN[make.__name__][0] and w1 >= WINDOW_MIN[make.__name__][1], (w0, w1)
