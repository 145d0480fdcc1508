"The 'exact' policy: each window trained as one batch is the big batch (parameters, BatchNorm statistics, fastai loop)."
import math
import pytest, torch
from torch import nn
from fastai.basics import Adam, SGD, Callback
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.training import GradientClip
import fastai.callback.schedule  # noqa: F401
from fastai_accum.all import *
from fastai_accum.batchnorm import bn_layers
from fastai_accum.exact import ExactModeMemoryError
from helpers import make_learner, bn_net, params, rel, CountSteps, counted_mixed_precision

def bn_stats(learn): return torch.cat([torch.cat([bn.running_mean, bn.running_var]) for bn in bn_layers(learn.model)])

def exact_and_big(n=70, micro=4, n_step=4, opt_func=SGD, acc_cbs=(), big_cbs=(), **ga_kw):
    "float64 learners: micro-batches of `micro` under the 'exact' policy, and the big batch micro * n_step."
    acc = make_learner(micro, bn_net, n=n, image=True, opt_func=opt_func, dtype=torch.float64, cbs=list(acc_cbs))
    big = make_learner(micro * n_step if n_step else ga_kw['n_acc'], bn_net, n=n, image=True, opt_func=opt_func, dtype=torch.float64, cbs=list(big_cbs))
    ga = GradientAccumulation(n_step=n_step, policy='exact', **ga_kw)
    acc.add_cb(ga)
    return acc, big, ga

@pytest.mark.parametrize('opt_func', [SGD, Adam], ids=['SGD', 'Adam'])
def test_exact_equals_big_batch_float64_with_ragged_last_window(opt_func):
    "70 samples, micro 4 x 4 vs bs 16: windows of 16 and a ragged last one of 6 (its last micro-batch has 2)."
    acc, big, ga = exact_and_big(opt_func=opt_func)
    acc.fit(2, lr=0.05); big.fit(2, lr=0.05)
    assert ga.exact and ga.steps == 2 * 5
    assert rel(params(acc), params(big)) <= 1e-6
    assert rel(bn_stats(acc), bn_stats(big)) <= 1e-6
    assert [bn.num_batches_tracked.item() for bn in bn_layers(acc.model)] == [10, 10]
    assert not any(isinstance(m, AccumulateBatchNorm) for m in acc.model.modules())  # BatchNorm stays plain
    assert torch.allclose(torch.tensor(acc.recorder.values), torch.tensor(big.recorder.values), rtol=1e-6)
    assert len(acc.recorder.losses) == len(big.recorder.losses) == 10  # one Recorder entry per window

def test_exact_with_n_acc_and_partial_drop():
    count = CountSteps()
    acc, big, ga = exact_and_big(n_step=None, n_acc=16, partial='drop', acc_cbs=[count])
    acc.fit(1, lr=0.05)
    assert count.steps == ga.steps == 70 // 16  # the 6-sample last window is dropped

def test_exact_mixed_precision_and_gradient_clip_once_per_window(monkeypatch):
    mp, steps, clips = counted_mixed_precision(monkeypatch)
    acc, big, ga = exact_and_big(acc_cbs=[mp, GradientClip(max_norm=0.05)],
                                 big_cbs=[MixedPrecision(amp_mode='bf16'), GradientClip(max_norm=0.05)])
    acc.fit(1, lr=0.05)
    assert len(steps) == len(clips) == 5
    big.fit(1, lr=0.05)
    assert rel(params(acc), params(big)) <= 1e-6

def test_exact_fit_one_cycle_fine_tune_lr_find():
    "Schedules tick once per window, as for the big batch: fit_one_cycle and fine_tune land on the big batch's weights."
    def splitter(m): return [list(m[:2].parameters()), list(m[2:].parameters())]
    acc = make_learner(4, bn_net, n=64, image=True, dtype=torch.float64, splitter=splitter, cbs=GradientAccumulation(n_step=4, policy='exact'))
    big = make_learner(16, bn_net, n=64, image=True, dtype=torch.float64, splitter=splitter)
    for l in (acc, big):
        l.fit_one_cycle(2, 1e-2)
        l.fine_tune(1, 1e-2, freeze_epochs=1)
    assert rel(params(acc), params(big)) <= 1e-6
    with _no_warning('num_it'):
        acc.lr_find(num_it=10, stop_div=False, show_plot=False)
    assert len(acc.recorder.lrs) == 10  # num_it counts optimizer steps (windows)

class _no_warning:
    "Fails if a warning containing `text` is raised inside."
    def __init__(self, text): self.text = text
    def __enter__(self):
        import warnings
        self.cm = warnings.catch_warnings(record=True); self.rec = self.cm.__enter__(); warnings.simplefilter('always')
    def __exit__(self, *exc):
        self.cm.__exit__(*exc)
        assert not [w for w in self.rec if self.text in str(w.message)]

def test_offloaded_saved_activations_give_the_same_step(monkeypatch):
    "offload=True moves saved activations to host memory (a copy on CPU): the step is unchanged."
    import fastai_accum.exact as ex
    entered = []
    orig = torch.autograd.graph.save_on_cpu
    monkeypatch.setattr(torch.autograd.graph, 'save_on_cpu', lambda **k: entered.append(k) or orig(**k))
    acc, big, ga = exact_and_big(offload=True)
    acc.fit(1, lr=0.05); big.fit(1, lr=0.05)
    assert ga.plan.offload and len(entered) == 5 and entered[0] == dict(pin_memory=False)
    assert rel(params(acc), params(big)) <= 1e-6

@pytest.mark.skipif(not hasattr(torch._C._autograd, '_top_saved_tensors_default_hooks'), reason='torch < 2.8 cannot list the hooks')
def test_interrupt_leaves_no_saved_tensor_hooks():
    class Stop(Callback):
        order = 100
        def after_pred(self): raise KeyboardInterrupt()
    acc, _, _ = exact_and_big(offload=True, acc_cbs=[Stop()])
    with pytest.raises(KeyboardInterrupt): acc.fit(1, lr=0.05)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None

def test_not_enough_memory_fails_before_training_with_the_numbers():
    acc, _, _ = exact_and_big(host_memory=1000)
    before = params(acc).clone()
    with pytest.raises(ExactModeMemoryError, match=r"window of 16 samples as one batch needs .* budget 1000 B"):
        acc.fit(1, lr=0.05)
    assert torch.equal(params(acc), before)

def test_auto_picks_exact_when_the_window_fits_else_window_bn(capsys):
    learn = make_learner(4, bn_net, image=True, cbs=GradientAccumulation(n_step=4))
    learn.fit(1, lr=0.01)
    assert learn.gradient_accumulation.exact
    assert "policy 'auto' -> 'exact'" in capsys.readouterr().out
    learn = make_learner(4, bn_net, image=True, cbs=GradientAccumulation(n_step=4, host_memory=1000))
    learn.fit(1, lr=0.01)
    assert not learn.gradient_accumulation.exact
    assert learn.gradient_accumulation.path == 'window'
    assert not any(isinstance(m, AccumulateBatchNorm) for m in learn.model.modules())  # wrapped for the fit only
    assert "policy 'auto' -> window BatchNorm" in capsys.readouterr().out

def test_peeking_the_first_batch_changes_nothing():
    "Memory is measured on one batch read before training: with shuffling and dropout the run still equals the big batch."
    import random
    def run(bs, cbs):
        learn = make_learner(bs, lambda: nn.Sequential(bn_net(), nn.Dropout(0.3)), image=True, dtype=torch.float64, cbs=cbs)
        learn.dls.train.shuffle, learn.dls.train.rng = True, random.Random(5)
        torch.manual_seed(1)
        learn.fit(2, lr=0.05)
        return params(learn)
    assert rel(run(4, GradientAccumulation(n_step=4, policy='exact')), run(16, None)) <= 1e-6

def test_wrapped_layers_train_exactly_under_exact():
    "Layers the user wrapped normalize the big batch with its own statistics, commit them once per window, and get their policy back."
    acc, big, ga = exact_and_big()
    wrap_bn(acc.model, 'window')
    acc.fit(1, lr=0.05); big.fit(1, lr=0.05)
    assert all(isinstance(m, AccumulateBatchNorm) and m.policy == 'window' for m in bn_layers(acc.model))
    assert rel(params(acc), params(big)) <= 1e-6 and rel(bn_stats(acc), bn_stats(big)) <= 1e-6

def _launch(mode, outdir):
    from dist_helpers import rank_results
    return rank_results('dist_exact_script.py', outdir, mode)

def test_auto_under_ddp_trains_the_same_way_on_every_rank(tmp_path):
    "Rank 1 can train its window neither whole nor staged: 'auto' then picks window BatchNorm on both ranks (no mismatch, no hang)."
    r0, r1 = _launch('auto_disagree', tmp_path/'auto')
    assert r0['exact'] is False and r1['exact'] is False
    assert r0['allreduces'] == r1['allreduces'] == 8
    for p0, p1 in zip(r0['params'], r1['params']): assert torch.equal(p0, p1)

def _union_reference():
    "One process training both ranks' windows as one batch of 16 (fastai's DistributedDL gives rank r the contiguous half r)."
    from fastai.basics import Learner, DataLoaders, DataLoader, SGD, MSELossFlat
    from torch.utils.data import TensorDataset
    from dist_helpers import data, bn_net
    x, y = data(image=True)
    # window k of rank r holds samples 32r + 8k ... 32r + 8k + 7 (micro-batches of 2 x 4): big batch k is both ranks' window k
    order = [i for k in range(4) for r in range(2) for i in range(32*r + 8*k, 32*r + 8*k + 8)]
    dls = DataLoaders(DataLoader(TensorDataset(x[order].double(), y[order].double()), bs=16),
                      DataLoader(TensorDataset(x[:8].double(), y[:8].double()), bs=16))
    torch.manual_seed(0)
    ref = Learner(dls, bn_net().double(), loss_func=MSELossFlat(), opt_func=SGD)
    with ref.no_bar(), ref.no_logging(): ref.fit(2, lr=0.05)
    return ref.model

@pytest.mark.parametrize('mode', ['exact', 'auto', 'staged', 'staged_aten'])
def test_exact_modes_under_ddp_equal_one_process_on_the_union(mode, tmp_path):
    """2 ranks (gloo), plain BatchNorm, micro 2 x 4: whole-window ('exact', and 'auto' where it fits) and staged exact train
    as one process on the union of the ranks' windows (SyncBatchNorm's semantics), float64; ranks bitwise equal. Per window:
    one gradient all-reduce, and per BatchNorm layer one all-gather (its statistics) and one all-reduce (its two backward sums)."""
    r0, r1 = _launch(mode, tmp_path/mode)
    assert r0['exact'] and r0['path'] == r1['path'] == 'staged exact'
    assert r0['chunk'] == (2 if mode.startswith('staged') else 8)
    assert r0['traced'] == r1['traced'] == ('aten' if mode == 'staged_aten' else None)  # the second tracer's graph
    ref = _union_reference()
    for p0, p1, pr in zip(r0['params'], r1['params'], ref.parameters()):
        assert torch.equal(p0, p1)
        assert ((p0 - pr.detach()).abs().max() / pr.detach().abs().max()).item() <= 1e-9
    for b0, b1, br in zip(r0['buffers'], r1['buffers'], ref.buffers()):
        assert torch.equal(b0, b1)
        assert ((b0.double() - br.double()).abs().max() / br.double().abs().max()).item() <= 1e-9
    assert r0['allreduces'] == r1['allreduces'] == 8  # 4 windows x 2 epochs, one bucket each
    n_bn = 2
    assert r0['collectives'] == r1['collectives'] == [1 + 2 * n_bn] * 8

def test_gpu_benchmark_script_runs_on_cpu():
    "nbs/bench_exact_gpu.py is for an accelerator; a tiny CPU run (its check on the CPU as an emulated accelerator) keeps it from rotting."
    import os, subprocess, sys
    from pathlib import Path
    script = Path(__file__).parents[1]/'nbs'/'bench_exact_gpu.py'
    r = subprocess.run([sys.executable, str(script), '--device', 'cpu', '--model', 'resnet18', '--size', '16', '--windows', '4',
                        '--reps', '1'], capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'exact_time_vs_naive_w4=' in r.stdout and 'estimate: device' in r.stdout
    assert 'staged_time_vs_naive_w4=' in r.stdout and 'host traffic:' in r.stdout and 'remade_time_vs_naive_w4=' in r.stdout
    assert r.stdout.count('-> ok') == 3 and 'FAILED' not in r.stdout  # staged and offloaded float64, staged fp16 + GradScaler

def test_exact_at_micro_batch_1_equals_big_batch():
    "Micro-batches of 1 sample (BatchNorm cannot train on them): 8 of them as one window equal a batch of 8."
    acc, big, ga = exact_and_big(n=64, micro=1, n_step=8)
    acc.fit(1, lr=0.05); big.fit(1, lr=0.05)
    assert ga.exact and rel(params(acc), params(big)) <= 1e-6 and rel(bn_stats(acc), bn_stats(big)) <= 1e-6

def test_gpu_benchmark_script_prints_the_staged_table_on_cpu():
    "`nbs/bench_exact_gpu.py --table` (issue #35's table, for an accelerator) on one tiny row on the CPU, to keep it from rotting."
    import os, subprocess, sys
    from pathlib import Path
    script = Path(__file__).parents[1]/'nbs'/'bench_exact_gpu.py'
    r = subprocess.run([sys.executable, str(script), '--table', '--no-check', '--device', 'cpu', '--windows', '2',
                        '--table-models', 'shufflenet_v2_x1_0', '--reps', '1'],
                       capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'time_vs_naive' in r.stdout and 'shufflenet_v2_x1_0' in r.stdout and 'total' in r.stdout
