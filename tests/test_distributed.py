"Distributed accumulation on CPU: 2 processes, gloo, fastai's distrib_ctx (accelerate DDP)."
from pathlib import Path
import pytest, torch
from torch import nn

from dist_helpers import torchrun, rank_results

def launch(mode, outdir, timeout=300): return torchrun('dist_script.py', mode, outdir, timeout=timeout)
def results(mode, tmp_path): return rank_results('dist_script.py', tmp_path, mode)

@pytest.mark.parametrize('mode,expected', [('count', 2 * 4), ('count_each', 2 * 16)])
def test_one_allreduce_per_window(mode, expected, tmp_path):
    "64 samples, 2 ranks x micro-batch 2 -> 16 micro-batches per rank per epoch, n_step 4 -> 4 windows; 2 epochs."
    r0, r1 = results(mode, tmp_path)
    assert r0['allreduces'] == r1['allreduces'] == expected

def test_two_ranks_equal_one_process_big_batch(tmp_path):
    "2 ranks x micro 2 x n_step 4 of a BN-free model = one process at bs 16 on the same 16 samples per step."
    r0, r1 = results('count', tmp_path)
    from fastai.basics import Learner, DataLoaders, DataLoader, SGD, MSELossFlat
    from torch.utils.data import TensorDataset
    from dist_helpers import data, mlp
    x, y = data()
    # fastai's DistributedDL gives rank r the contiguous half r of the (unshuffled) samples; window k of rank r holds
    # samples 32r + 8k ... 32r + 8k + 7, so one big batch k is those of both ranks
    order = [i for k in range(4) for r in range(2) for i in range(32*r + 8*k, 32*r + 8*k + 8)]
    dls = DataLoaders(DataLoader(TensorDataset(x[order], y[order]), bs=16), DataLoader(TensorDataset(x[:8], y[:8]), bs=16))
    torch.manual_seed(0)
    ref = Learner(dls, mlp(), loss_func=MSELossFlat(), opt_func=SGD)
    ref.fit(2, lr=0.05)
    for p0, p1, pr in zip(r0['params'], r1['params'], ref.model.parameters()):
        assert torch.equal(p0, p1)
        assert ((p0 - pr.detach()).abs().max() / pr.detach().abs().max()).item() <= 1e-6

@pytest.mark.parametrize('mode', ['bn', 'bn_window'])
def test_bn_stats_identical_across_ranks_and_equal_union_reference(mode, tmp_path):
    r0, r1 = results(mode, tmp_path)
    assert len(r0['stats']) == len(r1['stats']) == 8  # 4 windows x 2 epochs
    for s0, s1 in zip(r0['stats'], r1['stats']):
        for (m0, v0), (m1, v1) in zip(s0, s1):
            assert torch.equal(m0, m1) and torch.equal(v0, v1)  # bitwise identical after every window
    n_bn = len(r0['final'])
    refs = [nn.BatchNorm1d(m.shape[0]).double() for m, _ in r0['final']]
    keys = sorted({(e, w) for e, w, _, _ in r0['inputs']})
    for e, w in keys:
        for i in range(n_bn):
            x = torch.cat([t for r in (r0, r1) for (e2, w2, j, t) in r['inputs'] if (e2, w2, j) == (e, w, i)])
            refs[i](x.reshape(x.shape[0], x.shape[1], -1))
    for (m, v), ref in zip(r0['final'], refs):
        assert ((m.double() - ref.running_mean).abs().max() / ref.running_mean.abs().max()).item() <= 1e-5
        assert ((v.double() - ref.running_var).abs().max() / ref.running_var.abs().max()).item() <= 1e-5

@pytest.mark.parametrize('mode', ['prepass_sync_staged', 'prepass_sync_whole'])
def test_one_prepass_gives_exact_cross_rank_window_statistics(mode, tmp_path):
    "2 ranks x a window of 8 on a net with 24 BatchNorm levels: one pre-pass, one collective per layer, exact stats."
    from dist_helpers import DeepResNet
    r0, r1 = results(mode, tmp_path)
    torch.manual_seed(0)
    ref = DeepResNet().double().train()
    bns = [m for m in ref.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(bns) == 24
    assert r0['info']['mode'] == ('staged' if mode.endswith('staged') else 'whole') and r0['info']['sync']
    assert r0['calls'] == r1['calls'] == len(bns)  # one all-gather per layer (commit merges nothing again)
    seen = []
    hooks = [bn.register_forward_pre_hook(lambda m, i: seen.append(i[0].detach())) for bn in bns]
    with torch.no_grad(): ref(torch.cat([xb[0] for r in (r0, r1) for xb in r['window']]))  # one process, the union
    for h in hooks: h.remove()
    for x, (m0, v0), (m1, v1), (rm, rv), bn in zip(seen, r0['stats'], r1['stats'], r0['running'], bns):
        dims = [0] + list(range(2, x.dim()))
        var, mean = torch.var_mean(x, dims, correction=0)
        assert torch.equal(m0, m1) and torch.equal(v0, v1)
        assert (m0 - mean).abs().max() <= 1e-6 * var.sqrt().max() and ((v0 - var) / var).abs().max() <= 1e-6
        assert (rm - bn.running_mean).abs().max() <= 1e-6 and ((rv - bn.running_var) / bn.running_var).abs().max() <= 1e-6

def test_crashed_rank_fails_loudly_instead_of_hanging(tmp_path):
    r = launch('crash', tmp_path, timeout=240)  # a hang would raise TimeoutExpired and fail the test
    assert r.returncode != 0
    assert 'rank 1 crashed mid-window' in r.stdout + r.stderr

def test_example_script_runs_under_torchrun(tmp_path):
    r = torchrun(Path(__file__).parents[1]/'nbs'/'train_distributed.py', '--epochs', '1')
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'world=2 micro_bs=2 n_step=16 effective batch=64' in r.stdout
