"Data and models shared by the distributed test script and the single-process references."
import torch
from torch import nn
from fastai_accum.lab.experiments import CountAllReduces  # counts gradient all-reduces: `.calls`, `.rounds`, `.windows`

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
