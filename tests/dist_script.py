"""Run under `python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_script.py MODE OUTDIR`.

CPU + gloo through fastai's `distrib_ctx` (accelerate's DDP). Each rank saves what the test needs to OUTDIR/rankR.pt.
"""
import os, sys, torch
from functools import partial
from torch import nn
from torch.utils.data import TensorDataset
from fastai.basics import Learner, DataLoaders, DataLoader, SGD, MSELossFlat, Callback
import fastai.distributed
from fastai_accum.all import *
from fastai_accum.batchnorm import bn_layers
from fastai_accum.prepass import prepass_info, window_prepasses
from fastai_accum.distributed import fix_distributed_dl

torch.set_num_threads(1)
mode, outdir = sys.argv[1], sys.argv[2]
rank = int(os.environ['RANK'])

fix_distributed_dl()  # the project's fix: fastai's DistributedDL broadcasts through .cuda() (NCCL only)

from dist_helpers import data, mlp, bn_net, CountAllReduces

class RecordWindows(Callback):
    "After each optimizer step: this rank's BN running stats; per window: each BN layer's training inputs."
    order = 100
    def before_fit(self):
        self.bns = bn_layers(self.learn.model)
        self.inputs, self.stats, self.window = [], [], 0
        self.hooks = [bn.register_forward_pre_hook(partial(self._hook, i)) for i, bn in enumerate(self.bns)]
    def _hook(self, i, bn, inp):
        if bn.training and bn._prepass is None: self.inputs.append((self.epoch, self.window, i, inp[0].detach().double()))
    def after_step(self):
        self.window += 1
        self.stats.append([(bn.running_mean.clone(), bn.running_var.clone()) for bn in self.bns])
    def after_epoch(self): self.window = 0
    def after_fit(self): [h.remove() for h in self.hooks]

def learner(model_fn, image=False, bs=2, **kw):
    x, y = data(image=image)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=bs), DataLoader(TensorDataset(x[:8], y[:8]), bs=bs))
    torch.manual_seed(0)
    return Learner(dls, model_fn(), loss_func=MSELossFlat(), opt_func=SGD, **kw)

if mode in ('count', 'count_each'):
    learn = learner(mlp)
    counter = CountAllReduces()
    with learn.distrib_ctx(cpu=True, sync_bn=False):
        learn.fit(2, lr=0.05, cbs=[GradientAccumulation(n_step=4, sync_each_batch=mode == 'count_each'), counter])
    torch.save(dict(allreduces=counter.calls, params=[p.detach() for p in learn.model.parameters()]), f'{outdir}/rank{rank}.pt')

elif mode in ('bn', 'bn_window'):
    learn = learner(bn_net, image=True)
    rec = RecordWindows()
    policy = 'window' if mode == 'bn_window' else 'micro'
    with learn.distrib_ctx(cpu=True, sync_bn=False):
        learn.fit(2, lr=0.01, cbs=[GradientAccumulation(n_step=4, policy=policy), rec])
    torch.save(dict(inputs=rec.inputs, stats=rec.stats,
                    final=[(bn.running_mean, bn.running_var) for bn in bn_layers(learn.model)]), f'{outdir}/rank{rank}.pt')

elif mode.startswith('prepass_sync'):  # one pre-pass, each BatchNorm merging its input moments across ranks
    from dist_helpers import DeepResNet, deep_window
    from fastai_accum.window import commit_window
    torch.distributed.init_process_group('gloo')
    torch.manual_seed(0)
    net = DeepResNet().double(); wrap_bn(net, 'window'); net.train()
    window = deep_window(rank)
    calls, gather = [0], torch.distributed.all_gather
    def counting(*a, **k): calls[0] += 1; return gather(*a, **k)
    torch.distributed.all_gather = counting
    chunk = 2 if mode == 'prepass_sync_staged' else None
    window_prepasses(net, window, chunk=chunk, memory=None if chunk else float('inf'))
    info = prepass_info(net)
    stats = [tuple(t.clone() for t in bn.window_stats) for bn in bn_layers(net)]
    commit_window(bn_layers(net))
    torch.save(dict(window=window, stats=stats, calls=calls[0], info=info,
                    running=[(bn.running_mean.clone(), bn.running_var.clone()) for bn in bn_layers(net)]), f'{outdir}/rank{rank}.pt')

elif mode == 'crash':
    class Crash(Callback):
        order = 100
        def after_batch(self):
            if rank == 1 and self.training and self.iter == 2: raise RuntimeError('rank 1 crashed mid-window')
    learn = learner(bn_net, image=True)
    with learn.distrib_ctx(cpu=True, sync_bn=False):
        learn.fit(1, lr=0.01, cbs=[GradientAccumulation(n_step=4), Crash()])

# Tear the process group down before exit: gloo's threads otherwise can abort the interpreter at shutdown (SIGABRT,
# "terminate called without an active exception"), failing a run that finished.
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
# Leave without interpreter shutdown: under load, a thread left by gloo/fastai can abort it (SIGABRT, "terminate called
# without an active exception") after everything above has finished and been saved.
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
