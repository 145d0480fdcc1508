"`Accumulation` in a plain PyTorch loop: big-batch gradients, exact BatchNorm, one step per window, DDP on gloo."
import os, subprocess, sys
from pathlib import Path
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from fastai_accum.core import Accumulation
from fastai_accum.batchnorm import bn_layers

def mlp(): return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
def bn_net(): return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

def data(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype) * 2 + 1, torch.randn(n, 1, generator=g, dtype=dtype)

def grads(m): return [p.grad.detach().clone() for p in m.parameters()]
def rel(a, b): return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()

@pytest.mark.parametrize('n_step,n_acc', [(3, None), (None, 10), (4, None)])
def test_bn_free_gradients_equal_big_batch(n_step, n_acc):
    "10 samples in micro-batches of 4, 4, 2 (ragged last micro-batch): one window (ragged when n_step=4) = the big batch."
    x, y = data(10)
    torch.manual_seed(0); m = mlp(); ref = mlp(); ref.load_state_dict(m.state_dict())
    acc = Accumulation(m, n_step=n_step, n_acc=n_acc)
    steps, got = 0, None
    for xb, yb in acc.batches(DataLoader(TensorDataset(x, y), batch_size=4)):
        if acc.backward(nn.functional.mse_loss(m(xb), yb)): steps += 1; got = grads(m)
    assert steps == 1 and acc.exact is False
    nn.functional.mse_loss(ref(x), y).backward()
    for g, r in zip(got, grads(ref)): assert rel(g, r) <= 1e-6

def test_steps_once_per_window_and_gradients_each_window():
    "22 samples, micro-batches of 2, n_step 4: windows of 8, 8, 6 samples; each window's gradient is its big batch's."
    x, y = data(22)
    torch.manual_seed(0); m = mlp(); ref = mlp(); ref.load_state_dict(m.state_dict())
    opt, ropt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    acc = Accumulation(m, n_step=4)
    steps = 0
    for xb, yb in acc.batches(DataLoader(TensorDataset(x, y), batch_size=2)):
        if acc.backward(nn.functional.mse_loss(m(xb), yb)):
            lo, hi = 8 * steps, min(8 * steps + 8, 22)
            nn.functional.mse_loss(ref(x[lo:hi]), y[lo:hi]).backward()
            for g, r in zip(grads(m), grads(ref)): assert rel(g, r) <= 1e-6
            opt.step(); opt.zero_grad(); ropt.step(); ropt.zero_grad(); steps += 1
    assert steps == acc.steps == 3
    assert len(acc.losses) == 3  # one mean loss per window

def record_bn_inputs(model, seen):
    "Append every training forward's input to each BatchNorm layer to `seen[i]` (pre-pass forwards excluded)."
    for i, bn in enumerate(bn_layers(model)):
        seen.append([])
        bn.register_forward_pre_hook(lambda mod, inp, i=i: seen[i].append(inp[0].detach().clone())
                                     if mod.training and getattr(mod, '_prepass', None) is None else None)

@pytest.mark.parametrize('policy', ['window', 'micro', 'exact', 'auto'])
def test_bn_running_stats_equal_concatenated_window(policy):
    "float64, windows of 9, 9, 2 samples: after each step the running statistics are BatchNorm's on the concatenated window."
    x, y = data(20, torch.float64)
    torch.manual_seed(0); m = bn_net().double()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    acc = Accumulation(m, n_step=3, policy=policy)
    seen, steps, outs, xs = [], 0, [], []
    record_bn_inputs(m, seen)
    before = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bn_layers(m)]
    for xb, yb in acc.batches(DataLoader(TensorDataset(x, y), batch_size=3)):
        if not xs:  # a new window: forget forwards outside training ('exact' plans with one measuring forward)
            for s in seen: s.clear()
        out = m(xb); outs.append(out.detach()); xs.append(xb)
        params = {k: v.detach().clone() for k, v in m.state_dict().items()}
        if acc.backward(nn.functional.mse_loss(out, yb)):
            steps += 1
            for bn, (rm, rv), inp in zip(bn_layers(m), before, seen):
                ref = nn.BatchNorm1d(bn.num_features).double()
                ref.running_mean.copy_(rm); ref.running_var.copy_(rv)
                ref(torch.cat(inp))  # plain BatchNorm on the concatenated window
                assert rel(bn.running_mean, ref.running_mean) <= 1e-12 and rel(bn.running_var, ref.running_var) <= 1e-12
            if policy != 'micro':  # the window's forward is the big batch's
                big = bn_net().double(); big.load_state_dict(params)
                assert rel(torch.cat(outs), big(torch.cat(xs)).detach()) <= 1e-10
            opt.step(); opt.zero_grad()
            before = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bn_layers(m)]
            outs, xs = [], []
    assert steps == acc.steps == 3
    assert acc.exact == (policy in ('exact', 'auto'))

def test_exact_yields_whole_windows_and_drop():
    x, y = data(20)
    m = bn_net()
    acc = Accumulation(m, n_step=3, policy='exact', partial='drop')
    sizes = [xb.shape[0] for xb, yb in acc.batches(DataLoader(TensorDataset(x, y), batch_size=3))]
    assert sizes == [9, 9]  # the ragged window of 2 is dropped

def test_break_mid_window_clears():
    x, y = data(20)
    m = bn_net()
    acc = Accumulation(m, n_step=4, policy='window')
    for i, (xb, yb) in enumerate(acc.batches(DataLoader(TensorDataset(x, y), batch_size=2))):
        acc.backward(nn.functional.mse_loss(m(xb), yb))
        if i == 1: break
    assert acc.window.empty and all(p.grad is None for p in m.parameters())
    assert all(type(bn) in (nn.BatchNorm1d, nn.BatchNorm2d) and 'pending' not in vars(bn) for bn in bn_layers(m))  # torch's own again

def test_backward_without_batches_fails():
    m = mlp(); acc = Accumulation(m, n_step=2)
    with pytest.raises(RuntimeError, match='without a micro-batch'): acc.backward(m(torch.randn(2, 6)).sum())

SCRIPT = Path(__file__).parent/'core_dist_script.py'

@pytest.mark.parametrize('mode', ['mlp', 'window', 'exact'])
def test_ddp_one_allreduce_per_window(mode, tmp_path):
    "2 gloo processes x micro-batch 2 x n_step 4, 22 samples per rank (windows 8, 8, 6): 3 all-reduces per epoch."
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2', str(SCRIPT), mode, str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r0, r1 = [torch.load(tmp_path/f'rank{i}.pt', weights_only=False) for i in range(2)]
    assert r0['allreduces'] == r1['allreduces'] == 2 * 3 and r0['steps'] == r1['steps'] == 2 * 3
    for p0, p1 in zip(r0['params'], r1['params']): assert torch.equal(p0, p1)
    for a, b in zip(r0['stats'], r1['stats']): assert torch.equal(a, b)  # identical statistics on both ranks
    if mode in ('mlp', 'exact'):  # = one process on the union of both ranks' windows ('exact': BatchNorm over the union too)
        x0, y0 = r0['data']; x1, y1 = r1['data']
        ref = (mlp() if mode == 'mlp' else nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))).double()
        ref.load_state_dict(r0['init'])
        opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        for _ in range(2):
            for lo in (0, 8, 16):
                hi = min(lo + 8, 22)
                nn.functional.mse_loss(ref(torch.cat([x0[lo:hi], x1[lo:hi]])), torch.cat([y0[lo:hi], y1[lo:hi]])).backward()
                opt.step(); opt.zero_grad()
        for p, q in zip(r0['params'], ref.parameters()): assert rel(p, q.detach()) <= 1e-9
        if mode == 'exact':
            assert r0['path'] == r1['path'] == 'staged exact'  # plain BatchNorm under DDP: the whole window as one staged chunk
            (m, v), bn = r0['final'][0], ref[1]
            assert rel(m, bn.running_mean) <= 1e-9 and rel(v, bn.running_var) <= 1e-9
    if mode == 'window':  # the running statistics are BatchNorm's on the union of both ranks' windows
        for (m, v), (rm, rv) in zip(r0['final'], r0['reference']): assert rel(m, rm) <= 1e-10 and rel(v, rv) <= 1e-10

def test_staged_window_with_inputs_waiting_on_the_host_is_the_big_batch(monkeypatch):
    "`inputs_on` forced (on an accelerator: host memory for a staged step): the window's inputs are joined where they wait, the targets on the device, and the step is the big batch's (float64)."
    monkeypatch.setattr(Accumulation, 'inputs_on', property(lambda self: 'cpu' if self.exact and self.plan.staged else None))
    x, y = data(12, torch.float64)
    torch.manual_seed(0); big = bn_net().double(); m = bn_net().double(); m.load_state_dict(big.state_dict())
    nn.functional.mse_loss(big(x), y).backward()
    acc, placed, got = Accumulation(m, n_step=3, policy='staged'), [], None
    for xb, yb in acc.batches(DataLoader(TensorDataset(x, y), batch_size=4)):
        placed.append(acc.inputs_on)
        if acc.backward(nn.functional.mse_loss(m(xb), yb)): got = grads(m)
    assert placed == ['cpu'] and acc.path == 'staged exact'
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # biases before BatchNorm have a gradient of zero (noise): compared as one vector
    assert rel(flat(got), flat(grads(big))) < 1e-9
    # where each element goes, seen with a device of its own ('meta' stands in for host memory): inputs there, targets on the model's device
    monkeypatch.setattr(Accumulation, 'inputs_on', property(lambda self: 'meta' if self.exact and self.plan.staged else None))
    acc = Accumulation(bn_net().double(), n_step=3, policy='staged')
    xb, yb = next(iter(acc.batches(DataLoader(TensorDataset(x, y), batch_size=4))))
    assert (xb.device.type, yb.device.type, xb.shape[0]) == ('meta', 'cpu', 12)
