"""The staged step's traffic between its host store and the device, as a GPU would make it (`emulated_accelerator`):
every copy goes through the link and its ledger counts each one (a dispatch mode counting every op that touches a
store tensor agrees), no copy blocks the host, no arithmetic runs on host tensors, one sync a window, the bytes at
the schedule's floor; and the step is the big batch's, also when the writes run as late as a copy stream may."""
import copy
import pytest, torch
from torch import nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from fastai_accum.helpers import emulated_accelerator
from fastai_accum.link import DeferredCopies, Link
from fastai_accum.staged_exact import install_staged, uninstall_staged
from fastai_accum.chunk_sizer import ChunkSizer
from fastai_accum.window_store import WindowStore
from helpers import Dense, staged_config

class Residual(nn.Module):
    "A BatchNorm on the input, a residual add (a value read by a later stage) and a BatchNorm read twice over a skip."
    def __init__(self):
        super().__init__()
        self.bn0, self.conv1, self.bn1 = nn.BatchNorm2d(3), nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2, self.conv3 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)
        self.bn3, self.head = nn.BatchNorm2d(8), nn.Linear(8, 3)
    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(self.bn0(x))))
        h = F.relu(self.bn2(self.conv2(h)) + h)
        h = F.relu(self.bn3(self.conv3(h))) + h
        return self.head(h.mean((2, 3)))

def _storage(t): return t.untyped_storage().data_ptr()

class StoreTraffic(TorchDispatchMode):
    "Every op touching a host tensor of the store (or the window's inputs): copies in and out, and any other op."
    def __init__(self, host:set):
        super().__init__()
        self.host, self.h2d, self.d2h, self.copies, self.math = host, 0, 0, 0, []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view: return out
        ts = [a for a in args if isinstance(a, torch.Tensor)]
        on_host = [t for t in ts if _storage(t) in self.host]
        if not on_host: return out
        nbytes = lambda t: t.numel() * t.element_size()
        into, out_of = (_storage(t) in self.host for t in ts[:2]) if len(ts) > 1 else (False, False)
        if func is torch.ops.aten.copy_.default and into and not out_of:  # a write into the store
            self.d2h, self.copies = self.d2h + nbytes(ts[1]), self.copies + 1
        elif func is torch.ops.aten.copy_.default and out_of and not into:  # a read into a device tensor (ahead)
            self.h2d, self.copies = self.h2d + nbytes(ts[1]), self.copies + 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.clone.default):
            self.h2d, self.copies = self.h2d + nbytes(ts[0]), self.copies + 1
        else: self.math.append((str(func), sum(map(nbytes, on_host))))
        return out

def counted_window(monkeypatch, model, x, chunk=2, budget=None, warm=0, writes=None, reads=None):
    """One staged window of `model` on `x` under `emulated_accelerator`, every op on the store counted independently
    (after `warm` windows not counted; copies issued by `writes` and `reads`, default as they come)."""
    host, make, alive = {_storage(x)}, WindowStore.new, []
    def recorded(self, *a, **k):
        t = make(self, *a, **k)
        # held until the count ends: a freed store tensor's address would otherwise be reused by a device tensor
        # (the emulated device is host memory too) and its math counted as the store's
        if t.device.type == 'cpu': host.add(_storage(t)); alive.append(t)
        return t
    monkeypatch.setattr(WindowStore, 'new', recorded)
    with emulated_accelerator():
        f = install_staged(model, chunk, budget=budget)
        f.step.config.set(writes=writes, reads=reads)
        try:
            for _ in range(warm): model(x).pow(2).mean().backward()
            # store tensors of earlier windows count only where the store takes them again (`new`)
            host.intersection_update({_storage(x)})
            with StoreTraffic(host) as seen: model(x).pow(2).mean().backward()
        finally: uninstall_staged(model)
    return f.step, seen

def test_every_copy_goes_through_the_link_and_the_ledger_counts_it(monkeypatch):
    torch.manual_seed(0)
    model, x = Residual().double().train(), torch.randn(8, 3, 8, 8, dtype=torch.float64)
    step, seen = counted_window(monkeypatch, model, x)
    led = step.ledger
    assert len(step.cut) == 5 and led.copies > 20 and repr(step).endswith('nodes, 5 stages)')
    assert (led.h2d_bytes, led.d2h_bytes, led.copies) == (seen.h2d, seen.d2h, seen.copies)
    assert seen.math == [] and led.host_math_bytes == 0, seen.math  # no `+=`, no zero-fill on the host
    assert led.blocking_copies == 0 and led.syncs <= 2
    # the inputs are read for bn0's statistics, then by the stage bn0 opens: its forward and its recompute
    assert led.input_bytes == 3 * x.numel() * 8
    assert led.h2d_bytes + led.d2h_bytes <= 1.05 * led.floor(), (led.h2d_bytes + led.d2h_bytes, led.floor())

def test_on_a_cpu_nothing_crosses(monkeypatch):
    "Without an accelerator the store is the device's memory: the ledger counts nothing."
    torch.manual_seed(0)
    model, x = Residual().double().train(), torch.randn(8, 3, 8, 8, dtype=torch.float64)
    f = install_staged(model, 2)
    try: model(x).pow(2).mean().backward()
    finally: uninstall_staged(model)
    assert f.step.ledger.copies == 0 and f.step.ledger.h2d_bytes == 0

def _step(model, x, writes=None, reads=None):
    "(gradients, running statistics) after one staged window under `emulated_accelerator`, its copies issued so."
    m = copy.deepcopy(model)
    with emulated_accelerator():
        f = install_staged(m, 2)
        f.step.config.set(writes=writes, reads=reads)
        try: m(x).pow(2).mean().backward()
        finally: uninstall_staged(m)
    return [p.grad for p in m.parameters()] + [b for b in m.buffers()]

def test_writes_as_late_as_a_copy_stream_may_give_the_same_step(monkeypatch):
    """`DeferredCopies` runs each write (or read ahead) only when something waits for it: the step equals the one whose
    copies run at once, and both the big batch (float64); a read that skipped its wait reads the store's old contents."""
    torch.manual_seed(0)
    model, x = Residual().double().train(), torch.randn(8, 3, 8, 8, dtype=torch.float64)
    big = copy.deepcopy(model)
    big(x).pow(2).mean().backward()
    ref = [p.grad for p in big.parameters()] + list(big.buffers())
    at_once = _step(model, x)
    for a, r in zip(at_once, ref): assert torch.allclose(a.double(), r.double(), rtol=1e-9, atol=1e-12)
    for writes, reads in ((DeferredCopies(), None), (None, DeferredCopies()), (DeferredCopies(), DeferredCopies())):
        for a, b in zip(at_once, _step(model, x, writes, reads)): assert torch.equal(a, b)
    # the read-after-write guard removed (a prefetch is issued after a read of its chunk's stage waited, so copies
    # in order cover it; its own guard is for a schedule that prefetches a stage's first chunk)
    guarded = Link.read
    def no_wait(self, *a, **k):
        pending, self.pending = self.pending, {}
        try: return guarded(self, *a, **k)
        finally: self.pending = pending
    monkeypatch.setattr(Link, 'read', no_wait)
    broken = _step(model, x, DeferredCopies(), DeferredCopies())
    assert any(not torch.equal(a, b) for a, b in zip(at_once, broken))

class Inception(nn.Module):
    """Three branches from one value, each opening with a convolution and a BatchNorm (an in-place ReLU after each, as
    torchvision's GoogLeNet), and a BatchNorm on a value made two stages before it."""
    def __init__(self):
        super().__init__()
        self.stem, self.bn_stem = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.convs = nn.ModuleList(nn.Conv2d(16, 2, 1) for _ in range(3))
        self.bns = nn.ModuleList(nn.BatchNorm2d(2) for _ in range(3))
        self.conv_out, self.bn_out, self.head = nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 3)
    def forward(self, x):
        h = F.relu(self.bn_stem(self.stem(x)))
        h = torch.cat([F.relu(bn(conv(h)), inplace=True) for conv, bn in zip(self.convs, self.bns)], 1)
        return self.head(F.relu(self.bn_out(self.conv_out(h))).mean((2, 3)))

def test_sibling_branches_read_the_value_they_branch_from_once(monkeypatch):
    """In the traced order each branch's BatchNorm opens a stage and the stem's output is read by one stage per branch
    (over the floor); run soonest, the branches' convolutions share a stage and each value is read by one stage: the
    ledger at the floor, counted independently, and the step the big batch's (float64), in fewer bytes than as traced."""
    import fastai_accum.stage_cut as sc
    torch.manual_seed(0)
    model, x = Inception().double().train(), torch.randn(8, 3, 8, 8, dtype=torch.float64)
    big = copy.deepcopy(model)
    big(x).pow(2).mean().backward()
    m = copy.deepcopy(model)
    step, seen = counted_window(monkeypatch, m, x)
    led = step.ledger
    assert (led.h2d_bytes, led.d2h_bytes, led.copies) == (seen.h2d, seen.d2h, seen.copies) and seen.math == []
    assert led.h2d_bytes + led.d2h_bytes <= 1.05 * led.floor(), (led.h2d_bytes + led.d2h_bytes, led.floor())
    for a, b in zip(list(m.parameters()) + list(m.buffers()), list(big.parameters()) + list(big.buffers())):
        ga, gb = (a.grad, b.grad) if isinstance(a, nn.Parameter) else (a, b)
        assert torch.allclose(ga, gb, rtol=1e-9, atol=1e-12)
    monkeypatch.setattr(sc, '_barrier_order', lambda nodes, modules: nodes)  # as traced
    traced, _ = counted_window(monkeypatch, copy.deepcopy(model), x)
    t = traced.ledger
    assert t.h2d_bytes + t.d2h_bytes > 1.05 * t.floor() and t.h2d_bytes + t.d2h_bytes > led.h2d_bytes + led.d2h_bytes

@pytest.mark.parametrize('budget', [400_000, 10**9], ids=['recomputed', 'graphs_kept'])
def test_values_several_stages_read_stay_on_the_device_between_reads(monkeypatch, budget):
    """With room left by the budget, the features several stages read stay on the device from their first reading stage
    to their last (`ChunkSizer.device_part`, planned from the window before), and their gradients are summed there: the ledger at
    the floor, below the step without it, counted independently; two windows equal the big batch's two (float64), also
    with copies run as late as streams may."""
    from fastai_accum.staged_exact import StagedStep
    staged_config(monkeypatch, margin=1.)  # the mechanism, on a block too small for the default's room
    torch.manual_seed(0)
    model, x = Dense().double().train(), torch.randn(8, 3, 8, 8, dtype=torch.float64)
    big = copy.deepcopy(model)
    for _ in range(2): big(x).pow(2).mean().backward()
    ref = [p.grad for p in big.parameters()] + list(big.buffers())
    runs = {}
    for copies in ('at once', 'deferred'):
        m = copy.deepcopy(model)
        deferred = (DeferredCopies(), DeferredCopies()) if copies == 'deferred' else (None, None)
        step, seen = counted_window(monkeypatch, m, x, budget=budget, warm=1, writes=deferred[0], reads=deferred[1])
        led = step.ledger
        assert len(step.device) >= 2 and max(step.device.planned) > 0
        assert (led.h2d_bytes, led.d2h_bytes, led.copies) == (seen.h2d, seen.d2h, seen.copies) and seen.math == []
        assert led.h2d_bytes + led.d2h_bytes <= 1.05 * led.floor() and led.syncs <= 2
        runs[copies] = [p.grad for p in m.parameters()] + list(m.buffers())
        for a, r in zip(runs[copies], ref): assert torch.allclose(a, r, rtol=1e-9, atol=1e-12)
    for a, b in zip(*runs.values()): assert torch.equal(a, b)
    monkeypatch.setattr(ChunkSizer, '_device_room', lambda self, w, *a: [-1.] * len(w.cut))  # no device part
    step, _ = counted_window(monkeypatch, copy.deepcopy(model), x, budget=budget, warm=1)
    assert not step.device and step.ledger.h2d_bytes + step.ledger.d2h_bytes > led.h2d_bytes + led.d2h_bytes

def test_torchvision_densenet121_with_its_device_part_is_the_big_batch():
    """torchvision's densenet121 (every dense layer reads all features before it), float64, 32 px, a window of 8 in
    chunks of 2 under a budget that leaves the store's device part room (the default margin): two staged windows equal
    the big batch's two, with dozens of features held on the device between their reading stages, at the floor."""
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.densenet121(num_classes=5).double().train()
    x = torch.randn(8, 3, 32, 32, dtype=torch.float64)
    weights = lambda o: torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
    big, st = copy.deepcopy(model), copy.deepcopy(model)
    def two_windows(m):
        for _ in range(2):
            out = m(x)
            (out * weights(out)).sum().backward()
    two_windows(big)
    with emulated_accelerator():
        f = install_staged(st, 2, budget=6_000_000)
        try: two_windows(st)
        finally: uninstall_staged(st)
    step, led = f.step, f.step.ledger
    assert len(step.device) > 10 and step.device.most > 0
    assert any(last < step.kept_from for _, last in step.device.spans.values())  # held where the backward recomputes
    assert led.h2d_bytes + led.d2h_bytes <= 1.05 * led.floor() and led.blocking_copies == 0 and led.syncs <= 2
    for a, b in zip(list(st.parameters()) + list(st.buffers()), list(big.parameters()) + list(big.buffers())):
        ga, gb = (a.grad, b.grad) if isinstance(a, nn.Parameter) else (a, b)
        assert torch.allclose(ga.double(), gb.double(), rtol=1e-9, atol=1e-12)

def _trained_by(model, x, windows=2):
    "(gradients, running statistics) of the big batch's `windows` windows on `x`, summed as the staged windows sum them."
    big = copy.deepcopy(model)
    for _ in range(windows): big(x).pow(2).mean().backward()
    return [p.grad for p in big.parameters()] + list(big.buffers())

@pytest.mark.parametrize('budget', [None, 400_000], ids=['graphs_kept', 'recomputed'])
def test_stages_made_again_cross_fewer_bytes_and_give_the_big_batch(monkeypatch, budget):
    """With `recompute`, the second window makes stages again where their values are read rather than keeping them
    (`nbs/00f_remade`): fewer bytes cross the link each way than keeping every value, counted independently, no
    arithmetic on the host; two windows equal the big batch's two (float64), also with copies run as late as streams may."""
    torch.manual_seed(0)
    model, x = Residual().double().train(), torch.randn(8, 3, 8, 8, dtype=torch.float64)
    ref, kept = _trained_by(model, x), counted_window(monkeypatch, copy.deepcopy(model), x, budget=budget, warm=1)[0].ledger
    staged_config(monkeypatch, recompute=True)
    runs = []
    for writes, reads in ((None, None), (DeferredCopies(), DeferredCopies())):
        m = copy.deepcopy(model)
        step, seen = counted_window(monkeypatch, m, x, budget=budget, warm=1, writes=writes, reads=reads)
        led = step.ledger
        assert step.window.remade_stages and all(r < step.kept_from for r in step.window.remade_stages), step.window.remade_stages
        assert (led.h2d_bytes, led.d2h_bytes, led.copies) == (seen.h2d, seen.d2h, seen.copies) and seen.math == []
        assert led.d2h_bytes < kept.d2h_bytes and led.h2d_bytes < kept.h2d_bytes, (led, kept)
        runs.append([p.grad for p in m.parameters()] + list(m.buffers()))
        for a, r in zip(runs[-1], ref): assert torch.allclose(a, r, rtol=1e-9, atol=1e-12)
    for a, b in zip(*runs): assert torch.equal(a, b)

class DropFirst(Residual):
    "`Residual` with dropout in its first stage (the one made again without it)."
    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(F.dropout(self.bn0(x), 0.3, self.training))))
        h = F.relu(self.bn2(self.conv2(h)) + h)
        h = F.relu(self.bn3(self.conv3(h))) + h
        return self.head(h.mean((2, 3)))

def test_a_stage_drawing_random_numbers_keeps_its_values(monkeypatch):
    """Made again, a stage drawing random numbers would draw other masks: the window that finds it draws keeps its values
    (the step as without `recompute`, to the bit, over three windows), and later windows choose around it."""
    torch.manual_seed(0)
    model, x = DropFirst().double().train(), torch.randn(8, 3, 8, 8, dtype=torch.float64)
    runs = {}
    for recompute in (False, True):
        staged_config(monkeypatch, recompute=recompute)
        m = copy.deepcopy(model)
        torch.manual_seed(5)
        with pytest.warns(UserWarning): step, seen = counted_window(monkeypatch, m, x, warm=2)
        runs[recompute] = [p.grad for p in m.parameters()] + list(m.buffers())
    random_stage = next(s for s in range(len(step.cut)) if any(
        step.cut.nodes[i].name == 'dropout' for i in step.cut.stages[s]))
    assert step.window.remade_stages and random_stage not in step.window.remade_stages, (random_stage, step.window.remade_stages)
    assert len(step.sizer.not_remade) == 1
    for a, b in zip(*runs.values()): assert torch.equal(a, b)

def test_stages_made_again_under_bfloat16_autocast_give_the_stored_values_to_the_bit(monkeypatch):
    """Under bfloat16 autocast a stage made again runs the same ops in the same dtypes as its forward did: three windows
    give the gradients and statistics of the step keeping every value, to the bit, in fewer bytes written."""
    torch.manual_seed(0)
    model, x = Residual().train(), torch.randn(8, 3, 8, 8)
    runs, written = {}, {}
    for recompute in (False, True):
        steps = staged_config(monkeypatch, recompute=recompute)
        m = copy.deepcopy(model)
        with emulated_accelerator():
            f = install_staged(m, 2, autocast=lambda: torch.autocast('cpu', dtype=torch.bfloat16))
            try:
                for _ in range(3): m(x).float().pow(2).mean().backward()
            finally: uninstall_staged(m)
        assert bool(steps[-1].window.remade_stages) == recompute and steps[-1].window.autocast == torch.bfloat16
        runs[recompute], written[recompute] = [p.grad for p in m.parameters()] + list(m.buffers()), f.step.ledger.d2h_bytes
    assert written[True] < written[False]
    for a, b in zip(*runs.values()): assert torch.equal(a, b)
