"Staged exact on models nobody here wrote: one window step equals the big batch's (float64; output, gradients, running statistics)."
import copy
import pytest, torch
from fastai_accum.staged_exact import install_staged

def flat(ts): return torch.cat([t.flatten() for t in ts])
def rel(a, b): return ((a - b).abs().max() / b.abs().max()).item()

def timm_model(name): import timm; return lambda: timm.create_model(name, num_classes=5)
def tv_resnet50(): import torchvision; return torchvision.models.resnet50(num_classes=5)
def tv_segmentation(name, aux):
    import torchvision
    return lambda: getattr(torchvision.models.segmentation, name)(num_classes=3, weights=None, weights_backbone=None, aux_loss=aux)
def tv_googlenet(): import torchvision; return torchvision.models.googlenet(num_classes=5, aux_logits=True, init_weights=True)

def outputs(out) -> list:
    "The output's tensors: a tensor, or the values of a dict or (named) tuple (torchvision's segmentation models, GoogLeNet's aux logits)."
    return [t for t in (out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else [out]) if t is not None]

@pytest.mark.parametrize('make', [timm_model('resnet18'), timm_model('efficientnet_b0'), timm_model('mobilenetv3_small_100'),
                                  timm_model('densenet121'), tv_resnet50, tv_segmentation('fcn_resnet50', True),
                                  tv_segmentation('fcn_resnet50', False), tv_segmentation('deeplabv3_resnet50', True),
                                  tv_segmentation('deeplabv3_resnet50', False), tv_googlenet],
                         ids=['timm_resnet18', 'timm_efficientnet_b0', 'timm_mobilenetv3_small_100', 'timm_densenet121', 'tv_resnet50',
                              'tv_fcn_resnet50_aux', 'tv_fcn_resnet50', 'tv_deeplabv3_resnet50_aux', 'tv_deeplabv3_resnet50', 'tv_googlenet_aux'])
def test_staged_step_is_the_big_batch(make):
    """Dropout held fixed (eval): a chunked stage draws its masks chunk by chunk, equal in distribution to the big batch's
    but not in value (the library warns; whether they happen to match depends on torch's CPU generator: from 2.7 they
    do, before they do not). The last stage's masks are the big batch's on every version: it reruns whole
    (tests/test_exact_or_says_so.py::test_dropout_after_the_last_batchnorm_draws_the_big_batch_masks)."""
    torch.manual_seed(0)
    big = make().double().train()
    for m in big.modules():
        if isinstance(m, torch.nn.Dropout): m.eval()
    st = copy.deepcopy(big); install_staged(st, chunk=3)
    x = torch.randn(8, 3, 32, 32, dtype=torch.float64)  # a window of 8 in ragged chunks of 3
    outs = []
    for m in (big, st):
        torch.manual_seed(1); out = outputs(m(x)); outs.append(torch.cat([o.detach().flatten() for o in out]))
        sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in out).backward()
    assert rel(*outs[::-1]) < 1e-12
    assert rel(*[flat(p.grad for p in m.parameters() if p.grad is not None) for m in (st, big)]) < 1e-10
    assert rel(*[flat(b for b in m.buffers() if b.is_floating_point()) for m in (st, big)]) < 1e-12
    assert [int(m.num_batches_tracked) for m in st.modules() if hasattr(m, 'num_batches_tracked')] == \
           [int(m.num_batches_tracked) for m in big.modules() if hasattr(m, 'num_batches_tracked')]

def test_staged_step_holds_one_chunk_whatever_the_window():
    "What autograd holds for the backward of a staged step (the device's share) is one chunk of one stage: it does not grow with the window, the window's input included."
    from fastai_accum.meters import SavedTensorMeter
    def peak(W):
        torch.manual_seed(0)
        m = timm_model('resnet18')().train(); f = install_staged(m, chunk=2)
        x = torch.randn(W, 3, 32, 32)
        with SavedTensorMeter(m) as meter: m(x).pow(2).mean().backward()
        assert all(b - a <= 2 for a, b in f.step.spans[0])  # the stage that reads the window's input runs micro-batch by micro-batch
        return meter.peak
    small, large = peak(4), peak(32)
    assert large <= small * 1.05 and large < 32 * 3 * 32 * 32 * 4  # less than the window's input alone

def test_a_heavy_last_stage_holds_one_chunk():
    """A last stage at full resolution (a segmentation head after the last BatchNorm): the chunk whose graph the forward
    kept is back-propagated first, so its graph is not held while the others are recomputed. What autograd holds is
    at most what one plain step on a chunk holds (it held two chunks of the head: a U-Net at 1.39x a micro-batch
    step)."""
    from torch import nn
    from fastai_accum.meters import SavedTensorMeter
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 32, 3, padding=1),
                      nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 1, 1)).train()
    x = torch.randn(8, 3, 32, 32)
    with SavedTensorMeter(m) as plain: m(x[:2]).pow(2).mean().backward()
    f = install_staged(m, chunk=2)
    f.step.config.set(grow=False)  # every stage in chunks of 2
    with SavedTensorMeter(m) as staged: m(x).pow(2).mean().backward()
    assert [b - a for a, b in f.step.spans[-1]] == [2, 2, 2, 2]
    assert staged.peak <= plain.peak, (staged.peak, plain.peak)

def test_half_precision_staged_step_is_as_accurate_as_plain_half_precision():
    "fp16 weights, a GradScaler-sized loss scale: the window sums and the projection run in float32, as BatchNorm's own backward does, so the staged step's error against float32 is plain fp16's (summed in fp16: 1.65x it)."
    from torch import nn
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                 nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    ref = make().train(); big = copy.deepcopy(ref).half(); st = copy.deepcopy(big); install_staged(st, chunk=4)
    x = torch.randn(64, 3, 32, 32) * 3 + 2
    for m, xx in ((ref, x), (big, x.half()), (st, x.half())): (m(xx).float().pow(2).mean() * 65536).backward()
    g_ref, g_big, g_st = (torch.cat([p.grad.float().flatten() for p in m.parameters()]) for m in (ref, big, st))
    err = lambda g: ((g - g_ref).norm() / g_ref.norm()).item()
    assert torch.isfinite(g_st).all()
    if torch.isfinite(g_big).all(): assert err(g_st) <= 1.25 * err(g_big)  # torch < 2.6: plain fp16 BatchNorm on the CPU overflows to NaN
    else: assert err(g_st) < 1e-2

def test_rounding_amplified_by_a_batchnorm_is_not_taken_for_mixing():
    "timm efficientnet_b0 at 32 px, float64: rounding amplified layer after layer (BatchNorm over 2 values per channel) was taken for mixing; each op is now checked on its own inputs."
    import timm
    from fastai_accum.probes import samples_mixed
    torch.manual_seed(0)
    m = timm.create_model('efficientnet_b0', num_classes=10).double().train()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)).double()
    assert samples_mixed(m, (x,)) is None

@pytest.mark.parametrize('room', [3, None])
def test_chunks_sized_per_stage_give_the_uniform_chunks_step(room):
    """A device budget sizes each stage's chunks from its bytes per sample, measured on its first chunk (late stages,
    smaller per sample, run in larger chunks), and the last stages whose graphs fit it together keep them from the
    forward (not recomputed; `room=None`: every stage): the step — output, every gradient, running statistics,
    counters — is the one uniform chunks give, and the big batch's (float64)."""
    from torch import nn
    def block(i, o, s): return [nn.Conv2d(i, o, 3, stride=s, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]
    torch.manual_seed(0)  # a CNN whose parameters weigh little beside its activations: chunk sizes vary stage by stage
    big = nn.Sequential(*block(3, 8, 1), *block(8, 8, 1), *block(8, 16, 2), *block(16, 16, 1), *block(16, 32, 2),
                        *block(32, 32, 1), *block(32, 64, 2), *block(64, 64, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(64, 5)).double().train()
    uniform, sized, probe = (copy.deepcopy(big) for _ in range(3))
    x = torch.randn(12, 3, 32, 32, dtype=torch.float64)
    f = install_staged(probe, chunk=2, budget=1)  # every stage in chunks of 2, each stage's cost measured
    probe(x).sum().backward()
    costs = f.step.sizer.costs
    # the costliest stage: 3 samples per chunk or more, cheaper ones more; or room for every stage's graph. Beside each
    # chunk: its stage's parameters' gradients (at most the largest stage's) and, on a CPU, the store (at most its peak)
    grads = max(sum(p.numel() * p.element_size() for p in ps) for ps in f.step.cut.stage_params)
    store = int(max(f.step.sizer.store_costs.values()) * len(x)) + 1
    budget = (int(3 * max(costs.values())) if room else int(sum(costs.values()) * len(x)) + 1) + grads + store
    fu, fs = install_staged(uniform, chunk=2), install_staged(sized, chunk=2, budget=budget)
    fu.step.config.set(grow=False)
    fs.step.sizer.preset(costs, f.step.sizer.store_costs)  # measured in a window before
    res = []
    for m in (big, uniform, sized):
        torch.manual_seed(1); out = m(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        res.append((out.detach(), flat(p.grad for p in m.parameters()), flat(b for b in m.buffers() if b.is_floating_point()),
                    [int(b) for n, b in m.named_buffers() if n.endswith('num_batches_tracked')]))
    widths = [max(b - a for a, b in sp) for sp in fs.step.spans]
    assert all(w == 2 for sp in fu.step.spans for w in {b - a for a, b in sp[:-1]})
    if room:
        assert min(widths) >= 3 and max(widths) == 12 and len(set(widths)) >= 3, widths  # sized stage by stage
        assert 0 < fs.step.kept_from < len(fs.step.cut.stages) - 1  # some late stages kept their graphs, not all
    else: assert fs.step.kept_from == 0 and set(widths) == {12}
    for s, w in enumerate(widths):  # within the budget (the chunk, its parameters' gradients, the store), or the smallest
        reserve = sum(p.numel() * p.element_size() for p in fs.step.cut.stage_params[s])
        assert w == 2 or w * costs[fs.step.sizer.key(fs.step.window, s)] + reserve <= budget
    (ob, gb, bb, nb), (ou, gu, bu, nu), (os_, gs, bs, ns) = res
    assert rel(os_, ou) < 1e-12 and rel(gs, gu) < 1e-12 and rel(bs, bu) < 1e-12 and ns == nu == nb
    assert rel(os_, ob) < 1e-12 and rel(gs, gb) < 1e-10 and rel(bs, bb) < 1e-12

def test_the_step_holds_its_budget_and_draws_the_head_masks_whole():
    """Within a device budget a staged step's peak (the storages ops make, the store not counted: `LiveBytes`) is at
    most the budget and the parameters' gradients: with in-place activations (autograd saves a copy of their input,
    counted in each stage's cost), one chunk alive at a time, and a head whose dropout draws the big batch's masks with
    only the ops from the dropout on run on the whole window (the last stage is cut there). The step is the big
    batch's (float64)."""
    from torch import nn
    from fastai_accum.lab.bench_speed import _device_peak, _train
    def block(i, o): return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU6(inplace=True)]
    torch.manual_seed(0)
    big = nn.Sequential(*block(3, 8), *block(8, 16), *block(16, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Dropout(0.5), nn.Linear(16, 5)).double().train()
    st, probe = copy.deepcopy(big), copy.deepcopy(big)
    x = torch.randn(32, 3, 24, 24, dtype=torch.float64)
    f = install_staged(probe, chunk=2, budget=1)  # every stage in chunks of 2, each stage's cost measured
    _train(probe, x)
    budget = int(4 * max(f.step.sizer.costs.values()))
    f = install_staged(st, chunk=2, budget=budget)
    f.step.sizer.preset(probe.forward.step.sizer.costs)
    grads = sum(p.numel() * p.element_size() for p in st.parameters())
    torch.manual_seed(1)
    peak = _device_peak(lambda: _train(st, x), torch.device('cpu'), f.step)
    torch.manual_seed(1); _train(big, x)
    widths = [[b - a for a, b in sp] for sp in f.step.spans]
    assert len(widths[-2]) > 1 and widths[-1] == [32], widths  # the last stage cut before the dropout: that part whole
    assert peak <= budget + grads, (peak, budget, grads)
    assert rel(flat(p.grad for p in st.parameters()), flat(p.grad for p in big.parameters())) < 1e-10

def test_window_sums_without_the_layers_own_gradients():
    """The window sums come from a BatchNorm's own weight and bias gradients where it has them; without (affine=False,
    frozen parameters, a weight another layer also reads) from a pass over the chunks: the big batch's step either way
    (float64)."""
    from torch import nn
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, affine=False)
            self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.c3, self.b3 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.head = nn.Linear(8, 5)
            self.b2.requires_grad_(False)
        def forward(self, x):
            x = torch.relu(self.b1(self.c1(x)))
            x = torch.relu(self.b2(self.c2(x)))
            x = torch.relu(self.b3(self.c3(x))) * self.b3.weight.view(1, -1, 1, 1)  # b3's weight read outside b3
            return self.head(x.mean((2, 3)))
    torch.manual_seed(0)
    big = Tied().double().train(); st = copy.deepcopy(big)
    with torch.no_grad(): big.b2.weight.uniform_(0.5, 2); st.b2.weight.copy_(big.b2.weight)
    f = install_staged(st, chunk=3, budget=10 ** 9)
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    for m in (big, st):
        out = m(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    step = f.step
    trained = [p for p in st.parameters() if p.requires_grad]
    assert [step._affine_sums(s, step.cut.nodes[step.cut.stages[s][0]], {id(p): i for i, p in enumerate(trained)},
                              [None] * len(trained)) for s in range(1, len(step.cut))] == [None] * 3
    grads = [flat(p.grad for p in m.parameters() if p.grad is not None) for m in (st, big)]
    assert rel(*grads) < 1e-12
    assert rel(*[flat(b for b in m.buffers() if b.is_floating_point()) for m in (st, big)]) < 1e-12

def test_windows_reuse_the_store_and_leave_the_output_alone():
    """The store's host tensors a window no longer reads are reused by the next window of its size (no new allocation:
    its page faults cost about 4x a copy), not the output the model returned; a window of another size starts afresh.
    Each window's step is the big batch's (float64)."""
    import torchvision
    torch.manual_seed(0)
    big = torchvision.models.resnet18(num_classes=5).double().train()
    st = copy.deepcopy(big)
    f = install_staged(st, chunk=3)
    # every stage in chunks of 3 (the output too is a tensor of the store); as on an accelerator, the store in host memory,
    # apart from the device's (a CPU's is not pooled)
    f.step.config.set(grow=False, apart=True)
    for i, n in enumerate((8, 8, 5)):
        x = torch.randn(n, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        pooled = {id(t) for ts in f.step.pool.free.values() for t in ts}
        outs = []
        for m in (big, st):
            m.zero_grad()
            out = m(x)
            (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
            outs.append(out.detach())
        kept = {id(t) for ts in f.step.pool.free.values() for t in ts}
        assert rel(outs[1], outs[0]) < 1e-12 and rel(flat(p.grad for p in st.parameters()),
                                                     flat(p.grad for p in big.parameters())) < 1e-10
        assert all(b.allclose(a) for a, b in zip(big.buffers(), st.buffers()) if a.is_floating_point())
        assert kept and not any(t.data_ptr() == outs[1].data_ptr() for ts in f.step.pool.free.values() for t in ts)
        if i == 1: assert kept == pooled, 'the second window of 8 reuses exactly what the first gave back'
        if i == 2: assert {t.shape[0] for ts in f.step.pool.free.values() for t in ts} == {5}  # another size: afresh
        if i == 0: first, first_val = outs[1], outs[1].clone()
    assert torch.equal(first, first_val)  # the first window's output was not overwritten by the next windows

def test_the_step_runs_exactly_the_schedules_chunks_in_its_order(monkeypatch):
    """One function orders chunks (`stage_chunks`, held by the window's `Schedule`): in two windows of a CNN under a
    budget — the first measuring each stage on its first chunk, the second sized from it, the last stages keeping their
    graphs — the chunks the forward read its inputs for are the schedule's forward, in order, and those the backward
    took a graph for or ran again are the schedule's backward, in order."""
    from torch import nn
    from fastai_accum.window_store import WindowStore
    from fastai_accum.staged_exact import Window
    def block(i, o, s): return [nn.Conv2d(i, o, 3, stride=s, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]
    torch.manual_seed(0)
    net = nn.Sequential(*block(3, 8, 1), *block(8, 16, 2), *block(16, 32, 2), *block(32, 32, 1), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(32, 5)).double().train()
    probe, x = copy.deepcopy(net), torch.randn(12, 3, 16, 16, dtype=torch.float64)
    fp = install_staged(probe, chunk=2, budget=1)
    probe(x).sum().backward()
    costs, keys = fp.step.sizer.costs, [fp.step.sizer.key(fp.step.window, s) for s in range(len(fp.step.cut))]
    grads = max(sum(p.numel() * p.element_size() for p in ps) for ps in fp.step.cut.stage_params)
    store = int(max(fp.step.sizer.store_costs.values()) * len(x)) + 1
    # the costliest stage in chunks of 3 or more; room for the graphs of the last two stages, on a CPU beside the store
    f = install_staged(net, chunk=2, budget=int(3 * max(costs.values()) + (costs[keys[-1]] + costs[keys[-2]]) * len(x)) + grads + store)
    seen, inputs, taken = [], WindowStore.stage_inputs, Window.take_graph
    def read(self, s, a, b, dev, grad=False, have=None):
        seen.append(('read', s, a, b))
        return inputs(self, s, a, b, dev, grad, have)
    def graph(self, c):
        seen.append(('graph', c.stage, c.a, c.b))
        return taken(self, c)
    monkeypatch.setattr(WindowStore, 'stage_inputs', read)
    monkeypatch.setattr(Window, 'take_graph', graph)
    for window in range(2):
        seen.clear()
        net(x).sum().backward()
        sched = f.step.schedule
        forward = [(c.stage, c.a, c.b) for s in sched.stage_order() for c in sched.stages[s]]
        backward = [(c.stage, c.a, c.b) for s in sched.stage_order(backward=True) for c in sched.backward(s)]
        assert [k[1:] for k in seen[:len(forward)]] == forward and all(k[0] == 'read' for k in seen[:len(forward)])
        assert [k[1:] for k in seen[len(forward):]] == backward, (sched, seen)
        assert any(c.measure for st in sched.stages for c in st) == (window == 0)
    assert 0 < sched.kept_from < len(sched) and len({b - a for a, b in sum(f.step.spans, [])}) > 1, sched
    assert f'stage {len(sched) - 1}: forward 0:12g' in repr(sched)  # the last stage whole, its graph kept
