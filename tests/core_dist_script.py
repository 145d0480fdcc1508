"""`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/core_dist_script.py MODE OUTDIR`: a plain
DDP loop driven by `Accumulation` on gloo; each rank saves what tests/test_core.py checks to OUTDIR/rankR.pt."""
import os, sys, torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from fastai_accum.core import Accumulation
from fastai_accum.batchnorm import bn_layers

torch.set_num_threads(1)
mode, outdir = sys.argv[1], sys.argv[2]
dist.init_process_group('gloo')
rank = dist.get_rank()
g = torch.Generator().manual_seed(10 + rank)  # each rank its own 22 samples (windows of 8, 8, 6)
x, y = torch.randn(22, 6, generator=g, dtype=torch.float64) * (1 + rank) + rank, torch.randn(22, 1, generator=g, dtype=torch.float64)
torch.manual_seed(0)
if mode == 'mlp': net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()
else: net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).double()
init = {k: v.clone() for k, v in net.state_dict().items()}
model = DDP(net)
count = [0]
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
def hook(state, bucket):
    count[0] += 1
    return allreduce_hook(None, bucket)
model.register_comm_hook(None, hook)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
acc = Accumulation(model, n_step=4, policy='exact' if mode == 'exact' else 'window')
inputs, steps, stats = [], 0, []
for bn in bn_layers(net):
    bn.register_forward_pre_hook(lambda m, i: inputs.append(i[0].detach().clone()) if m.training and getattr(m, '_prepass', None) is None else None)
reference = [nn.BatchNorm1d(bn.num_features).double() for bn in bn_layers(net)] if mode == 'window' else []  # 'exact' is checked against one process on the union
for epoch in range(2):
    for xb, yb in acc.batches(DataLoader(TensorDataset(x, y), batch_size=2)):
        if acc.window.empty: inputs.clear()  # a window starts: forget forwards outside training ('exact' measures one)
        if acc.backward(nn.functional.mse_loss(model(xb), yb)):
            opt.step(); opt.zero_grad(); steps += 1
            stats += [t.clone() for bn in bn_layers(net) for t in (bn.running_mean, bn.running_var)]
            if reference:  # BatchNorm on the union of both ranks' windows (one layer: its inputs, gathered)
                local = torch.cat(inputs)
                sizes = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
                dist.all_gather(sizes, torch.tensor([local.shape[0]]))
                parts = [torch.zeros(int(s), local.shape[1], dtype=local.dtype) for s in sizes]
                dist.all_gather(parts, local)
                reference[0](torch.cat(parts))
            inputs.clear()
torch.save(dict(allreduces=count[0], steps=steps, path=acc.path, params=[p.detach() for p in net.parameters()], stats=stats,
                init=init, data=(x, y), final=[(bn.running_mean, bn.running_var) for bn in bn_layers(net)][:1],
                reference=[(r.running_mean, r.running_var) for r in reference][:1]), f'{outdir}/rank{rank}.pt')
dist.barrier()
dist.destroy_process_group()
# Leave without interpreter shutdown: under load, a thread left by gloo/fastai can abort it (SIGABRT, "terminate called
# without an active exception") after everything above has finished and been saved.
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
