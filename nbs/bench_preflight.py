"""The pre-flight's predicted time per window, as a fit prints it, for a torchvision model under `emulated_accelerator()`:
to set beside `fastai-accum bench ledger`'s counted prediction of the same model and window (`nbs/01c_cost`).

    python nbs/bench_preflight.py resnet18 64 16 150000000      # torchvision name, px, samples per window, device bytes
    python nbs/bench_preflight.py resnet50 224 16 492000000
    python nbs/bench_preflight.py resnet50 448 8 1200000000
    python nbs/bench_preflight.py resnet50 224 16 461979944     # naive's peak (ledger) with the optimizer's state added

fp32, micro-batch 2, policy 'auto', one window; prints the path, the chunks a stage is estimated to run in
(`ExactPlan.chunks_a_stage`), the plan's staged need against the budget and its predicted line (or why it did not stage).
"""
import sys, warnings
import torch, torchvision
import torch.nn.functional as F
from fastai_accum.core import Accumulation
from fastai_accum.helpers import emulated_accelerator
from fastai_accum.batchnorm import bn_layers
from fastai_accum.meters import fmt_bytes

def preflight(name:str, size:int, window:int, budget:int, classes:int=10) -> dict:
    "The plan of one window of torchvision `name` at `size` px under `budget` device bytes, emulated: its path and line."
    torch.manual_seed(0)
    net = getattr(torchvision.models, name)(num_classes=classes).train()
    acc = Accumulation(net, n_step=window // 2, policy='auto', device_memory=budget)
    x, y = torch.randn(window, 3, size, size), torch.randint(0, classes, (window,))
    with emulated_accelerator(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for xb, yb in acc.batches([(x[i:i + 2], y[i:i + 2]) for i in range(0, window, 2)]):
            acc.backward(F.cross_entropy(net(xb), yb))
            break
    p = acc.plan
    return dict(path=acc.path, chunks=p.chunks_a_stage(len(bn_layers(net)) + 1), need=p.staged_device_needed,
                budget=p.device_budget, predicted=p.predicted, reason=p.reason)

if __name__ == '__main__':
    name, size, window, budget = sys.argv[1], *map(int, sys.argv[2:5])
    r = preflight(name, size, window, budget)
    print(f"{name} {size} px, window {window}: path {r['path']!r}, chunks a stage (estimated) {r['chunks']:.2f}, "
          f"staged need {fmt_bytes(r['need'])} of {fmt_bytes(r['budget'])}")
    print(r['predicted'] or f"not staged: {r['reason']}")
