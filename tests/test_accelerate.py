"`AcceleratedAccumulation` inside `accelerator.accumulate(model)`: big-batch gradients, exact BatchNorm, bf16, `accelerate launch`."
import os, subprocess, sys
from pathlib import Path
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
pytest.importorskip('accelerate')
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from fastai_accum.accelerate import AcceleratedAccumulation
from fastai_accum.batchnorm import bn_layers

def tanh_mlp(): return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
def bn_mlp(): return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
def rel(a, b): return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()

@pytest.fixture(autouse=True)
def fresh_state():
    AcceleratorState._reset_state(True); GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True); GradientState._reset_state()

def data(n, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g, dtype=dtype) * 2 + 1, torch.randn(n, 1, generator=g, dtype=dtype)

def run(model_fn, n, bs, gas, dtype=torch.float32, mixed_precision='no', epochs=1, on_step=None, **kw):
    "Train with accelerate's usual accumulate loop; call `on_step(model, window)` at each window's end (before the step)."
    x, y = data(n, dtype)
    accelerator = Accelerator(gradient_accumulation_steps=gas, cpu=True, mixed_precision=mixed_precision)
    torch.manual_seed(0); net = model_fn().to(dtype)
    init = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt, dl = accelerator.prepare(net, opt, DataLoader(TensorDataset(x, y), batch_size=bs))
    steps = []
    opt.optimizer.register_step_post_hook(lambda *a: steps.append(1))
    acc = AcceleratedAccumulation(accelerator, model, **kw)
    for _ in range(epochs):
        window = []
        for xb, yb in acc.batches(dl):
            with accelerator.accumulate(model):
                out = model(xb)
                window.append((xb, yb, out.detach()))
                end = acc.backward(nn.functional.mse_loss(out.float(), yb.float()))
                if end and on_step: on_step(net, window)
                opt.step(); opt.zero_grad()
            if end: window = []
    return net, init, acc, len(steps)

@pytest.mark.parametrize('n,bs,gas', [(10, 4, 3), (10, 4, 4), (22, 2, 4)])
def test_bn_free_gradients_equal_big_batch(n, bs, gas):
    "Ragged last micro-batch (10 = 4+4+2), ragged window (n_step 4 over 3 micro-batches), several windows."
    checked = []
    def check(net, window):
        ref = tanh_mlp(); ref.load_state_dict({k: v for k, v in net.state_dict().items()})  # parameters before this step
        nn.functional.mse_loss(ref(torch.cat([w[0] for w in window])), torch.cat([w[1] for w in window])).backward()
        for p, q in zip(net.parameters(), ref.parameters()): assert rel(p.grad, q.grad) <= 1e-6
        checked.append(len(window))
    net, init, acc, steps = run(tanh_mlp, n, bs, gas, on_step=check)
    windows = -(-(-(-n // bs)) // gas)
    assert steps == acc.steps == len(checked) == windows

@pytest.mark.parametrize('policy', ['window', 'exact'])
def test_bn_stats_forward_and_steps(policy):
    "float64, 20 samples in micro-batches of 3, windows of 3: running statistics = BatchNorm on each concatenated window."
    seen = []
    def check(net, window):
        xw = torch.cat([w[0] for w in window])
        for bn, (rm, rv), inp in zip(bn_layers(net), before[-1], seen_inputs(net, xw, window)):
            ref = nn.BatchNorm1d(bn.num_features).double(); ref.running_mean.copy_(rm); ref.running_var.copy_(rv)
            ref(inp)
            assert rel(bn.running_mean, ref.running_mean) <= 1e-12 and rel(bn.running_var, ref.running_var) <= 1e-12
        before.append([(bn.running_mean.clone(), bn.running_var.clone()) for bn in bn_layers(net)])
        seen.append(len(window))
    def seen_inputs(net, xw, window):
        "Each BatchNorm's input when plain BatchNorm runs the whole window (the big batch) with these parameters."
        big = bn_mlp().double(); big.load_state_dict(net.state_dict()); ins = []
        for bn in bn_layers(big): bn.register_forward_pre_hook(lambda m, i: ins.append(i[0].detach()))
        out = big(xw)
        assert rel(torch.cat([w[2] for w in window]), out.detach()) <= 1e-10  # the window's forward is the big batch's
        return ins
    before = [[(torch.zeros(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)),
               (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))]]
    net, init, acc, steps = run(bn_mlp, 20, 3, 3, torch.float64, on_step=check, policy=policy)
    assert steps == acc.steps == len(seen) == 3 and acc.exact == (policy == 'exact')
    if policy == 'exact': assert seen == [1, 1, 1]  # each window arrives as one batch

def test_bf16_autocast():
    "bf16 autocast on CPU: the pre-pass runs under it; statistics = BatchNorm on the window's (bf16) inputs, one step per window."
    ins = []
    def bn_mlp_rec():
        m = bn_mlp()
        m[1].register_forward_pre_hook(lambda mod, i: ins.append(i[0].detach()) if mod.training and getattr(mod, '_prepass', None) is None else None)
        return m
    net, init, acc, steps = run(bn_mlp_rec, 20, 4, 2, mixed_precision='bf16', policy='window')
    assert steps == acc.steps == 3
    assert all(t.dtype == torch.bfloat16 for t in ins)  # the training forward ran in bf16 ...
    ref = nn.BatchNorm1d(8).double()
    for lo in (0, 2, 4): ref(torch.cat(ins[lo:lo+2]).double())
    assert rel(net[1].running_mean, ref.running_mean) <= 1e-5 and rel(net[1].running_var, ref.running_var) <= 1e-5

def test_backward_outside_accumulate_fails():
    x, y = data(8)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = accelerator.prepare(tanh_mlp())
    acc = AcceleratedAccumulation(accelerator, model)
    with pytest.raises(RuntimeError, match='accumulate'):
        for xb, yb in acc.batches(DataLoader(TensorDataset(x, y), batch_size=2)):
            acc.backward(nn.functional.mse_loss(model(xb), yb))

def test_n_step_must_match():
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    with pytest.raises(ValueError, match='gradient_accumulation_steps=2'): AcceleratedAccumulation(accelerator, tanh_mlp(), n_step=4)

SCRIPT = Path(__file__).parent/'accelerate_dist_script.py'

@pytest.mark.parametrize('mode', ['mlp', 'window'])
def test_accelerate_launch_one_allreduce_per_window(mode, tmp_path):
    "`accelerate launch`, 2 gloo processes, 11 micro-batches of 2 per rank (windows 4, 4, 3), 2 epochs: 6 all-reduces, 6 steps."
    cmd = [sys.executable, '-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
           '--mixed_precision', 'no', '--dynamo_backend', 'no', str(SCRIPT), mode, str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r0, r1 = [torch.load(tmp_path/f'rank{i}.pt', weights_only=False) for i in range(2)]
    assert r0['allreduces'] == r1['allreduces'] == 6 and r0['steps'] == r1['steps'] == 6
    for p0, p1 in zip(r0['params'], r1['params']): assert torch.equal(p0, p1)
    for a, b in zip(r0['stats'], r1['stats']): assert torch.equal(a, b)  # identical statistics on both ranks
    if mode == 'mlp':  # = one process on the union of both ranks' windows
        ref = tanh_mlp().double(); ref.load_state_dict(r0['init'])
        opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        for _ in range(2):
            for lo, hi in ((0, 4), (4, 8), (8, 11)):
                xs = [b[0] for r in (r0, r1) for b in r['batches'][lo:hi]]; ys = [b[1] for r in (r0, r1) for b in r['batches'][lo:hi]]
                nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
                opt.step(); opt.zero_grad()
        for p, q in zip(r0['params'], ref.parameters()): assert rel(p, q.detach()) <= 1e-6
    else:
        for (m, v), (rm, rv) in zip(r0['final'], r0['reference']): assert rel(m, rm) <= 1e-10 and rel(v, rv) <= 1e-10

def test_staged_equals_exact_through_accelerate():
    "policy='staged' under `accelerator.accumulate`: each window trained stage by stage equals it trained as one batch (float64)."
    runs = {p: run(bn_mlp, 20, 3, 3, torch.float64, epochs=2, policy=p) for p in ('exact', 'staged')}
    (ne, _, ae, se), (ns, _, as_, ss) = runs['exact'], runs['staged']
    assert (ae.path, as_.path) == ('exact', 'staged exact') and se == ss == 2 * 3
    for p, q in zip(ns.state_dict().values(), ne.state_dict().values()):
        assert rel(p.double(), q.double()) <= 1e-10

def test_staged_under_bf16_autocast_runs_in_bf16():
    "Accelerate's bf16 autocast wraps the model's forward; the staged step re-enters it (its BatchNorm inputs are bf16)."
    seen = []
    def bn_mlp_rec():
        m = bn_mlp()
        m[0].register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
        return m
    net, init, acc, steps = run(bn_mlp_rec, 20, 4, 2, mixed_precision='bf16', policy='staged')
    assert acc.path == 'staged exact' and steps == 3
    assert seen[-4:] == [torch.bfloat16] * 4  # the last window's forward and recompute (planning measures outside autocast)
    assert all(torch.isfinite(p).all() for p in net.parameters())
