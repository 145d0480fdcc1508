"""`accelerate launch --cpu --num_processes 2 tests/accelerate_dist_script.py MODE OUTDIR`: accelerate's DDP on gloo,
`AcceleratedAccumulation` inside `accelerator.accumulate(model)`; each rank saves what tests/test_accelerate.py checks."""
import os, sys, torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from accelerate import Accelerator
from fastai_accum.accelerate import AcceleratedAccumulation
from fastai_accum.batchnorm import bn_layers

torch.set_num_threads(1)
mode, outdir = sys.argv[1], sys.argv[2]
accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
rank = accelerator.process_index
g = torch.Generator().manual_seed(0)
x, y = torch.randn(44, 6, generator=g, dtype=torch.float64), torch.randn(44, 1, generator=g, dtype=torch.float64)
torch.manual_seed(0)
if mode == 'mlp': net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()
else: net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).double()
init = {k: v.clone() for k, v in net.state_dict().items()}
opt = torch.optim.SGD(net.parameters(), lr=0.05)
# 44 samples, 2 processes, batch 2: 11 micro-batches per rank and epoch -> windows of 4, 4, 3 micro-batches
model, opt, dl = accelerator.prepare(net, opt, DataLoader(TensorDataset(x, y), batch_size=2))
count = [0]
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
def hook(state, bucket):
    count[0] += 1
    return allreduce_hook(None, bucket)
model.register_comm_hook(None, hook)
steps = [0]
opt.optimizer.register_step_post_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))
acc = AcceleratedAccumulation(accelerator, model, policy='window')
inputs, stats, batches = [], [], []
for bn in bn_layers(net):
    bn.register_forward_pre_hook(lambda m, i: inputs.append(i[0].detach().clone()) if m.training and getattr(m, '_prepass', None) is None else None)
reference = [nn.BatchNorm1d(bn.num_features).double() for bn in bn_layers(net)][:1]
for epoch in range(2):
    for xb, yb in acc.batches(dl):
        if epoch == 0: batches.append((xb, yb))
        with accelerator.accumulate(model):
            end = acc.backward(nn.functional.mse_loss(model(xb), yb))
            opt.step(); opt.zero_grad()
        if end:
            stats += [t.clone() for bn in bn_layers(net) for t in (bn.running_mean, bn.running_var)]
            if reference:
                reference[0](accelerator.gather(torch.cat(inputs)))
            inputs.clear()
torch.save(dict(allreduces=count[0], steps=steps[0], params=[p.detach() for p in net.parameters()], stats=stats, init=init,
                batches=batches, final=[(bn.running_mean, bn.running_var) for bn in bn_layers(net)][:1],
                reference=[(r.running_mean, r.running_var) for r in reference]), f'{outdir}/rank{rank}.pt')
dist.barrier()
dist.destroy_process_group()
# Leave without interpreter shutdown: under load, a thread left by gloo/fastai can abort it (SIGABRT, "terminate called
# without an active exception") after everything above has finished and been saved.
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
