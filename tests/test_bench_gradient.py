"""The gradient screen on deep networks: one window's gradient under the default policy (and 'window') against the big
batch's on the same samples, at random init and once settled (random-init `vision_resnet18`: fastai's resnet18 with its BatchNorm1d head,
timm mobilenetv3_small_100), digits at 32 px, windows of 16 in 8 micro-batches of 2.

Measured (cosine with the big-batch gradient, first window / after 10 big-batch AdamW steps):
default ('auto' -> 'exact' here) 1.000 / 1.000 on both; 'window' vision_resnet18 0.311 / 0.503, mobilenetv3 -0.444 / 0.365.
At windows of 64 (2 x 32) and 50-100 steps see nbs/22_bench_gradient.ipynb."""
import math
import pytest
import torch
from torch import nn
from fastai_accum.check import gradient_screen
from fastai_accum.lab.bench_gradient import digits_windows
from fastai_accum.lab.experiments import experiment_models

SETTLE = 10  # big-batch AdamW steps (lr 1e-3) before the settled measurement
# 'window' cosine at (first window, settled): measured vision_resnet18 0.311 / 0.503, mobilenetv3 -0.444 / 0.365 (torch 2.14
# CPU, 1 thread); asserted with margin. Far below 0.98: the window policy's estimated backward terms are the open problem
# (issue 13); the default meets 0.98 because it trains each window as one batch.
WINDOW_MIN = {'vision_resnet18': (0.2, 0.35), 'mobilenetv3': (None, 0.25)}  # None: no bound at random init (any cosine), only a finite value


def model(name):
    "The benchmark's model `name` (`experiment_models`), seeded: random-init weights, 10 classes, 1 input channel."
    if name == 'mobilenetv3': pytest.importorskip('timm')
    torch.manual_seed(0)
    return experiment_models[name]()

def screen(name):
    s = gradient_screen(model(name), digits_windows(16, 32)[:SETTLE + 1], 8, nn.CrossEntropyLoss(),
                        policies=('auto', 'window'), at=(0, SETTLE), progress=False)
    print(s)
    return s.table.set_index(['step', 'policy'])


@pytest.mark.parametrize('name', ['vision_resnet18', 'mobilenetv3'])
def test_default_policy_gradient(name):
    t = screen(name)
    # the default ('auto') is 'exact' on CPU when the window fits: each window one batch, the big batch's gradient
    for k in (0, SETTLE):
        assert t.loc[(k, 'auto'), 'ran'] == 'exact'
        assert t.loc[(k, 'auto'), 'cosine'] >= 0.98 and t.loc[(k, 'auto'), 'rel_err'] < 1e-3
    # 'window' (micro-batches of 2 with the window's forward statistics, estimated backward terms)
    w0, w1 = t.loc[(0, 'window'), 'cosine'], t.loc[(SETTLE, 'window'), 'cosine']
    lo0, lo1 = WINDOW_MIN[name]
    assert (math.isfinite(w0) if lo0 is None else w0 >= lo0) and w1 >= lo1, (w0, w1)
