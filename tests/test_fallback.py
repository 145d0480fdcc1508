"""The fallback never worse than doing nothing (issue #58): 'window' against naive accumulation on the patterns that
broke it, float64 against torch's plain big batch; the fallback always said; refusals by their real reason."""
import copy, subprocess, sys, warnings
import pytest, torch
from torch import nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from fastai_accum.core import Accumulation
from fastai_accum.exact import ExactModeMemoryError, ExactModeRefusedError
from fastai_accum.batchnorm import bn_layers
from fastai_accum.lab.bench_fallback import (fallback_cases, layer_errors, worse_than_naive, largest_gradients,
                                             DropPathNet, untracked_then_tracked)

@pytest.mark.parametrize('case', ['bn1d_few_values', 'untracked_bn', 'drop_path_8px'])
def test_window_never_further_from_the_big_batch_than_naive(case):
    "Every parameter's gradient error (second window) at most naive accumulation's, beyond a thousandth of the largest."
    c = fallback_cases[case]
    e = layer_errors(c.model, *c.data(), c.loss, c.bs, c.n_step)
    assert len(worse_than_naive(e)) == 0, e
    assert e.window.sum() <= e.naive.sum()

def test_bn1d_few_values_keeps_batchnorms_invariances():
    "The head's gradients are the big batch's; the bias before the BatchNorm1d gets none (BatchNorm is shift invariant)."
    c = fallback_cases['bn1d_few_values']
    e = layer_errors(c.model, *c.data(), c.loss, c.bs, c.n_step).set_index('param')
    assert e.loc[['1.weight', '1.bias', '3.weight', '3.bias'], 'window'].max() <= 1e-12
    assert e.loc['0.bias', 'window'] <= 1e-12  # its true gradient is 0 (shift invariance); before: 0.17

def test_random_masks_do_not_diverge():
    "Drop-path and dropout at random, 8 values per channel in the last stage: no blow-up that naive does not have."
    x, y = fallback_cases['drop_path_4px'].data()
    g = largest_gradients(DropPathNet, x, y, F.cross_entropy, 2, 8, steps=24)
    assert torch.isfinite(torch.tensor(g.window.values)).all()
    assert g.window.max() <= 4 * max(g.naive.max(), g.big.max()), g

def test_untracked_layer_normalizes_with_the_window_and_the_next_commits_the_big_batchs_statistics():
    torch.manual_seed(0)
    model = untracked_then_tracked().double()
    big = copy.deepcopy(model).train()
    xs = [torch.randn(2, 3, 10, 10, dtype=torch.float64) for _ in range(4)]
    big(torch.cat(xs))
    acc = Accumulation(model.train(), n_step=4, policy='window')
    tables = []
    for xb in acc.batches(xs):
        if not tables: tables.append(acc.preflight_table((xb,)))
        acc.backward(model(xb).sum())
    tracked = [(a, b) for a, b in zip(bn_layers(model), bn_layers(big)) if b.track_running_stats]
    for a, b in tracked:
        torch.testing.assert_close(a.running_mean, b.running_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a.running_var, b.running_var, rtol=1e-10, atol=1e-12)
    assert bn_layers(model)[0].running_mean is None
    assert tables[0].forward.tolist() == ['window stats'] * 2

def _net():
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 2))

def _loader(n=64):
    data = torch.utils.data.TensorDataset(torch.randn(n, 1, 12, 12), torch.randint(0, 2, (n,)))
    return torch.utils.data.DataLoader(data, batch_size=2)

def test_plain_loop_fallback_warns_once_with_its_reason_and_repr_says_it():
    model = _net()
    acc = Accumulation(model, n_step=8, device_memory=10_000)  # defaults otherwise: preflight=False
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(2):
            for xb, yb in acc.batches(_loader()): acc.backward(F.cross_entropy(model(xb), yb))
    said = [str(x.message) for x in w if 'not the big batch' in str(x.message)]
    assert len(said) == 1 and "policy 'auto' trains 'window'" in said[0] and 'device_memory=' in said[0], said
    assert 'not the big batch: ' in repr(acc) and acc.plan.reason in repr(acc)

def test_exact_path_gives_no_fallback_warning():
    model = _net()
    acc = Accumulation(model, n_step=8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for xb, yb in acc.batches(_loader(16)): acc.backward(F.cross_entropy(model(xb), yb))
    assert acc.exact and not [x for x in w if 'not the big batch' in str(x.message)]

def test_budget_below_the_models_own_bytes_is_named():
    model = _net()
    acc = Accumulation(model, n_step=8, device_memory=1)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for xb, yb in acc.batches(_loader(16)): acc.backward(F.cross_entropy(model(xb), yb))
    assert 'the model alone' in acc.plan.reason and 'no exact path can fit it' in acc.plan.reason

def test_staged_step_over_the_whole_window_says_why():
    "Small inputs and a big head: a staged step needs more than the whole window, and 'auto' says so."
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 12 * 12, 512), nn.ReLU(), nn.Linear(512, 2))
    probe = Accumulation(model, n_step=8, policy='exact')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for xb, yb in probe.batches(_loader(16)): probe.backward(F.cross_entropy(model(xb), yb)); break
    whole = probe.plan.device_needed
    probe.release()
    acc = Accumulation(model, n_step=8, device_memory=whole - 1)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for xb, yb in acc.batches(_loader(16)): acc.backward(F.cross_entropy(model(xb), yb))
    assert not acc.exact and 'more than the whole window as one batch' in acc.plan.reason, acc.plan.reason

class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    def forward(self, x): return self.head(checkpoint(self.block, x, use_reentrant=False))

def test_a_refusal_that_is_not_about_memory_is_not_a_memory_error():
    model = _Checkpointed()
    acc = Accumulation(model, n_step=4, policy='staged')
    with pytest.raises(ExactModeRefusedError, match='checkpointing') as e:
        for xb, yb in acc.batches(_loader(8)): acc.backward(F.cross_entropy(model(xb), yb))
    assert not isinstance(e.value, MemoryError)
    acc = Accumulation(_net(), n_step=4, policy='staged', device_memory=1)
    with pytest.raises(ExactModeMemoryError):
        for xb, yb in acc.batches(_loader(8)): acc.backward(F.cross_entropy(acc.model(xb), yb))

def test_importing_the_package_alone_leaves_fastai_star_imports_and_all_rebinds_them():
    "What the README says of the import, in a fresh interpreter."
    code = ("import fastai_accum, fastai.callback.all as fa, fastai.callback.training as t\n"
            "assert fa.GradientAccumulation is t.GradientAccumulation\n"
            "from fastai_accum.all import *\n"
            "import fastai.vision.all as va\n"
            "assert fa.GradientAccumulation is GradientAccumulation and va.GradientAccumulation is GradientAccumulation\n"
            "assert t.GradientAccumulation is not GradientAccumulation\n")
    subprocess.run([sys.executable, '-c', code], check=True)

def test_window_preflight_names_the_modules_that_draw_random_masks(capsys):
    model = DropPathNet()
    acc = Accumulation(model, n_step=4, policy='window', preflight=True)
    data = [(torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for xb, yb in acc.batches(data): acc.backward(F.cross_entropy(model(xb), yb))
    out = capsys.readouterr().out
    assert "4 module(s) draw random masks (b1.drop, b2.drop, b3.drop, ...): the pre-pass draws its own" in out
