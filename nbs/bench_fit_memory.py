"""A whole fit's real memory against its device budget: every tensor storage alive at once (`LiveBytes`), the check
before the first staged window, the store, the chunks and the optimizer included; live bytes after each epoch.

    python nbs/bench_fit_memory.py resnet18 96 16 0.3            # torchvision resnet18 (or a timm name), px, n_step, f
    python nbs/bench_fit_memory.py resnet26d 32 8 0.5
    python nbs/bench_fit_memory.py vision_resnet18 64 8 0.3      # fastai vision_learner(resnet18), Adam: 3 fits, then
                                                                 # fine_tune(2, freeze_epochs=1)
    python nbs/bench_fit_memory.py unet_resnet18 64 8 0.3        # fastai unet_learner(resnet18): the same fits
    python nbs/bench_fit_memory.py regnetx_002 64 8 0.3 fault     # the loop raises mid-window in the first epoch
    python nbs/bench_fit_memory.py resnet26d 64 8 0.3 bf16        # float32 under bf16 autocast
    python nbs/bench_fit_memory.py resnet18 64 8 0.05 emulated    # the plain loop as on a GPU (`emulated_accelerator`): the
                                                                 # store, the loader's batches, the joined window and
                                                                 # the check's copy in host memory, not counted

float64 on the CPU (the Learner: float32), micro-batch 2, 3 epochs of 4 windows (the plain loop, SGD momentum) or a Learner's fits; the budget
lies a fraction f of the way from a staged step's need (as the plan counts it) to the whole window's (`staging_budget`).
Prints what the plan measured (the store per sample against the saved activations, the largest stage's new
gradients), the path, peak / budget and the live bytes after each epoch or fit.
"""
import contextlib, sys, time, warnings
import torch, torchvision
import torch.nn.functional as F
from fastai_accum.core import Accumulation
from fastai_accum.exact import plan_exact, measure_staged, staging_budget
from fastai_accum.meters import LiveBytes, fmt_bytes
from fastai_accum.staged import staged_graph

def mib(n): return f'{n / 2**20:.1f}'

@contextlib.contextmanager
def on_accelerator(meter):
    "Inside `emulated_accelerator`, what a GPU keeps in host memory made as host memory in `meter`: the staged store, the window's joined inputs, the check's copy."
    import fastai_accum.core as core, fastai_accum.staged_check as check
    from fastai_accum.helpers import emulated_accelerator
    from fastai_accum.lab.bench_speed import _on_host_store
    from fastai_accum.staged_exact import StagedStep
    made, joined, copied = StagedStep.__init__, core.cat_batches, check._checked_copy
    def init(self, *a, **k):
        made(self, *a, **k)
        self.on_host = _on_host_store(meter)
    def host(f):
        def g(*a, **k):
            with meter.as_host(): return f(*a, **k)
        return g
    StagedStep.__init__, core.cat_batches, check._checked_copy = init, host(joined), host(copied)
    try:
        with emulated_accelerator(): yield
    finally: StagedStep.__init__, core.cat_batches, check._checked_copy = made, joined, copied

def plain_fit(model, n_step, size, budget, meter, autocast=None, fault=False, host=False):
    "The README's plain loop, SGD momentum: 3 epochs; live bytes after each. `fault`: the loop raises mid-window once."
    dtype = next(model.parameters()).dtype
    xs = torch.randn(n_step * 2 * 4, 3, size, size, dtype=dtype)
    ys = torch.randint(0, 10, (len(xs),))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=2)
    if host: loader = list(loader)  # made before the meter counts: host memory, as a GPU's loader keeps its batches
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    acc = Accumulation(model, n_step=n_step, optimizer=opt, device_memory=budget, autocast=autocast)
    after, ctx = [], autocast or contextlib.nullcontext
    with meter:
        for epoch in range(3):
            try:
                for i, (xb, yb) in enumerate(acc.batches(loader)):
                    if fault and epoch == 0 and i == n_step + n_step // 2: raise RuntimeError('a corrupt sample')
                    with ctx(): loss = F.cross_entropy(model(xb), yb)
                    if acc.backward(loss): opt.step(); opt.zero_grad()
            except RuntimeError as e:
                if 'corrupt' not in str(e): raise
            after.append(meter.live)
    return acc.path, after

def learner_fits(learn, n_step, budget, meter):
    "A fastai Learner with `GradientAccumulation`: 3 fits, then fine_tune(2, freeze_epochs=1); live bytes after each."
    from fastai_accum.callback import GradientAccumulation
    learn.add_cb(GradientAccumulation(n_step=n_step, device_memory=budget))
    after = []
    with meter, learn.no_bar(), learn.no_logging():
        for _ in range(3):
            learn.fit(1, 1e-3)
            after.append(meter.live)
        learn.fine_tune(2, 1e-3, freeze_epochs=1)
        after.append(meter.live)
    return learn.gradient_accumulation.path, after

def main(name='resnet18', size='96', n_step='16', frac='0.3', *how):
    "`how`: 'bf16' (a float32 model under bf16 autocast), 'fault' (the plain loop raises in the second window once), 'emulated' (as on a GPU)."
    size, n_step, frac = int(size), int(n_step), float(frac)
    autocast = (lambda: torch.autocast('cpu', dtype=torch.bfloat16)) if 'bf16' in how else None
    warnings.simplefilter('ignore')
    torch.manual_seed(0)
    learn = None
    if name == 'vision_resnet18':
        from fastai.vision.all import vision_learner, resnet18, CrossEntropyLossFlat
        from fastai_accum.lab.experiments import synthetic_dls
        learn = vision_learner(synthetic_dls(2, 64, device='cpu', size=size), resnet18, pretrained=False, n_out=10,
                               loss_func=CrossEntropyLossFlat())
        model, opt_state = learn.model, 2.  # float32 as the DataLoaders give it; Adam
    elif name == 'unet_resnet18':
        from torch.utils.data import TensorDataset
        from fastai.vision.all import unet_learner, resnet18, CrossEntropyLossFlat, DataLoaders, DataLoader
        x = torch.randn(64, 3, size, size)
        ds = lambda n: TensorDataset(x[:n], x[:n].argmax(1))  # each pixel's class: its brightest channel
        learn = unet_learner(DataLoaders(DataLoader(ds(64), bs=2), DataLoader(ds(4), bs=2)), resnet18,
                             pretrained=False, n_out=3, loss_func=CrossEntropyLossFlat(axis=1))
        model, opt_state = learn.model, 2.  # Adam
    elif name == 'resnet18': model, opt_state = torchvision.models.resnet18(num_classes=10), 1.
    else:
        import timm
        model, opt_state = timm.create_model(name, num_classes=10), 1.
    dtype = torch.float32 if learn is not None or autocast is not None else torch.float64
    model = model.to(dtype).train()
    micro = (torch.randn(2, 3, size, size, dtype=dtype),)
    meter = LiveBytes(model)
    where = on_accelerator(meter) if 'emulated' in how else contextlib.nullcontext()
    with where: return _fit(name, size, n_step, frac, how, autocast, learn, model, opt_state, micro, meter)

def _fit(name, size, n_step, frac, how, autocast, learn, model, opt_state, micro, meter):
    "`main`'s plan, budget and fit (inside `on_accelerator` where emulated)."
    t = time.perf_counter()
    p = plan_exact(model, micro, n_step * 2, opt_state=opt_state, autocast=autocast)
    p.chunk = 2
    measure_staged(p, model, staged_graph(model, micro), micro, autocast)
    budget = staging_budget(model, micro, n_step * 2, opt_state=opt_state, autocast=autocast, at=frac)
    print(f'{name} {size} px, {n_step} x 2: staged need {mib(p.staged_device_needed)} MiB, whole '
          f'{mib(p.device_needed)} MiB, budget {mib(budget)} MiB; store {fmt_bytes(p.store)}/sample = '
          f'{p.store / p.footprint.saved:.2f} x the saved activations, largest stage\'s gradients {fmt_bytes(p.stage_grads)}')
    path, after = (learner_fits(learn, n_step, budget, meter) if learn is not None
                   else plain_fit(model, n_step, size, budget, meter, autocast, 'fault' in how, 'emulated' in how))
    print(f'{" ".join(how + ("",))}path {path!r}: peak / budget {meter.peak / budget:.3f} ({mib(meter.peak)} MiB), live after each '
          f'{"fit" if learn is not None else "epoch"} {", ".join(mib(a) for a in after)} MiB, '
          f'{time.perf_counter() - t:.1f} s')

if __name__ == '__main__': main(*sys.argv[1:])
