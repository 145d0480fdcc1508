"""What the reproducibility notebooks cannot check: traces written by two processes (`fastai_accum.divergence`), and
`set_reproducible` (`fastai_accum.repro`) with DataLoader worker processes. The rest is specified in nbs/05_repro and
nbs/05a_divergence. CPU only, non-determinism injected by hand."""
import os, subprocess, sys, warnings
from pathlib import Path
import pytest
import torch
from torch import nn
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai_accum.repro import set_reproducible, reproducible, ReproReport, _save_state, _restore_state
from fastai_accum.divergence import compare_traces, Trace, EnvMismatchWarning

ROOT = Path(__file__).parents[1]


@pytest.fixture(autouse=True)
def restore_global_state():
    "set_reproducible changes process-wide flags: put them back after each test."
    s = _save_state()
    yield
    _restore_state(s)


# --- two processes ------------------------------------------------------------------------------------------------

# Each child records a noisy and a clean run (the noise, as in nbs/05a_divergence, comes from the OS: no seed controls it).
CHILD = r'''
import os, sys
from collections import OrderedDict
import torch
from torch import nn
import torch.nn.functional as F
from fastai_accum.divergence import record_trace

def os_noise(t):
    "Relative noise of 1e-6 from the OS entropy pool: no seed controls it (like the order of atomic adds on a GPU)."
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), 'little'))
    return t * 1e-6 * torch.randn(t.shape, generator=g, dtype=t.dtype)

class NoisyGrad(torch.autograd.Function):
    "Identity with a non-deterministic backward."
    @staticmethod
    def forward(ctx, x): return x.clone()
    @staticmethod
    def backward(ctx, g): return g + os_noise(g)

class Injected(nn.Module):
    "Linear + ReLU; with `noisy=True` the gradient at its linear's output gets run-to-run noise."
    def __init__(self, ni, no, noisy=False):
        super().__init__()
        self.lin, self.noisy = nn.Linear(ni, no), noisy
    def forward(self, x):
        out = self.lin(x)
        return F.relu(NoisyGrad.apply(out) if self.noisy else out)

def make_model(noisy=False):
    "Nested model with dropout, BatchNorm and an in-place ReLU; the noise (if any) is in `body.1`."
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 16), Injected(16, 16, noisy), nn.Dropout(0.2), nn.Linear(16, 16), nn.ReLU(inplace=True))
    return nn.Sequential(OrderedDict(body=body, bn=nn.BatchNorm1d(16), head=nn.Linear(16, 1)))

g = torch.Generator().manual_seed(2)
x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
for run, noisy in (('noisy', True), ('clean', False)):
    record_trace(make_model(noisy), (x, y), nn.MSELoss(), n_steps=2,
                 opt=lambda ps: torch.optim.SGD(ps, lr=0.1), fname=f'{sys.argv[1]}.{run}.pt')
'''

def test_cross_process_traces(tmp_path):
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}  # the two children run side by side on 2 cores
    procs = [subprocess.Popen([sys.executable, '-c', CHILD, str(tmp_path/run)], cwd=ROOT, text=True, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for run in 'ab']
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    with warnings.catch_warnings():
        warnings.simplefilter('error', EnvMismatchWarning)  # same machine, same environment: no warning
        d = compare_traces(tmp_path/'a.noisy.pt', tmp_path/'b.noisy.pt')
        clean = compare_traces(tmp_path/'a.clean.pt', tmp_path/'b.clean.pt')
    assert (d.module, d.direction, d.step) == ('body.1', 'backward', 0), d
    assert not clean.found and clean.n_records > 40
    ea, eb = Trace.load(tmp_path/'a.clean.pt').env, Trace.load(tmp_path/'b.clean.pt').env
    assert ea == eb and ea['torch'] == torch.__version__ and ea['num_threads'] == 1


# --- set_reproducible ---------------------------------------------------------------------------------------------

class AugDS:
    "Items with random augmentation: drawn in the DataLoader workers, so worker seeding matters."
    def __init__(self, x, y): self.x, self.y = x, y
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return self.x[i] + 0.1 * torch.randn(self.x.shape[1]), self.y[i]

def worker_dls():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 8, generator=g); y = 2 * x[:, :1] + 0.1 * torch.randn(128, 1, generator=g)
    return DataLoaders(DataLoader(AugDS(x[:96], y[:96]), bs=16, shuffle=True, drop_last=True, num_workers=2),
                       DataLoader(AugDS(x[96:], y[96:]), bs=16, num_workers=2))

def fit_weights(dls):
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    learn = Learner(dls, model, loss_func=nn.MSELoss(), lr=1e-2)
    with learn.no_logging(): learn.fit(2)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_set_reproducible_fastai_fits_bitwise_identical():
    ws = []
    for _ in range(2):
        set_reproducible(0)
        ws.append(fit_weights(worker_dls()))
    assert torch.equal(ws[0], ws[1])
    assert not torch.equal(ws[0], fit_weights(worker_dls()))  # without the switch: different shuffle, dropout, noise


def test_set_reproducible_reseeds_existing_dataloaders():
    dls = worker_dls()
    rep = set_reproducible(3, dls=dls)
    w1 = fit_weights(dls)
    assert rep.n_dataloaders == 2 and 're-seeded' in repr(rep)
    set_reproducible(3, dls=dls)
    assert torch.equal(fit_weights(dls), w1)
    set_reproducible(3)  # the same DataLoaders, not re-seeded: their RNGs moved on
    assert not torch.equal(fit_weights(dls), w1)


def test_report_and_context_manager_restore(monkeypatch):
    monkeypatch.delenv('CUBLAS_WORKSPACE_CONFIG', raising=False)
    monkeypatch.delenv('PYTHONHASHSEED', raising=False)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    dls = worker_dls()
    rng0 = dls.train.rng.getstate()
    torch.manual_seed(123); expected = torch.rand(3); torch.manual_seed(123)
    with reproducible(7, warn_only=True, dls=dls) as rep:
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        if torch.version.cuda: assert os.environ['CUBLAS_WORKSPACE_CONFIG'] == ':4096:8'
        torch.rand(10); next(iter(dls.train))
    assert isinstance(rep, ReproReport) and rep.seed == 7 and rep.warn_only and rep.n_dataloaders == 2
    assert rep.pythonhashseed is None and any('PYTHONHASHSEED=7' in n for n in rep.notes)
    assert 'use_deterministic_algorithms(True, warn_only=True)' in repr(rep) and rep._repr_markdown_()
    assert not torch.are_deterministic_algorithms_enabled()
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (False, True)
    assert 'CUBLAS_WORKSPACE_CONFIG' not in os.environ
    assert torch.equal(torch.rand(3), expected)
    assert dls.train.rng.getstate() == rng0 and 'generator' not in dls.train.fake_l.__dict__
