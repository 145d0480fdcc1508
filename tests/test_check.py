"""check_accumulation weights micro-batches with the callback's own `AccumulationWindow`: break it (for the whole
process, undone by pytest's monkeypatch whatever happens) and the check must fail, and say why. Every other check of
check_accumulation and gradient_screen is in nbs/06_check.ipynb."""
import pytest
import torch
from torch import nn
import fastai_accum.window
from fastai_accum.check import check_accumulation


def conv_net(bn:bool, seed=0):
    torch.manual_seed(seed)
    norm2, norm1 = (nn.BatchNorm2d, nn.BatchNorm1d) if bn else (lambda c: nn.Identity(), lambda c: nn.Identity())
    return nn.Sequential(nn.Conv2d(3, 8, 3), norm2(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), norm2(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 16), norm1(16), nn.ReLU(), nn.Linear(16, 4))

def images(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 10, 10, generator=g), torch.randint(0, 4, (n,), generator=g)


@pytest.mark.parametrize('bn', [False, True])
def test_broken_loss_weighting_is_flagged(monkeypatch, bn):
    "Each micro-batch's loss weighted 1 (micro-batch means summed, not averaged): the check must fail, and say why."
    orig = fastai_accum.window.AccumulationWindow.add
    monkeypatch.setattr(fastai_accum.window.AccumulationWindow, 'add', lambda self, bs, loss=None: (orig(self, bs, loss), 1.)[1])
    r = check_accumulation(conv_net(bn=bn), images(), 4, nn.CrossEntropyLoss())
    assert not r.ok and r.cause == 'other'
    assert 'not explained by BatchNorm' in r.diagnosis and 'weighted wrongly' in r.diagnosis
    assert r.max_rel_diff > 0.5
    if bn: assert r.max_rel_diff_bn_eval > 0.5 and 'persist with every BatchNorm in eval mode' in r.diagnosis
    else: assert 'no BatchNorm layer' in r.diagnosis
