"""Run under `python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_exact_script.py MODE OUTDIR`.

Exact modes under DDP (CPU, gloo, fastai's `distrib_ctx`, plain BatchNorm layers): micro-batches of 2 in windows of 4.
MODE 'exact' (`policy='exact'`: the whole window), 'auto' (the default; the window fits), 'staged' (`policy='staged'`
with a device budget of one chunk of 2 samples) must all train as one process on the union of both ranks' windows;
MODE 'staged_aten' is 'staged' on the same net behind a size branch that torch.fx cannot trace (the second tracer's
graph trains it); MODE 'auto_disagree' gives rank 1 too little memory for either exact mode: both ranks must then train with window BN.
Each rank saves its parameters, BatchNorm buffers, the gradient all-reduces (DDP comm hook) and the collectives each
training window ran (all-gathers and all-reduces, gradient buckets included).
"""
import os, sys, torch
import torch.distributed as dist
from torch.utils.data import TensorDataset
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, MSELossFlat, Callback
import fastai.distributed
from fastai_accum.all import *
from fastai_accum.distributed import fix_distributed_dl
from fastai_accum.exact import measure_footprint
from dist_helpers import data, bn_net, CountAllReduces

torch.set_num_threads(1)
mode, outdir = sys.argv[1], sys.argv[2]
fix_distributed_dl()

class CountCollectives(Callback):
    "Collectives (all_gather, all_reduce) each training window runs, from `before_batch` to `after_step`."
    def before_fit(self):
        self.per_window, self.n = [], None
        for name in ('all_gather', 'all_reduce'):
            f = getattr(dist, name)
            def counted(*a, _f=f, **k):
                if self.n is not None: self.n += 1
                return _f(*a, **k)
            setattr(dist, name, counted)
    def before_batch(self):
        if self.training: self.n = 0
    def after_step(self): self.per_window.append(self.n); self.n = None

x, y = data(image=True)
dls = DataLoaders(DataLoader(TensorDataset(x.double(), y.double()), bs=2), DataLoader(TensorDataset(x[:8].double(), y[:8].double()), bs=2))
class SizeGate(torch.nn.Module):
    "`net` behind a branch on a size: torch.fx cannot trace it, the aten-level trace takes it as it falls."
    def __init__(self, net): super().__init__(); self.net = net
    def forward(self, x):
        y = self.net(x)
        return y if y.shape[-1] > 0 else -y

torch.manual_seed(0)
learn = Learner(dls, (SizeGate(bn_net()) if mode == 'staged_aten' else bn_net()).double(), loss_func=MSELossFlat(), opt_func=SGD)
rank = int(os.environ['RANK'])
if mode in ('staged', 'staged_aten'):  # a device budget that holds one chunk of 2 samples, not the window of 4
    from fastai_accum.exact import staging_budget
    budget = staging_budget(learn.model.train(), (x[:2].double(),), 4, opt_state=1.)  # fastai's SGD: momentum
    ga = GradientAccumulation(n_step=4, policy="staged", preflight=False, device_memory=int(1.1 * budget))
elif mode == 'auto_disagree': ga = GradientAccumulation(n_step=4, preflight=False, host_memory=1000 if rank == 1 else None)
else: ga = GradientAccumulation(n_step=4, policy=mode, preflight=False)
counter, collectives = CountAllReduces(), CountCollectives()
with learn.distrib_ctx(cpu=True, sync_bn=False):
    with learn.no_bar(), learn.no_logging(): learn.fit(2, lr=0.05, cbs=[counter, collectives, ga])
torch.save(dict(allreduces=counter.calls, params=[p.detach() for p in learn.model.parameters()],
                buffers=[b.detach() for b in learn.model.buffers()], exact=ga.exact, path=ga.path,
                chunk=ga.plan.chunk if ga.plan is not None else None, collectives=collectives.per_window,
                traced=ga.plan.traced if ga.plan is not None else None),
           f"{outdir}/rank{os.environ['RANK']}.pt")
dist.barrier()
dist.destroy_process_group()
# Leave without interpreter shutdown: under load, a thread left by gloo/fastai can abort it (SIGABRT, "terminate called
# without an active exception") after everything above has finished and been saved.
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
