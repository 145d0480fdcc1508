"Data and models shared by the distributed test scripts and the single-process references; launching 2 ranks."
import os, subprocess, sys
from pathlib import Path
import torch
from torch import nn
from fastai_accum.lab.experiments import CountAllReduces  # counts gradient all-reduces: `.calls`, `.rounds`, `.windows`

def torchrun(script, *args, timeout=300):
    "Run `script` (a path, or a name in tests/) on 2 CPU ranks with `args`: the finished process."
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
           str(Path(__file__).parent/script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, 'OMP_NUM_THREADS': '1'})

def rank_results(script, outdir, *args):
    "Run `script` on 2 ranks with `args` then `outdir`, where each rank saves `rank{i}.pt`: both ranks' results."
    Path(outdir).mkdir(exist_ok=True)
    r = torchrun(script, *args, outdir)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [torch.load(Path(outdir)/f'rank{i}.pt', weights_only=False) for i in range(2)]

def data(n=64, d=6, image=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g); y = x @ torch.randn(d, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    if image: x = x.repeat_interleave(8, 1).view(n, 3, 4, 4)
    return x, y

def mlp(): return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
def bn_net(): return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                   nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

class DeepResNet(nn.Module):
    "A stem and `depth` residual conv-BN-ReLU blocks (BatchNorm at every level), then BN1d in the head: depth + 2 BN levels."
    def __init__(self, depth=22, c=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
                                    for _ in range(depth))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(c * 16, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks: x = (x + b(x) * 2.).relu()  # the residual branch shifts each level's statistics
        return self.head(x)

def deep_window(rank, n_micro=4, bs=2):
    "Rank `rank`'s window: `n_micro` micro-batches of `bs` float64 4x4 images, distinct per rank."
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(bs, 3, 4, 4, generator=g, dtype=torch.float64) * (1 + rank) + rank,) for _ in range(n_micro)]

def image_data(n=64, size=32):
    "`n` float64 images of `size` px and 10 classes."
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g)

def activation_cnn():
    "A CNN whose activations outweigh its parameters (what staged exact is for)."
    def block(i, o, s=1): return [nn.Conv2d(i, o, 3, stride=s, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]
    return nn.Sequential(*block(3, 16), *block(16, 16), *block(16, 32, 2), *block(32, 64, 2), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(64, 10))
