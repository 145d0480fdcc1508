"""Run under `python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_memory_script.py OUTDIR`.

A fit's real memory under DDP (CPU, gloo, fastai's `distrib_ctx`, plain BatchNorm layers): a CNN whose activations
outweigh its parameters, micro-batches of 2 in windows of 4, a device budget 30% of the way from a staged step's need
to the whole window's, 3 epochs, SGD with momentum. Each rank saves its `LiveBytes` peak (every storage ops make, DDP's
buckets included), the budget, live bytes after each epoch, and its parameters and buffers (for the union reference).
"""
import os, sys, torch
from functools import partial
from torch.utils.data import TensorDataset
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, CrossEntropyLossFlat, Callback
import fastai.distributed
from fastai_accum.all import *
from fastai_accum.distributed import fix_distributed_dl
from fastai_accum.exact import staging_budget
from fastai_accum.meters import LiveBytes
from dist_helpers import image_data, activation_cnn

torch.set_num_threads(1)
outdir = sys.argv[1]
fix_distributed_dl()

class LiveAfterEpoch(Callback):
    "Live bytes of `meter` after each epoch, less the Recorder's history (a loss tensor per recorded batch: fastai's)."
    def __init__(self, meter): self.meter, self.after = meter, []
    def after_epoch(self):
        history = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.recorder.losses}
        self.after.append(self.meter.live - sum(history.values()))

x, y = image_data()
dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=2), DataLoader(TensorDataset(x[:4], y[:4]), bs=2))
torch.manual_seed(0)
learn = Learner(dls, activation_cnn().double(), loss_func=CrossEntropyLossFlat(), opt_func=partial(SGD, mom=0.9))
budget = staging_budget(learn.model.train(), (x[:2],), 8, opt_state=1., at=0.3)
ga = GradientAccumulation(n_step=4, device_memory=budget, preflight=False)
with learn.distrib_ctx(cpu=True, sync_bn=False):
    meter = LiveBytes(learn.model)
    live = LiveAfterEpoch(meter)
    with meter, learn.no_bar(), learn.no_logging(): learn.fit(3, lr=0.05, cbs=[ga, live])
torch.save(dict(peak=meter.peak, budget=budget, after=live.after, path=ga.path, chunk=ga.plan.chunk,
                params=[p.detach() for p in learn.model.parameters()], buffers=[b.detach() for b in learn.model.buffers()]),
           f"{outdir}/rank{os.environ['RANK']}.pt")
import torch.distributed as dist
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)  # as dist_exact_script.py: a thread gloo leaves can abort shutdown
