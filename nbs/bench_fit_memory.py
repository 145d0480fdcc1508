"""A whole fit's real memory against its device budget: every tensor storage alive at once (`LiveBytes`), the check
before the first staged window, the store, the chunks and the optimizer included; live bytes after each epoch.

    python nbs/bench_fit_memory.py resnet18 96 16 0.3     # model (torchvision resnet18 or a timm name), px, n_step, f
    python nbs/bench_fit_memory.py resnet26d 32 8 0.5

float64 on the CPU, micro-batch 2, SGD momentum, 3 epochs of 4 windows; the budget lies a fraction f of the way from a
staged step's need (as the plan counts it) to the whole window's. Prints the path, peak / budget and the live bytes.
"""
import sys, time, warnings
import torch, torchvision
import torch.nn.functional as F
from fastai_accum.core import Accumulation
from fastai_accum.exact import plan_exact
from fastai_accum.meters import LiveBytes
from fastai_accum.staged import staged_graph
from fastai_accum.staged_exact import stage_grads, store_per_sample

def main(name='resnet18', size='96', n_step='16', frac='0.3'):
    size, n_step, frac = int(size), int(n_step), float(frac)
    warnings.simplefilter('ignore')
    torch.manual_seed(0)
    if name == 'resnet18': model = torchvision.models.resnet18(num_classes=10)
    else:
        import timm
        model = timm.create_model(name, num_classes=10)
    model = model.double().train()
    xs = torch.randn(n_step * 2 * 4, 3, size, size, dtype=torch.float64)
    ys = torch.randint(0, 10, (len(xs),))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    micro = (xs[:2].clone(),)
    p = plan_exact(model, micro, n_step * 2, opt_state=1.)
    graph = staged_graph(model, micro)
    p.chunk, p.stage_grads, p.store = 2, stage_grads(model, graph), store_per_sample(model, graph, micro)
    lo, hi = p.staged_device_needed, p.device_needed
    budget = int(lo + frac * (hi - lo))
    print(f'{name} {size} px, {n_step} x 2: staged need {lo / 2**20:.1f} MiB, whole {hi / 2**20:.1f} MiB, '
          f'budget {budget / 2**20:.1f} MiB')
    acc = Accumulation(model, n_step=n_step, optimizer=opt, device_memory=budget)
    t, after = time.perf_counter(), []
    with LiveBytes(model) as meter:
        for epoch in range(3):
            for xb, yb in acc.batches(loader):
                if acc.backward(F.cross_entropy(model(xb), yb)): opt.step(); opt.zero_grad()
            after.append(meter.live)
    print(f'path {acc.path!r}: peak / budget {meter.peak / budget:.3f} ({meter.peak / 2**20:.1f} MiB), live after '
          f'epochs {", ".join(f"{a / 2**20:.1f}" for a in after)} MiB, {time.perf_counter() - t:.1f} s')

if __name__ == '__main__': main(*sys.argv[1:])
