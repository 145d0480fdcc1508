"""Distributed training with gradient accumulation and exact BatchNorm statistics (fastai + fastai_accum).

    torchrun --nproc_per_node 2 nbs/train_distributed.py [--epochs 3] [--micro-bs 2] [--batch 64]
    accelerate launch --num_processes 2 nbs/train_distributed.py

Uses GPUs with NCCL when available, else CPU processes with gloo. Data: sklearn's digits (offline), upsampled to 32px.
"""
import argparse, os, sys
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from sklearn.datasets import load_digits
from fastai.basics import *
from fastai.distributed import *
from fastai.callback.schedule import *
from fastai_accum.all import *
from fastai_accum.distributed import fix_distributed_dl

def digits_dls(bs):
    d = load_digits()
    x = F.interpolate(torch.tensor(d.images, dtype=torch.float32)[:, None] / 16., size=32, mode='bilinear')
    y = torch.tensor(d.target)
    idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    tr, va = idx[:1400], idx[1400:]
    return DataLoaders(DataLoader(TensorDataset(x[tr], y[tr]), bs=bs, shuffle=True, drop_last=True),
                       DataLoader(TensorDataset(x[va], y[va]), bs=64))

def cnn():
    def block(ci, co): return [nn.Conv2d(ci, co, 3, 2, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU()]
    return nn.Sequential(*block(1, 16), *block(16, 32), *block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, 10))

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--micro-bs', type=int, default=2)
    p.add_argument('--batch', type=int, default=64, help='effective batch per optimizer step, over all processes')
    p.add_argument('--policy', default='micro')
    args = p.parse_args()
    world = int(os.environ.get('WORLD_SIZE', 1))
    cpu = not torch.cuda.is_available()
    if cpu: torch.set_num_threads(1)
    fix_distributed_dl()
    n_step = max(1, args.batch // (args.micro_bs * world))
    learn = Learner(digits_dls(args.micro_bs), cnn(), loss_func=CrossEntropyLossFlat(), metrics=accuracy,
                    cbs=GradientAccumulation(n_step=n_step, policy=args.policy))
    with learn.distrib_ctx(cpu=cpu, sync_bn=False):
        learn.fit_one_cycle(args.epochs, 3e-3)
    if rank_distrib() == 0:
        print(f'world={world} micro_bs={args.micro_bs} n_step={n_step} effective batch={args.micro_bs * n_step * world}')
    if torch.distributed.is_initialized(): torch.distributed.destroy_process_group()  # clean gloo/NCCL shutdown
    # Under load, a thread left by gloo can abort the interpreter's shutdown (SIGABRT, "terminate called without an active
    # exception") after training has finished: leave without it.
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
