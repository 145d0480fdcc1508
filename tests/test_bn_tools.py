"""precise_bn across processes: each rank pools its own shard, and the statistics are merged exactly (needs spawned
processes, so it lives here; every other check of the BatchNorm tools is in nbs/04_bn_tools.ipynb)."""
import copy, os, socket
import torch
import torch.multiprocessing as mp
from torch import nn
from fastai_accum.batchnorm import bn_layers
from fastai_accum.bn_tools import precise_bn


def small_cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                         nn.ReLU(), nn.Linear(8, 3))

def drifting_batches(n=10, seed=0):
    "Batches of unequal size whose means drift, as from an unshuffled loader over sorted data."
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2 + i % 5, 3, 10, 10, generator=g) * (1 + 0.2*i) + 0.4*i for i in range(n)]

def reference_stats(model, batches):
    "Float64 mean / unbiased var of each BN layer's input over all batches (cat), in a train-mode pass of a copy."
    model, caps = copy.deepcopy(model).train(), {}
    hooks = [m.register_forward_pre_hook(lambda m, a: caps.setdefault(m, []).append(a[0].double()))
             for m in bn_layers(model)]
    with torch.no_grad():
        for b in batches: model(b)
    for h in hooks: h.remove()
    out = []
    for xs in caps.values():
        x = torch.cat(xs); dims = [d for d in range(x.dim()) if d != 1]
        out.append((x.mean(dims), x.var(dims)))
    return out


def _dist_worker(rank, world, port, batches, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = small_cnn()
        precise_bn(model, batches[rank::world], show_progress=False)  # each rank its own shard, merged exactly
        out[rank] = [(m.running_mean.clone(), m.running_var.clone()) for m in bn_layers(model)]
    finally: dist.destroy_process_group()

def test_precise_bn_distributed_merges_ranks():
    batches = drifting_batches(8)
    torch.manual_seed(0)
    ref = reference_stats(small_cnn(), batches)
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_dist_worker, args=(2, port, batches, out), nprocs=2)
    for r in range(2):
        for (mean, var), (rmean, rvar) in zip(out[r], ref):
            assert ((var.double() - rvar).abs() / rvar).max() <= 1e-5
            assert ((mean.double() - rmean).abs() / rvar.sqrt()).max() <= 1e-5
