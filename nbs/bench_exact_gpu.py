"""The exact modes on an accelerator, in one run: first a correctness check, then peak memory and time per window of
training each window as one batch (saved activations in pinned host memory; or staged: stage by stage in chunks of the
micro-batch, inputs and kept values in pinned host memory), against naive accumulation at the micro-batch and against
one batch held on the device; and staged with the stages this card's cost model finds worth making again rather
than keeping (`nbs/00f_remade`, chosen by `RemadeTime` on the measured card from the staged row's ledger).

    python nbs/bench_exact_gpu.py                     # resnet50, 224 px, windows 64 and 256, micro-batch 2, CUDA: < 5 min on one GPU
    python nbs/bench_exact_gpu.py --device cpu --model resnet18 --size 32 --windows 8 --reps 1   # a smoke test (CPU as an accelerator)
    python nbs/bench_exact_gpu.py --table --no-check  # issue #35 table: 6 models x windows 16/64/256, 128 px, rows past --minutes skipped (not run yet)

The check trains a small model (torchvision resnet18, 32 px) for two windows of 8 in micro-batches of 2 through the
core (`Accumulation`) with a device budget that forces the accelerator's paths: 'staged' (inputs and kept values in
host memory) and 'exact' with host offload, in float64 against the big batch (max relative difference ≤ 1e-9), then
'staged' under float16 autocast with a GradScaler against float64 (within 1.25x plain fp16 autocast's error, and no
inf). It prints one `check ...: ok` line each, and stops with exit code 1 if one fails: timings of a wrong step mean nothing.

Then the card, measured as the plan measures it (`fastai_accum.cost.measure_card`: pinned copies one way and both
ways at once, a forward at the micro-batch and at 4x it: its FLOP rate and cost a kernel), and one line per (window,
mode): seconds per window, peak accelerator memory (`torch.cuda.max_memory_allocated`), CUDA-synchronised, and the
plan's estimate (`plan_exact`, measured on one micro-batch) next to it (staged: the host traffic per window, counted);
then per window the cost model's prediction — on the measured card and on the named classes, from the counted ledger —
next to the measured ratios; then a summary line of ratios. Synthetic data, random init, SGD: memory and time only. Rows past
`--minutes` are skipped (said), so one run fits a short lease of a GPU.
"""
import argparse, contextlib, copy, dataclasses, sys, time
import torch, torchvision
from torch import nn
import torch.nn.functional as F
from fastai_accum.core import Accumulation
from fastai_accum.exact import plan_exact, saved_on_host, staging_budget
from fastai_accum.helpers import emulated_accelerator, is_accelerator
from fastai_accum.staged_exact import install_staged, uninstall_staged
from fastai_accum.meters import fmt_bytes
from fastai_accum.cost import OpCount, RemadeTime, estimate_counts, measure_card, predict, cards

def parse():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', default='resnet50', help='a torchvision model name')
    p.add_argument('--size', type=int, default=224, help='image side in pixels')
    p.add_argument('--windows', default='64,256', help='comma list of window sizes (samples)')
    p.add_argument('--micro-bs', type=int, default=2)
    p.add_argument('--reps', type=int, default=3, help='timed windows per mode (after one warm-up window)')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--minutes', type=float, default=4.5, help='skip the timing rows that would start after this many minutes')
    p.add_argument('--no-check', action='store_true', help='skip the correctness check')
    p.add_argument('--table', action='store_true', help="instead of the rows above: issue #35's table (`staged_table`: "
                   'resnet18, resnet50, mobilenet_v2, shufflenet_v2_x1_0, efficientnet_b0, densenet121 at 128 px, windows '
                   '16,64,256 unless --windows is given; naive accumulation vs staged exact on the same peak vs the whole window)')
    p.add_argument('--table-models', default=None, help='--table: comma list of its models (default: all six)')
    return p.parse_args()

def sync(dev):
    if dev.type == 'cuda': torch.cuda.synchronize(dev)

def peak_reset(dev):
    if dev.type == 'cuda': torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(dev)

def peak(dev): return torch.cuda.max_memory_allocated(dev) if dev.type == 'cuda' else float('nan')

# The check: the accelerator's paths through the core, against the big batch
def check_model(dev, dtype):
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=5).to(dev, dtype).train()

def check_batches(dev, dtype, n=8, micro=2):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(micro, 3, 32, 32, generator=g).to(dtype) * 3 + 1, torch.randn(micro, 5, generator=g).to(dev, dtype))
            for _ in range(n)]  # inputs in host memory, as a DataLoader hands them over

def forced_budget(model, micro, window, autocast=None):
    "A device budget between one micro-batch chunk's need and the whole window's: the window cannot sit on the device."
    return staging_budget(model, (micro,), window, autocast=autocast)

def core_grads(model, batches, policy, autocast=None, scaler=None, **kw):
    "The gradients at the end of the first window, trained through `Accumulation` (4 micro-batches)."
    dev = next(model.parameters()).device
    acc = Accumulation(model, n_step=4, policy=policy, autocast=autocast, device=dev, **kw)
    ctx = autocast or contextlib.nullcontext
    for xb, yb in acc.batches(batches):
        with ctx(): loss = F.mse_loss(model(xb).float(), yb.float())
        if acc.backward(scaler.scale(loss) if scaler else loss): break
    if scaler: scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.))
    return acc, [p.grad.double().clone() for p in model.parameters()]

def big_grads(model, batches, autocast=None, scaler=None):
    dev = next(model.parameters()).device
    x, y = (torch.cat(t).to(dev) for t in zip(*batches[:4]))
    with autocast() if autocast else contextlib.nullcontext(): loss = F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y.float())
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler: scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.))
    return [p.grad.double().clone() for p in model.parameters()]

def rel(got, ref):
    "Largest relative difference over the gradients (each against its own largest value; rounding noise below 1e-12 ignored)."
    return max(0. if (g - r).abs().max() <= 1e-12 else ((g - r).abs().max() / r.abs().max().clamp_min(1e-300)).item() for g, r in zip(got, ref))

def check(dev):
    "Float64 equality of the accelerator's staged and offloaded steps, then fp16 autocast + GradScaler within tolerance; False if one fails."
    ok, t = True, time.perf_counter()
    with emulated_accelerator() if dev.type == 'cpu' else contextlib.nullcontext():
        batches = check_batches(dev, torch.float64)
        ref = big_grads(check_model(dev, torch.float64), batches)
        for policy, kw in (('staged', {}), ('exact', {'offload': True})):
            m = check_model(dev, torch.float64)
            budget = forced_budget(m, batches[0][0].to(dev), 8) if policy == 'staged' else None
            acc, got = core_grads(m, batches, policy, device_memory=budget, **kw)
            d = rel(got, ref)
            good = d <= 1e-9 and acc.plan.on_accelerator and (acc.plan.staged if policy == 'staged' else acc.plan.offload)
            print(f"check {acc.path:13s} float64, {acc.plan.describe()}: max rel diff {d:.1e} -> {'ok' if good else 'FAILED'}", flush=True)
            ok &= good
        half = lambda: torch.autocast(dev.type, dtype=torch.float16)
        m, batches = check_model(dev, torch.float32), check_batches(dev, torch.float32)  # the same values as the float64 ones
        scale = 65536.
        while True:  # the largest scale at which the plain step is finite, as GradScaler finds it by halving
            plain = big_grads(copy.deepcopy(m), batches, half, torch.amp.GradScaler(dev.type, init_scale=scale))
            if all(torch.isfinite(g).all() for g in plain) or scale < 1: break
            scale /= 2
        acc, staged = core_grads(m, batches, 'staged', half, torch.amp.GradScaler(dev.type, init_scale=scale),
                                 device_memory=forced_budget(m, batches[0][0].to(dev), 8, half))
        flat = lambda gs: torch.cat([g.flatten() for g in gs])
        err = lambda g: ((flat(g) - flat(ref)).norm() / flat(ref).norm()).item()
        finite = all(torch.isfinite(g).all() for g in staged)
        good = finite and err(staged) <= 1.25 * err(plain) + 1e-6
        print(f"check {acc.path:13s} fp16 autocast + GradScaler (scale {scale:g}): error vs float64 {err(staged):.2e} (plain fp16 autocast {err(plain):.2e}), "
              f"finite {finite} -> {'ok' if good else 'FAILED'}", flush=True)
        ok &= good
    print(f"check took {time.perf_counter() - t:.1f} s", flush=True)
    return ok

# The timing rows
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

last_ledger = {}  # the staged step's last window: what crossed the host link (`fastai_accum.link.Ledger`)

def staged_window(model, opt, xs, ys, loss_func, chunk):
    "The window as one batch through a staged exact step in chunks of `chunk` (its inputs and kept values in host memory on an accelerator)."
    f = install_staged(model, chunk)
    try: one_batch_window(model, opt, xs, ys, loss_func, plan=None)
    finally: uninstall_staged(model)
    last_ledger['staged'] = f.step.ledger
    last_ledger['device_store_bytes'] = getattr(f.step.device, 'most', 0)  # the store's device part, at most

held = {}  # the staged forward making stages again, kept across its row's windows (its first window measures)

def remade_window(model, opt, xs, ys, loss_func, chunk, time):
    "As `staged_window`, the stages the cost model's `time` (`RemadeTime` on this card) finds quickest made again."
    if 'remade' not in held: held['remade'] = install_staged(model, chunk, remade=time)
    one_batch_window(model, opt, xs, ys, loss_func, plan=None)
    step = held['remade'].step
    last_ledger['remade'], last_ledger['remade_stages'] = step.ledger, (len(step.window.remade_stages), len(step.cut))

def counted(w, micro, flops, ops, led):
    "The cost model's counts of window `w`: the link's traffic counted (`led`), FLOPs and kernels estimated as the plan does."
    return dataclasses.replace(estimate_counts(w, micro, micro, flops, ops, kept=0), h2d=led.h2d_bytes, d2h=led.d2h_bytes,
                               ahead=led.ahead_bytes, copies=led.copies, syncs=led.syncs, estimated=False)

def timed(fn, dev, reps):
    fn(); sync(dev)  # warm-up (cuDNN autotuning, allocator, pinned host blocks)
    peak_reset(dev)
    t = time.perf_counter()
    for _ in range(reps): fn()
    sync(dev)
    return (time.perf_counter() - t) / reps, peak(dev)

def measured_card(model, x, micro, dev):
    "(the card as `measure_card` measures it, FLOPs a sample and kernels of one forward of `x`)."
    with OpCount() as oc, torch.no_grad(): model(x)
    def forward(n):
        with torch.no_grad(): model(x.repeat(-(-n // len(x)), 1, 1, 1)[:n])
    card = measure_card(forward, micro, 4 * micro, oc.flops / len(x), oc.ops, dev)
    print(f"card: {card.what}: link {card.link_GBps:.1f} GB/s one way, {card.link_both_GBps:.1f} GB/s each way at once; "
          f"{card.rate('fp32') / 1e12:.1f} TFLOP/s on a forward, {card.kernel_us:.1f} us a kernel", flush=True)
    return card, oc.flops / len(x), oc.ops

def predicted_line(w, micro, flops, ops, card, res):
    "The cost model's ratios for window `w` from the counted ledger, on the measured card and the named classes, beside the measured."
    led = last_ledger.get('staged')
    if led is None: return
    counts = counted(w, micro, flops, ops, led)
    said = ', '.join(f"{c.name} {predict(counts, c).ratio():.2f}x" for c in [card, *cards.values()])
    got = res['staged exact'][0] / res['naive'][0]
    print(f"window {w:4d}  staged / naive: measured {got:.2f}x; predicted (ledger counted, FLOPs and kernels estimated) {said}",
          flush=True)
    if 'remade' in last_ledger:  # its own ledger counted; its FLOPs as the cost model traded them
        made = last_ledger['remade']
        trade = ((led.d2h_bytes - made.d2h_bytes) / w, (led.h2d_bytes - made.h2d_bytes) / w, 0.)
        q = predict(RemadeTime(card, counts).counts(trade), card)
        got = res['staged, made again'][0] / res['naive'][0]
        print(f"window {w:4d}  staged, {last_ledger['remade_stages'][0]} of {last_ledger['remade_stages'][1]} stages made "
              f"again / naive: measured {got:.2f}x; predicted on this card (bytes counted, FLOPs not added) {q.ratio():.2f}x",
              flush=True)

def main():
    a = parse()
    dev = torch.device(a.device)
    start = time.perf_counter()
    print(f'torch {torch.__version__} on {dev} ({torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"})', flush=True)
    if not a.no_check and not check(dev): sys.exit(1)
    torch.backends.cudnn.benchmark = True
    if a.table:
        from fastai_accum.lab.bench_speed import staged_table, table_models
        import pandas as pd
        windows = [int(s) for s in a.windows.split(',')] if a.windows != '64,256' else [16, 64, 256]
        models = a.table_models.split(',') if a.table_models else list(table_models)
        with pd.option_context('display.width', 250, 'display.max_columns', 30, 'display.precision', 2):
            print(staged_table(models, windows, micro=a.micro_bs, device=dev, reps=a.reps, threads=None,
                               seconds=60 * a.minutes - (time.perf_counter() - start)), flush=True)
        print(f'total {time.perf_counter() - start:.0f} s', flush=True)
        return
    model = getattr(torchvision.models, a.model)(num_classes=10).to(dev).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss_func = nn.CrossEntropyLoss()
    print(f'{a.model} {a.size}px micro-batch {a.micro_bs}', flush=True)
    card, flops, ops = measured_card(model, torch.randn(a.micro_bs, 3, a.size, a.size, device=dev), a.micro_bs, dev)
    summary = {}
    for w in [int(s) for s in a.windows.split(',')]:
        last_ledger.clear()
        pin = dev.type == 'cuda'
        xs = [torch.randn(a.micro_bs, 3, a.size, a.size, pin_memory=pin) for _ in range(w // a.micro_bs)]  # in host memory
        ys = [torch.randint(0, 10, (a.micro_bs,), device=dev) for _ in xs]
        offloaded = plan_exact(model, (xs[0].to(dev),), w, offload=is_accelerator(dev))
        on_device = plan_exact(model, (xs[0].to(dev),), w, offload=False)
        rows = [('naive', lambda: naive_window(model, opt, xs, ys, loss_func, dev), None),
                ('exact, host offload', lambda: one_batch_window(model, opt, xs, ys, loss_func, offloaded, dev), offloaded),
                ('staged exact', lambda: staged_window(model, opt, xs, ys, loss_func, a.micro_bs), 'staged'),
                # the stages this card's cost model finds worth making again, from the staged row's ledger
                ('staged, made again', lambda: remade_window(model, opt, xs, ys, loss_func, a.micro_bs, RemadeTime(
                    card, counted(w, a.micro_bs, flops, ops, last_ledger['staged']))), 'remade'),
                ('one batch on device', lambda: one_batch_window(model, opt, xs, ys, loss_func, on_device, dev), on_device)]
        res = {}
        for name, fn, plan in rows:
            if time.perf_counter() - start > 60 * a.minutes or (plan == 'remade' and 'staged' not in last_ledger):
                print(f'window {w:4d}  {name:20s} skipped: past --minutes {a.minutes}', flush=True)
                res[name] = (float('nan'), float('nan'))
                continue
            try: secs, mem = timed(fn, dev, a.reps)
            except torch.cuda.OutOfMemoryError: secs, mem = float('nan'), float('nan'); opt.zero_grad(); peak_reset(dev)
            finally:
                if held.pop('remade', None) is not None: uninstall_staged(model)
            res[name] = (secs, mem)
            est = ('' if plan in (None, 'remade') else f'  host traffic: {fmt_bytes(2 * on_device.staged_host_needed + sum(x.nbytes for x in xs))} per window (kept values out and back, inputs in)'
                   if plan == 'staged' else f'  estimate: device {fmt_bytes(plan.device_needed)}, host {fmt_bytes(plan.host_needed)}')
            print(f'window {w:4d}  {name:20s} {secs:8.3f} s/window  peak {fmt_bytes(mem) if mem == mem else "n/a":>10s}{est}', flush=True)
            if plan == 'staged' and 'staged' in last_ledger:  # beside the time it took: the cost model's inputs
                print(f'window {w:4d}  {last_ledger["staged"].line(device_store_bytes=last_ledger["device_store_bytes"])} '
                      '(predicted by `fastai-accum bench ledger`)', flush=True)
            if plan == 'remade' and 'remade' in last_ledger:
                print(f'window {w:4d}  {last_ledger["remade"].line()} ({last_ledger["remade_stages"][0]} stages made again)', flush=True)
        predicted_line(w, a.micro_bs, flops, ops, card, res)
        def vs(name): return res[name][0] / res['naive'][0], res[name][1] / res['naive'][1] if res['naive'][1] == res['naive'][1] and res['naive'][1] else float('nan')
        summary[w] = vs('exact, host offload') + vs('staged exact') + vs('staged, made again')
    print(' '.join(f'exact_time_vs_naive_w{w}={t:.2f} exact_peak_vs_naive_w{w}={m:.2f} staged_time_vs_naive_w{w}={ts:.2f} '
                   f'staged_peak_vs_naive_w{w}={ms:.2f} remade_time_vs_naive_w{w}={tr:.2f} remade_peak_vs_naive_w{w}={mr:.2f}'
                   for w, (t, m, ts, ms, tr, mr) in summary.items()))
    print(f'total {time.perf_counter() - start:.0f} s', flush=True)

if __name__ == '__main__': main()
