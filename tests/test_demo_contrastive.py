"""The contrastive demo (issue #48, nbs/13_demo_contrastive.ipynb) on a tiny configuration, with the network off: its
table, the path ours took, and `fastai-accum demo contrastive` (its help in a subprocess, a run in this process)."""
import math, re, shutil, socket, subprocess, sys
from pathlib import Path
import pytest
from fastai_accum.lab.demo_contrastive import run_contrastive, contrastive_settings
from helpers import cli_command

TINY = dict(epochs=1, n_train=32, n_step=4, n_test=100)  # 8 micro-batches of 4 images: 2 windows of 4

@pytest.fixture
def no_network(monkeypatch):
    "Any internet connection fails (sklearn's digits ship with scikit-learn: none is needed)."
    connect = socket.socket.connect
    def refuse(sock, address):
        if isinstance(address, tuple): raise OSError(f'the network is off in this test: {address}')
        return connect(sock, address)
    monkeypatch.setattr(socket.socket, 'connect', refuse)

def test_tiny_run_table_and_path(no_network):
    res = run_contrastive(seeds=1, show_progress=False, **TINY)
    t = res.table
    assert list(t.setting) == ['random', 'bs16', 'naive', 'ours']
    assert list(t.columns) == ['setting', 'batch', 'path', 'probe', 'spread', 'per_seed', 'probe_few', 'spread_few',
                               'train_loss', 'valid_loss', 'time_s']
    assert list(t.batch) == ['-', '16', '4x4', '4x4']
    assert list(t.path) == ['', '', '', 'exact']  # on a CPU 'auto' trains each window as one batch
    assert len(res.runs) == 4 and res.config['seeds'] == [42] and set(contrastive_settings) == {'random', 'bs64', 'naive', 'ours'}
    assert t.probe.between(0, 1).all() and t.probe_few.between(0, 1).all()
    assert math.isnan(t.train_loss[0]) and t.train_loss[1:].notna().all()
    ours, big = (t[t.setting == s].iloc[0] for s in ('ours', 'bs16'))
    assert ours.train_loss == pytest.approx(big.train_loss, abs=1e-4)  # the big batch's loss, BatchNorm and step
    assert ours.valid_loss == pytest.approx(big.valid_loss, abs=1e-4) and ours.probe == big.probe
    assert res.markdown().splitlines()[0].startswith('| setting | batch | path | probe |')

def test_cli_help():
    r = subprocess.run(cli_command() + ['demo', 'contrastive', '--help'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'contrastive' in r.stdout and '--seeds' in r.stdout and 'fastai-accum demo contrastive' in r.stdout

def test_cli_tiny_run(no_network, tmp_path, capsys):
    from fastai_accum.lab.cli import main
    assert main(['demo', 'contrastive', '--epochs', '1', '--n-train', '32', '--n-step', '4', '--n-valid', '100',
                 '--seeds', '1', '--settings', 'bs64,ours', '--out', str(tmp_path), '--quiet']) == 0
    out = capsys.readouterr().out
    assert "ours seed 42: probe" in out and "path 'exact'" in out, out
    table = out[re.search(r'^\s*setting\s+batch', out, re.M).start():]
    assert [l.split()[0] for l in table.splitlines()[1:4]] == ['random', 'bs16', 'ours'], table
    assert (tmp_path/'demo_contrastive.png').exists()
