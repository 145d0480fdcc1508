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


_LOCAL = """
import os, sys, datetime, torch, torch.distributed as dist
from torch import nn
dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))
if dist.get_rank() == 0:  # only this process checks: nothing of the check may wait for the other
    from fastai_accum.check import check_accumulation
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(34, 6), torch.randint(0, 3, (34,))
    for policy in ('micro', 'exact'):
        r = check_accumulation(net, (x, y), 4, nn.CrossEntropyLoss(reduction='sum'), policy=policy)
        first = r.rows[r.rows.name.isin(['1.running_mean', '1.running_var'])].rel_diff.max()
        print(policy, r.cause, r.max_rel_diff_bn_eval, first, flush=True)
dist.barrier()
dist.destroy_process_group()
"""

def test_check_stays_local_under_torch_distributed():
    "One process of a 2-process gloo group checks alone: the copy's window is not all-reduced (a 'sum' loss is not scaled by the world) nor merged."
    import os, socket, subprocess, sys
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    env = {**os.environ, 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(port), 'WORLD_SIZE': '2', 'OMP_NUM_THREADS': '1'}
    procs = [subprocess.Popen([sys.executable, '-c', _LOCAL], env={**env, 'RANK': str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    rows = [l.split() for l in outs[0].splitlines() if l.startswith(('micro ', 'exact '))]
    assert [r[:2] for r in rows] == [['micro', 'batchnorm'], ['exact', 'none']], outs[0]
    for _, _, bn_eval, first in rows: assert float(bn_eval) <= 1e-12 and float(first) <= 1e-12  # the first BatchNorm's statistics: the batch's
