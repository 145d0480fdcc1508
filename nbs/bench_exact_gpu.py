"""The exact modes on an accelerator: peak memory and time per window of training each window as one batch (saved
activations in pinned host memory; or staged: stage by stage in chunks of the micro-batch, kept values in host memory),
against naive accumulation at the micro-batch and against one batch held on the device.

    python nbs/bench_exact_gpu.py                     # resnet50, 224 px, windows 64 and 256, micro-batch 2, CUDA
    python nbs/bench_exact_gpu.py --device cpu --model resnet18 --size 32 --windows 8 --reps 1   # a smoke test

One line per (window, mode): seconds per window, peak accelerator memory, and the plan's estimate (`plan_exact`, measured
on one micro-batch) next to it (staged: the host traffic per window), then a summary line of ratios. Synthetic data, random init, SGD: memory and time only.
"""
import argparse, contextlib, time
import torch, torchvision
from torch import nn
from fastai_accum.exact import plan_exact, saved_on_host
from fastai_accum.staged_exact import install_staged, uninstall_staged
from fastai_accum.meters import fmt_bytes

def parse():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', default='resnet50', help='a torchvision model name')
    p.add_argument('--size', type=int, default=224, help='image side in pixels')
    p.add_argument('--windows', default='64,256', help='comma list of window sizes (samples)')
    p.add_argument('--micro-bs', type=int, default=2)
    p.add_argument('--reps', type=int, default=3, help='timed windows per mode (after one warm-up window)')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    return p.parse_args()

def sync(dev):
    if dev.type == 'cuda': torch.cuda.synchronize(dev)

def peak_reset(dev):
    if dev.type == 'cuda': torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(dev)

def peak(dev): return torch.cuda.max_memory_allocated(dev) if dev.type == 'cuda' else float('nan')

def naive_window(model, opt, xs, ys, loss_func, dev):
    "Micro-batch by micro-batch, each moved from host memory to the device as it trains (as a DataLoader hands them over)."
    n = sum(len(x) for x in xs)
    for x, y in zip(xs, ys): (loss_func(model(x.to(dev, non_blocking=True)), y) * len(x) / n).backward()
    opt.step(); opt.zero_grad()

def one_batch_window(model, opt, xs, ys, loss_func, plan, dev=None):
    "The window as one batch, its inputs joined in host memory and moved to `dev` (None: left in host memory, a staged step's)."
    x, y = torch.cat(xs), torch.cat(ys)
    if dev is not None: x = x.to(dev, non_blocking=True)
    with saved_on_host(plan) if plan is not None else contextlib.nullcontext(): loss = loss_func(model(x), y)
    loss.backward()
    opt.step(); opt.zero_grad()

def staged_window(model, opt, xs, ys, loss_func, chunk):
    "The window as one batch through a staged exact step in chunks of `chunk` (its inputs and kept values in host memory on an accelerator)."
    install_staged(model, chunk)
    try: one_batch_window(model, opt, xs, ys, loss_func, plan=None)
    finally: uninstall_staged(model)

def timed(fn, dev, reps):
    fn(); sync(dev)  # warm-up (cuDNN autotuning, allocator, pinned host blocks)
    peak_reset(dev)
    t = time.perf_counter()
    for _ in range(reps): fn()
    sync(dev)
    return (time.perf_counter() - t) / reps, peak(dev)

def main():
    a = parse()
    dev = torch.device(a.device)
    torch.backends.cudnn.benchmark = True
    model = getattr(torchvision.models, a.model)(num_classes=10).to(dev).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss_func = nn.CrossEntropyLoss()
    print(f'{a.model} {a.size}px micro-batch {a.micro_bs} on {dev} ({torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"})')
    summary = {}
    for w in [int(s) for s in a.windows.split(',')]:
        xs = [torch.randn(a.micro_bs, 3, a.size, a.size, pin_memory=dev.type == 'cuda') for _ in range(w // a.micro_bs)]  # in host memory
        ys = [torch.randint(0, 10, (a.micro_bs,), device=dev) for _ in xs]
        offloaded = plan_exact(model, (xs[0].to(dev),), w, offload=dev.type == 'cuda')
        on_device = plan_exact(model, (xs[0].to(dev),), w, offload=False)
        rows = [('naive', lambda: naive_window(model, opt, xs, ys, loss_func, dev), None),
                ('exact, host offload', lambda: one_batch_window(model, opt, xs, ys, loss_func, offloaded, dev), offloaded),
                ('staged exact', lambda: staged_window(model, opt, xs, ys, loss_func, a.micro_bs), 'staged'),
                ('one batch on device', lambda: one_batch_window(model, opt, xs, ys, loss_func, on_device, dev), on_device)]
        res = {}
        for name, fn, plan in rows:
            try: secs, mem = timed(fn, dev, a.reps)
            except torch.OutOfMemoryError: secs, mem = float('nan'), float('nan'); opt.zero_grad(); peak_reset(dev)
            res[name] = (secs, mem)
            est = ('' if plan is None else f'  host traffic: {fmt_bytes(2 * on_device.staged_host_needed)} per window (kept values out and back)'
                   if plan == 'staged' else f'  estimate: device {fmt_bytes(plan.device_needed)}, host {fmt_bytes(plan.host_needed)}')
            print(f'window {w:4d}  {name:20s} {secs:8.3f} s/window  peak {fmt_bytes(mem) if mem == mem else "n/a":>10s}{est}', flush=True)
        def vs(name): return res[name][0] / res['naive'][0], res[name][1] / res['naive'][1] if res['naive'][1] == res['naive'][1] and res['naive'][1] else float('nan')
        summary[w] = vs('exact, host offload') + vs('staged exact')
    print(' '.join(f'exact_time_vs_naive_w{w}={t:.2f} exact_peak_vs_naive_w{w}={m:.2f} staged_time_vs_naive_w{w}={ts:.2f} '
                   f'staged_peak_vs_naive_w{w}={ms:.2f}' for w, (t, m, ts, ms) in summary.items()))

if __name__ == '__main__': main()
