"""The branches a GPU takes, run on the CPU: inside `emulated_accelerator` the CPU counts as a device with memory of its
own (a device budget, offload to a separate host copy, a staged step's inputs and kept values in a host store), so
that what an accelerator user gets is checked in CI against the big batch (float64), and under float16 autocast with
a GradScaler against float64 within a stated tolerance."""
import contextlib, copy
import pytest, torch
from torch import nn
import torch.nn.functional as F
from fastai_accum.core import Accumulation, _input_elements
from fastai_accum.exact import plan_exact, Footprint, ExactPlan, release_pinned, measure_footprint
from fastai_accum.helpers import emulated_accelerator
from fastai_accum.staged_exact import StagedStep, install_staged
from fastai_accum.chunk_sizer import ChunkSizer
import fastai_accum.exact as exact, fastai_accum.window as window, fastai_accum.plan as plan
from helpers import forced_budget as budget  # a device budget the window does not fit, one chunk does
from helpers import Dense, staged_config

def net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))

def windows(n_win=2, n_step=4, bs=2, dtype=torch.float64, scale=2., size=8):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(bs, 3, size, size, generator=g).to(dtype) * scale + 1, torch.randn(bs, 5, generator=g).to(dtype))
            for _ in range(n_win * n_step)]

def rel(a, b):
    "Relative difference; zero below 1e-12 absolute (gradients that are rounding noise: a bias before a BatchNorm)."
    d = (a - b).abs().max().item()
    return 0. if d <= 1e-12 else d / b.abs().max().item()

def grads_per_window(policy, n_step=4, device_memory=None, make=net, n_win=2, **kw):
    "[(the core's gradients, the big batch's)] at each window's step, float64, inside `emulated_accelerator`; and the core."
    batches = windows(n_win=n_win, n_step=n_step)
    torch.manual_seed(0); big = make().double().train(); ours = copy.deepcopy(big)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (big, ours)]
    with emulated_accelerator():
        acc = Accumulation(ours, n_step=n_step, policy=policy, device_memory=device_memory or budget(ours, batches[0], n_step), **kw)
        got = []
        for x, y in acc.batches(batches):
            if acc.backward(F.mse_loss(ours(x), y)):
                got.append([p.grad.clone() for p in ours.parameters()]); opts[1].step(); opts[1].zero_grad()
    ref = []
    for i in range(0, len(batches), n_step):
        x, y = (torch.cat(t) for t in zip(*batches[i:i + n_step]))
        F.mse_loss(big(x), y).backward()
        ref.append([p.grad.clone() for p in big.parameters()]); opts[0].step(); opts[0].zero_grad()
    for (g, r) in zip(got, ref): assert len(g) == len(r) == len(list(big.parameters()))
    return list(zip(got, ref)), acc, (ours, big)

@pytest.fixture
def hooks_entered(monkeypatch):
    "How often `save_on_cpu` (the offload's saved-tensor hook) was entered."
    entered, orig = [], torch.autograd.graph.save_on_cpu
    def spy(*a, **kw):
        entered.append(kw.get('pin_memory'))
        return orig(*a, **kw)
    monkeypatch.setattr(torch.autograd.graph, 'save_on_cpu', spy)
    return entered

@pytest.mark.parametrize('policy', ['staged', 'auto'])
def test_staged_on_an_accelerator_plan_is_the_big_batch_and_never_offloads(policy, hooks_entered):
    "A window that does not fit the device, offload asked for: the staged step keeps its values in the host store itself, no saved-tensor hook wraps it, every parameter's gradient at every step is the big batch's."
    pairs, acc, (ours, _) = grads_per_window(policy, offload=True)
    assert acc.path == 'staged exact' and acc.plan.on_accelerator and not acc.plan.offload and hooks_entered == []
    assert acc.inputs_on == 'cpu' and len(pairs) == 2
    for got, ref in pairs:
        for g, r in zip(got, ref): assert rel(g, r) < 1e-9

def test_a_dense_block_staged_on_an_accelerator_keeps_features_on_the_device_and_is_the_big_batch(monkeypatch):
    """A DenseNet block (each feature read by every later stage) staged under a budget that forces chunks, SGD steps
    between windows: from the second window on, features stay on the device between their reading stages (planned from
    the window before), and every window's gradients are the big batch's."""
    parts, plan = [], ChunkSizer.device_part
    staged_config(monkeypatch, margin=1.)  # the mechanism, on a block too small for the default's room
    def counted(self, *args):
        part = plan(self, *args)
        parts.append(len(part) if part is not None else 0)
        return part
    monkeypatch.setattr(ChunkSizer, 'device_part', counted)
    pairs, acc, _ = grads_per_window('staged', make=lambda: Dense(out=5), n_win=3)
    assert acc.path == 'staged exact' and len(pairs) == 3 and parts[-1] > 0 and parts[0] == 0
    for got, ref in pairs:
        for g, r in zip(got, ref): assert rel(g, r) < 1e-9

def test_offloaded_whole_window_copies_saved_activations_to_the_host_and_is_the_big_batch(hooks_entered):
    "'exact' with offload on an accelerator: saved activations go to host memory through `save_on_cpu` (pinned where the build can pin), the step is the big batch's."
    pairs, acc, _ = grads_per_window('exact', offload=True, device_memory=10**9)
    assert acc.path == 'exact' and acc.plan.offload and hooks_entered == [True, True]
    for got, ref in pairs:
        for g, r in zip(got, ref): assert rel(g, r) < 1e-9

def test_window_bn_on_an_accelerator_keeps_its_prepass_values_in_the_host_store():
    "The 'window' fallback's staged pre-pass keeps values in host memory on an accelerator: same training as on the CPU."
    def train(emulate):
        batches = windows()
        torch.manual_seed(0); m = net().double().train()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with emulated_accelerator() if emulate else contextlib.nullcontext():
            acc = Accumulation(m, n_step=4, policy='window', prepass_memory=1)
            for x, y in acc.batches(batches):
                if acc.backward(F.mse_loss(m(x), y)): opt.step(); opt.zero_grad()
        return torch.cat([t.flatten().double() for t in m.state_dict().values()])
    a, b = train(False), train(True)
    assert torch.equal(a, b)

class Unscaled(nn.Module):
    "Activations that reach 1e3 (unnormalised inputs, a wide first layer): per-channel sums of scaled fp16 gradients overflow fp16."
    def __init__(s):
        super().__init__()
        s.c1, s.b1, s.c2, s.b2, s.head = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Linear(16, 5)
        with torch.no_grad(): s.c1.weight.mul_(20.); s.head.weight.mul_(5.)
    def forward(s, x): return s.head(F.relu(s.b2(s.c2(F.relu(s.b1(s.c1(x)))))).mean((2, 3)))

def test_fp16_autocast_with_grad_scaler_through_the_staged_step(monkeypatch):
    """float16 autocast and a GradScaler (scale 65,536) on the accelerator path, a window of 32 in chunks of 4, activations
    above 1e3: the window sums stay finite (float32), the scaler finds no inf, and the unscaled gradient is within 1.25x
    plain fp16 autocast's error against float64 (stated tolerance; both about 1e-3 relative)."""
    project = StagedStep._project
    sums = []  # the window sums each projection uses (from a pass over the chunks, or the layer's own weight and bias gradients)
    def spy(self, s, bar, fixed, window_sums):
        sums.append(window_sums)
        return project(self, s, bar, fixed, window_sums)
    monkeypatch.setattr(StagedStep, '_project', spy)
    torch.manual_seed(0); ref = Unscaled().double().train()
    batches = windows(n_win=1, n_step=8, bs=4, dtype=torch.float32, scale=3., size=16)
    x, y = (torch.cat(t) for t in zip(*batches))
    F.mse_loss(ref(x.double()), y.double()).backward()
    half = lambda: torch.autocast('cpu', dtype=torch.float16)
    def fp16_grads(staged):
        m = copy.deepcopy(ref).float(); m.zero_grad()
        opt = torch.optim.SGD(m.parameters(), lr=0.)
        scaler = torch.amp.GradScaler('cpu', init_scale=65536.)
        if staged:
            with emulated_accelerator():
                acc = Accumulation(m, n_step=8, policy='staged', autocast=half, device_memory=budget(m, batches[0], 8) // 2)
                for xb, yb in acc.batches(batches):
                    with half(): loss = F.mse_loss(m(xb).float(), yb)
                    if acc.backward(scaler.scale(loss)): break
            assert acc.path == 'staged exact' and acc.plan.chunk < 32
        else:
            with half(): loss = F.mse_loss(m(x).float(), y)
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        assert all(torch.isfinite(p.grad).all() for p in m.parameters()), (staged, [(n, p.grad.abs().max().item()) for n, p in m.named_parameters() if not torch.isfinite(p.grad).all()])
        scaler.step(opt); scaler.update()
        assert scaler.get_scale() == 65536.  # the scaler found no inf or NaN: it would have halved the scale
        return torch.cat([p.grad.double().flatten() for p in m.parameters()])
    g_ref = torch.cat([p.grad.flatten() for p in ref.parameters()])
    err = lambda g: ((g - g_ref).norm() / g_ref.norm()).item()
    plain, staged = fp16_grads(False), fp16_grads(True)
    sums = [s for s in sums if s.dtype != torch.float64]  # the training step's (not the float64 check's)
    assert sums and all(torch.isfinite(s).all() and s.dtype == torch.float32 for s in sums)
    assert max(s.abs().max().item() for s in sums) > 65504  # sums an fp16 accumulator could not hold
    assert err(staged) <= 1.25 * err(plain) and err(staged) < 1e-2

def test_inputs_are_copied_only_by_the_stages_that_read_them(monkeypatch):
    "Each chunk of the window's inputs goes to the device once in the forward and once in the backward (and for a BatchNorm on the input): not once per stage."
    copies = []
    from fastai_accum.window_store import WindowStore
    orig = WindowStore.inputs
    def spy(self, *a, **kw):
        out = orig(self, *a, **kw)
        if out: copies.append(out)
        return out
    monkeypatch.setattr(WindowStore, 'inputs', spy)
    m = net().double().train(); f = install_staged(m, chunk=2)
    m(torch.randn(8, 3, 8, 8, dtype=torch.float64)).sum().backward()
    assert len(f.step.cut) == 4 and f.step.cut.reads_input == [True, False, False, False]
    assert len(copies) == 2 * len(f.step.spans[0])

def test_the_plan_keeps_the_device_it_trains_on_and_nccl_collectives_go_there(monkeypatch):
    "A process on GPU 1 that never called `set_device`: the plan names cuda:1, and NCCL's collectives (`_agreed`, fastai's `DistributedDL`) use it, not GPU 0."
    import torch.distributed as dist
    from fastai_accum.distributed import fix_distributed_dl
    import fastai_accum.distributed as distributed
    m = net()
    assert plan_exact(m, (torch.randn(2, 3, 8, 8),), 8).device == 'cpu'
    monkeypatch.setattr(dist, 'get_backend', lambda *a: 'nccl')
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    assert distributed.collective_device('cuda:1') == torch.device('cuda', 1)
    assert distributed.collective_device(torch.device('cuda')) == distributed.collective_device(None) == torch.device('cuda', 0)
    monkeypatch.setattr(dist, 'get_backend', lambda *a: 'gloo')
    assert distributed.collective_device('cuda:1') == torch.device('cpu')
    seen = []
    monkeypatch.setattr(distributed, 'collective_device', lambda d: seen.append(d) or torch.device('cpu'))
    monkeypatch.setattr(dist, 'broadcast', lambda t, rank: None)
    from fastai.distributed import DistributedDL
    monkeypatch.setattr(DistributedDL, '_broadcast', DistributedDL._broadcast)  # the patch below is undone after the test
    fix_distributed_dl()
    class FakeDL: device = torch.device('cuda', 1)
    assert DistributedDL._broadcast(FakeDL(), [3, 1, 2], 0) == [3, 1, 2] and seen == [torch.device('cuda', 1)]
    monkeypatch.setattr(plan, "world_size", lambda: 2)
    monkeypatch.setattr(plan, "collective_device", lambda d: seen.append(d) or torch.device("cpu"))
    monkeypatch.setattr(plan.dist, "all_reduce", lambda t, op=None: None)
    assert plan._agreed('cuda:1', True, False) == [True, False] and seen[-1] == 'cuda:1'

def test_offload_host_memory_counts_each_saved_tensor_in_its_pinned_block():
    "`save_on_cpu` copies every saved tensor on its own, and pinned memory comes in powers of two: the plan counts both."
    fp = Footprint(saved=1000., working=10., blocks=(1000., 700.), fixed=3000)
    assert fp.offloaded(4) == 4000 + 2800 + 3000
    assert fp.offloaded(4, pinned=True) == 4096 + 4096 + 4096
    m = net(); x = torch.randn(4, 3, 8, 8)
    measured = measure_footprint(m, x)
    assert sum(measured.blocks) >= measured.saved and measured.fixed >= sum(p.numel() * 4 for p in m.parameters() if p.dim() > 1)
    p = ExactPlan(16, measured, 0, 'cpu', None, 10**9, offload=True, accelerator=True)
    assert p.host_needed == measured.offloaded(16) >= 16 * measured.saved

def test_the_plan_is_measured_under_the_training_autocast():
    "Under bf16 autocast a forward saves about half the bytes: the plan measures it so (autocast's weight copies do not count per sample)."
    m = net(); x = torch.randn(4, 3, 16, 16)
    full = plan_exact(m, (x,), 16)
    half = plan_exact(m, (x,), 16, autocast=lambda: torch.autocast('cpu', dtype=torch.bfloat16))
    assert half.footprint.saved <= 0.7 * full.footprint.saved
    acc = Accumulation(m, n_step=4, policy='exact', autocast=lambda: torch.autocast('cpu', dtype=torch.bfloat16))
    list(zip(range(1), acc.batches([(x, torch.randn(4, 5))] * 4)))
    assert acc.plan.footprint.saved == pytest.approx(half.footprint.saved, rel=0.05)

def test_pinned_blocks_are_given_back_after_the_fit(monkeypatch):
    "torch keeps pinned host blocks cached for reuse: after a fit whose plan pinned host memory they are given back."
    calls = []
    monkeypatch.setattr(exact, 'can_pin', lambda: True)
    monkeypatch.setattr(torch._C, '_host_emptyCache', lambda: calls.append(1), raising=False)  # torch < 2.5 has none: nothing to give back
    plan = ExactPlan(8, Footprint(1., 1.), 0, 'cuda:0', 10, 10, offload=True)
    release_pinned(plan); release_pinned(None); release_pinned(ExactPlan(8, Footprint(1., 1.), 0, 'cpu', None, 10, offload=True))
    assert calls == [1]

def test_a_custom_inputs_that_makes_new_tensors_keeps_its_source_on_the_host():
    "`inputs=lambda b: (b[0].float() / 255,)` makes a new tensor: the element it reads is found (tried on the meta device) and waits in host memory."
    x, y = torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8), torch.randn(2, 5)
    assert _input_elements(lambda b: (b[0].float() / 255,), (x, y)) == {0}
    assert _input_elements(lambda b: (b[1],), (x, y)) == {1}
    assert _input_elements(lambda b: (b[0].float() / b[0].float().max().item(),), (x, y)) == set()  # reads values: unknown
    batches = [(torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8), torch.randn(2, 5)) for _ in range(8)]
    m = net()
    inputs = lambda b: (b[0].float() / 255,)
    with emulated_accelerator():
        acc = Accumulation(m, n_step=4, policy='staged', inputs=inputs)
        for b in acc.batches(batches):
            acc.backward(F.mse_loss(m(*inputs(b)), b[1]))
            assert acc._input_at == {0}

def test_accelerate_mixed_precision_outputs_stay_float32_under_the_staged_step():
    "Accelerate wraps a prepared model's forward in autocast and converts its outputs to float32: the staged step that replaces it does the same."
    pytest.importorskip('accelerate')
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from fastai_accum.accelerate import AcceleratedAccumulation
    AcceleratorState._reset_state(True); GradientState._reset_state()
    try:
        accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True, mixed_precision='bf16')
        m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        data = [(torch.randn(4, 6), torch.randn(4, 1)) for _ in range(4)]
        model, opt = accelerator.prepare(m, opt)
        acc = AcceleratedAccumulation(accelerator, model, policy='staged')
        dtypes = []
        for xb, yb in acc.batches(data):
            with accelerator.accumulate(model):
                out = model(xb)
                dtypes.append(out.dtype)
                acc.backward(F.mse_loss(out, yb)); opt.step(); opt.zero_grad()
        assert acc.path == 'staged exact' and dtypes == [torch.float32] * 2
    finally: AcceleratorState._reset_state(True); GradientState._reset_state()

def test_the_plan_counts_the_optimizer_s_state():
    "fastai's default Adam keeps two tensors per parameter: the plan reserves 4x the parameters (3x was assumed), from the Learner's optimizer, before and after its first step."
    from helpers import make_learner, bn_net
    from fastai_accum.callback import GradientAccumulation
    from fastai.optimizer import Adam
    ga = GradientAccumulation(n_step=4, preflight=False)
    learn = make_learner(4, bn_net, image=True, cbs=ga, opt_func=Adam)  # fastai's default optimizer
    for _ in range(2):
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
        assert ga.plan.opt_state == pytest.approx(2.) and ga.plan.param_needed == 4 * ga.plan.params
    m = net(); opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulation(m, n_step=2, policy='exact', optimizer=opt)
    x = torch.randn(2, 3, 8, 8)
    for xb, yb in acc.batches([(x, torch.randn(2, 5))] * 2):
        if acc.backward(F.mse_loss(m(xb), yb)): opt.step()
    assert acc.plan.opt_state == 1. and acc.plan.param_needed == 3 * acc.plan.params
