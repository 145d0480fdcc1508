"The speed/memory/communication benchmark: its meters measure what they claim, the seed leaks and ours does not."
import argparse, math, re, subprocess, sys
from pathlib import Path
import pytest, torch
from torch import nn
from fastai_accum.bench_speed import (SavedTensorMeter, add_speed_args, bench_speed, default_policy, format_summary,
                                      leak_per_1000, parse_summary, small_cnn, speed_variants, summary_keys,
                                      tensor_bytes_alive)

ROOT = Path(__file__).parents[1]

def tiny_net(): return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                     nn.Linear(4 * 8 * 8, 2))

def test_saved_bytes_scale_with_the_batch_and_are_freed_by_backward():
    net, peaks = tiny_net(), {}
    for bs in (2, 16):
        with SavedTensorMeter(net) as m:
            loss = net(torch.randn(bs, 3, 8, 8)).sum()
            assert m.live == m.peak > 0
            loss.backward()
        assert m.live == 0
        peaks[bs] = m.peak
    assert 7.5 <= peaks[16] / peaks[2] <= 8.5, peaks

def test_meter_skips_parameters_and_counts_shared_storage_once():
    lin = nn.Linear(10, 10, bias=False)
    x = torch.randn(4, 10, requires_grad=True)  # so that the weight is saved too (for x's gradient)
    with SavedTensorMeter(lin) as m: y = lin(x)
    assert m.peak == x.nbytes  # the input only, not the weight
    with SavedTensorMeter() as m2: lin(x)
    assert m2.peak == x.nbytes + lin.weight.nbytes
    with SavedTensorMeter() as m3: z = x * x  # x saved twice, one storage
    assert m3.peak == x.nbytes

def test_meter_sees_a_graph_that_stays_alive():
    net = tiny_net()
    with SavedTensorMeter(net) as m: out = net(torch.randn(2, 3, 8, 8))
    assert m.live == m.peak > 0
    before = tensor_bytes_alive(m.storages)
    del out
    assert m.live == 0
    assert tensor_bytes_alive(m.storages) < before

def test_seed_leaks_ours_does_not():
    pol = default_policy()
    leaks = {v: leak_per_1000(v, small_cnn, 2, 4, 24) for v in ('plain', 'seed', 'ours:micro', 'ours:exact', f'ours:{pol}')}
    assert leaks['ours:micro'] == leaks['plain'], leaks
    # fastai's Recorder keeps one loss tensor per iteration; under 'exact' ('auto' here) an iteration is a window
    assert leaks['ours:exact'] == leaks[f'ours:{pol}'] == leaks['plain'] / 4, leaks
    assert leaks['seed'] - leaks['plain'] > 1e6, leaks  # the BatchNorm inputs of every micro-batch stay alive

def test_variants_cover_every_policy_and_the_default():
    from fastai_accum.batchnorm import bn_policies
    vs = speed_variants()
    assert vs[:3] == ['plain', 'naive', 'seed']
    assert {f'ours:{p}' for p in bn_policies if p != 'auto'} | {'ours:exact'} <= set(vs)  # 'auto' runs one of them

def test_tiny_bench_speed_gives_every_summary_key_finite():
    res = bench_speed(models='small_cnn', micro_bs=2, n_step=4, repeats=1, windows=1, leak_micro=16, comm=True,
                      prepass_models='small_cnn', prepass_windows=(16, 64), prepass_size=32)
    assert set(res.summary) == set(summary_keys)
    for k in summary_keys: assert math.isfinite(res[k]), (k, res[k], res.notes)
    assert res['allreduce_per_window'] == 1.0
    assert res['leak_bytes_per_1000'] == 0.0
    assert res['memory_ratio_vs_full'] < 0.5 and 0.9 < res['memory_ratio_vs_micro'] < 1.2
    assert 0 < res['prepass_memory_ratio'] <= 1.0  # the pre-pass stays within training's footprint
    assert res.raw['prepass']['small_cnn/64']['mode'] == 'staged'
    report = res.report().splitlines()
    assert report[-1] == res.summary_line() and parse_summary(report[-1]) == pytest.approx(
        {k: round(v, 3) for k, v in res.summary.items()}, abs=1e-3)

def test_summary_line_format():
    line = format_summary(dict(zip(summary_keys, [1.23456, 1.0, 0.125, 0, 1, 1.3, 0.8])))
    num = r'-?\d+\.\d{3}'
    assert re.fullmatch(' '.join(f'{k}={num}' for k in summary_keys), line), line
    assert parse_summary(line)['overhead_ratio'] == 1.235
    with pytest.raises(ValueError): parse_summary('memory_ratio_vs_micro=1.0 overhead_ratio=1.0')

def test_cli_arguments():
    a = add_speed_args(argparse.ArgumentParser()).parse_args([])
    assert (a.quick, a.models, a.micro_bs, a.n_step, a.repeats, a.no_comm) == (False, 'small_cnn,resnet18', 2, 8, None, False)
    assert a.device == ('cuda' if torch.cuda.is_available() else 'cpu')
    with pytest.raises(SystemExit): add_speed_args(argparse.ArgumentParser()).parse_args(['--device', 'tpu'])

def test_module_runs_as_a_script():
    r = subprocess.run([sys.executable, '-m', 'fastai_accum.bench_speed', '--help'], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '--quick' in r.stdout and '--n-step' in r.stdout
