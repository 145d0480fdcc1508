"Data and models shared by the distributed test script and the single-process references."
import torch
from torch import nn

def data(n=64, d=6, image=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g); y = x @ torch.randn(d, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    if image: x = x.repeat_interleave(8, 1).view(n, 3, 4, 4)
    return x, y

def mlp(): return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
def bn_net(): return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                   nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
