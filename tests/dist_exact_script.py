"""Run under `python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_exact_script.py MODE OUTDIR`.

The 'exact' policy under DDP (CPU, gloo, fastai's `distrib_ctx`): MODE 'exact' trains micro-batches of 2 in windows of 4
with `GradientAccumulation(policy='exact')`; MODE 'reference' is plain DDP at batch 8 (each rank's window as its batch);
MODE 'auto_disagree' gives rank 1 too little memory for 'exact': both ranks must then train with window BatchNorm.
"""
import os, sys, torch
from torch.utils.data import TensorDataset
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, MSELossFlat, Callback
import fastai.distributed
from fastai_accum.all import *
from fastai_accum.distributed import fix_distributed_dl
from dist_helpers import data, bn_net, CountAllReduces

torch.set_num_threads(1)
mode, outdir = sys.argv[1], sys.argv[2]
fix_distributed_dl()

x, y = data(image=True)
bs = 8 if mode == 'reference' else 2
dls = DataLoaders(DataLoader(TensorDataset(x.double(), y.double()), bs=bs), DataLoader(TensorDataset(x[:8].double(), y[:8].double()), bs=bs))
torch.manual_seed(0)
learn = Learner(dls, bn_net().double(), loss_func=MSELossFlat(), opt_func=SGD)
counter = CountAllReduces()
rank = int(os.environ['RANK'])
if mode == 'exact': ga = GradientAccumulation(n_step=4, policy='exact', preflight=False)
elif mode == 'auto_disagree': ga = GradientAccumulation(n_step=4, preflight=False, host_memory=1000 if rank == 1 else None)
else: ga = None  # 'reference': plain DDP
cbs = [counter] + ([ga] if ga is not None else [])
with learn.distrib_ctx(cpu=True, sync_bn=False):
    with learn.no_bar(), learn.no_logging(): learn.fit(2, lr=0.05, cbs=cbs)
torch.save(dict(allreduces=counter.calls, params=[p.detach() for p in learn.model.parameters()], exact=getattr(ga, 'exact', None)),
           f"{outdir}/rank{os.environ['RANK']}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
