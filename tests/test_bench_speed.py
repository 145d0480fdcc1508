"""The speed/memory/communication benchmark end to end: a tiny run with its 2-process all-reduce count, and the module
run as a script. Its parts (meters, leak, variants, summary line, options) are checked in nbs/21_bench_speed.ipynb."""
import math, subprocess, sys
from pathlib import Path
import pytest
from fastai_accum.lab.bench_speed import bench_speed, parse_summary, summary_keys

ROOT = Path(__file__).parents[1]

def test_tiny_bench_speed_gives_every_summary_key_finite():
    res = bench_speed(models='small_cnn', micro_bs=2, n_step=4, repeats=1, windows=1, leak_micro=16, comm=True,
                      prepass_models='small_cnn', prepass_windows=(16, 64), prepass_size=32,
                      staged_models='small_cnn', staged_windows=(8,), staged_size=32)
    assert set(res.summary) == set(summary_keys)
    for k in summary_keys: assert math.isfinite(res[k]), (k, res[k], res.notes)
    assert res['allreduce_per_window'] == 1.0
    assert res['leak_bytes_per_1000'] == 0.0
    assert res['memory_ratio_vs_full'] < 0.5 and 0.9 < res['memory_ratio_vs_micro'] < 1.2
    assert 0 < res['prepass_memory_ratio'] <= 1.0  # the pre-pass stays within training's footprint
    assert res.raw['prepass']['small_cnn/64']['mode'] == 'staged'
    assert 0 < res['staged_memory_ratio'] <= 1.0 and res['staged_time_ratio'] > 0  # a staged step holds less than a micro-batch step
    assert 0 < res['staged_fit_budget_ratio'] <= 1.0  # a whole fit through Accumulation(device_memory=) within it
    assert 'traced by torch.fx in' in res.report()  # which tracer gave the staged graph, and its time
    report = res.report().splitlines()
    assert report[-1] == res.summary_line() and parse_summary(report[-1]) == pytest.approx(
        {k: round(v, 3) for k, v in res.summary.items()}, abs=1e-3)

def test_module_runs_as_a_script():
    r = subprocess.run([sys.executable, '-m', 'fastai_accum.lab.bench_speed', '--help'], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '--quick' in r.stdout and '--n-step' in r.stdout

def test_staged_table_matches_naive_memory_and_explains_its_time(capsys):
    "`bench speed --staged-table` (one small row): staged exact within naive accumulation's device peak, every column there, the profile's shares adding up."
    import argparse
    from fastai_accum.lab.bench_speed import add_speed_args, speed_main, staged_table
    t = staged_table(['resnet18'], [4], micro=2, size=32, reps=1, verbose=False)
    r = t.loc[('resnet18', 4)]
    assert r['memory_vs_naive'] <= 1.0 and r['staged_MiB'] > 0 and r['whole_MiB'] > 0
    assert abs(r['compute %'] + r['BatchNorm passes %'] + r['copies %'] + r['other %'] - 100) < 1e-6
    args = add_speed_args(argparse.ArgumentParser()).parse_args(['--staged-table', '--staged-models', 'shufflenet_v2_x1_0',
                                                                 '--staged-windows', '2', '--device', 'cpu'])
    assert speed_main(args) == 0 and 'time_vs_naive' in capsys.readouterr().out
