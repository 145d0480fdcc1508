"""Run under `python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_exact_script.py MODE OUTDIR`.

The 'exact' policy under DDP (CPU, gloo, fastai's `distrib_ctx`): MODE 'exact' trains micro-batches of 2 in windows of 4
with `GradientAccumulation(policy='exact')`; MODE 'reference' is plain DDP at batch 8 (each rank's window as its batch).
"""
import os, sys, torch
from torch.utils.data import TensorDataset
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, MSELossFlat, Callback
import fastai.distributed
from fastai_accum.all import *
from fastai_accum.distributed import fix_distributed_dl
from dist_helpers import data, bn_net

torch.set_num_threads(1)
mode, outdir = sys.argv[1], sys.argv[2]
fix_distributed_dl()

class CountGradAllReduces(Callback):
    "A DDP comm hook (registered after DistributedTrainer wrapped the model) counting gradient all-reduces."
    order = 13
    def before_fit(self):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        self.count = 0
        def hook(state, bucket):
            self.count += 1
            return allreduce_hook(None, bucket)
        self.learn.model.register_comm_hook(None, hook)

x, y = data(image=True)
bs = 2 if mode == 'exact' else 8
dls = DataLoaders(DataLoader(TensorDataset(x.double(), y.double()), bs=bs), DataLoader(TensorDataset(x[:8].double(), y[:8].double()), bs=bs))
torch.manual_seed(0)
learn = Learner(dls, bn_net().double(), loss_func=MSELossFlat(), opt_func=SGD)
counter = CountGradAllReduces()
cbs = [counter] + ([GradientAccumulation(n_step=4, policy='exact', preflight=False)] if mode == 'exact' else [])
with learn.distrib_ctx(cpu=True, sync_bn=False):
    with learn.no_bar(), learn.no_logging(): learn.fit(2, lr=0.05, cbs=cbs)
torch.save(dict(allreduces=counter.count, params=[p.detach() for p in learn.model.parameters()]),
           f"{outdir}/rank{os.environ['RANK']}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
