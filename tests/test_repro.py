"Reproducibility switch and divergence finder (`fastai_accum.repro`): CPU only, non-determinism injected by hand."
import math, os, subprocess, sys, warnings
from pathlib import Path
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai_accum.repro import (set_reproducible, reproducible, ReproReport, find_divergence, record_trace,
                                compare_traces, Trace, Divergence, env_fingerprint, EnvMismatchWarning,
                                divergence_advice, _save_state, _restore_state)

ROOT = Path(__file__).parents[1]

# Shared with the subprocesses of the cross-process test, hence a string.
HELPERS = r'''
import os
from collections import OrderedDict
import torch
from torch import nn
import torch.nn.functional as F

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
    # Linear + ReLU with run-to-run noise in one place: `forward` (its output), `backward` (the gradient at its
    # linear's output: its parameter gradients change), `input_grad` (only the gradient sent back to its input), or None.
    def __init__(self, ni, no, where=None):
        super().__init__()
        self.lin, self.where = nn.Linear(ni, no), where
    def forward(self, x):
        if self.where == 'input_grad': x = NoisyGrad.apply(x)
        out = self.lin(x)
        if self.where == 'forward': out = out + os_noise(torch.ones_like(out))
        if self.where == 'backward': out = NoisyGrad.apply(out)
        return F.relu(out)

class NoisyReLU(nn.Module):
    "A parameter-free module whose backward is non-deterministic."
    def forward(self, x): return F.relu(NoisyGrad.apply(x))

def make_model(where=None):
    "Nested multi-layer model; the noise (if any) is in `body.1`. Has dropout, BatchNorm and an in-place ReLU."
    torch.manual_seed(0)
    mid = NoisyReLU() if where == 'act' else Injected(16, 16, where)
    body = nn.Sequential(nn.Linear(8, 16), mid, nn.Dropout(0.2), nn.Linear(16, 16), nn.ReLU(inplace=True))
    return nn.Sequential(OrderedDict(body=body, bn=nn.BatchNorm1d(16), head=nn.Linear(16, 1)))

def make_batch(bs=16):
    g = torch.Generator().manual_seed(2)
    return torch.randn(bs, 8, generator=g), torch.randn(bs, 1, generator=g)
'''
exec(HELPERS)


@pytest.fixture(autouse=True)
def restore_global_state():
    "set_reproducible changes process-wide flags: put them back after each test."
    s = _save_state()
    yield
    _restore_state(s)


# --- the finder ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('where,direction', [('forward', 'forward'), ('backward', 'backward'),
                                             ('input_grad', 'backward'), ('act', 'backward')])
def test_finder_names_injected_module_and_direction(where, direction):
    d = find_divergence(make_model(where), make_batch(), nn.MSELoss())
    assert d.found and bool(d)
    assert (d.module, d.direction, d.step) == ('body.1', direction, 0), d
    assert d.module_type == ('NoisyReLU' if where == 'act' else 'Injected')
    assert 0 < d.max_abs < 1e-3 and 0 < d.max_rel < 1e-4 and d.exact
    assert d.advice and d.what and d.n_differing >= 1
    assert 'body.1' in repr(d) and direction in repr(d) and '|' in d._repr_markdown_()


def test_finder_with_optimizer_steps_reports_first_step():
    d = find_divergence(make_model('backward'), make_batch(), nn.MSELoss(),
                        opt=lambda ps: torch.optim.SGD(ps, lr=0.1), n_steps=3)
    assert (d.module, d.direction, d.step) == ('body.1', 'backward', 0)
    assert d.n_differing > 20  # the noise spreads to everything downstream, later steps included


def test_clean_model_reports_no_divergence():
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    d = find_divergence(model, make_batch(), nn.MSELoss(), opt=opt, n_steps=2)
    assert not d.found and not d and d.n_records > 40
    assert repr(d).startswith('no divergence') and 'no divergence' in d._repr_markdown_()
    assert len(opt.state) == 0  # the optimizer is put back as it was


def test_record_trace_leaves_model_rng_and_hooks_untouched():
    model = make_model('forward')
    model.eval()
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5); expected = torch.rand(3); torch.manual_seed(5)
    tr = record_trace(model, make_batch(), nn.MSELoss(), opt=lambda ps: torch.optim.SGD(ps, lr=1.), n_steps=2)
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(v, w0[k]) for k, v in model.state_dict().items())
    assert not any(m.training for m in model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert {r['direction'] for r in tr.records} == {'init', 'forward', 'backward', 'optimizer'}


def test_summaries_for_big_tensors(tmp_path):
    d = find_divergence(make_model('backward'), make_batch(), nn.MSELoss(), full_numel=0)
    assert (d.module, d.direction) == ('body.1', 'backward') and not d.exact and d.max_abs > 0
    assert 'lower bound' in repr(d)
    tr = record_trace(make_model(), make_batch(), nn.MSELoss(), full_numel=0, fname=tmp_path/'s.pt')
    assert isinstance(Trace.load(tmp_path/'s.pt').records[-1]['value'], dict)
    assert not find_divergence(make_model(), make_batch(), nn.MSELoss(), full_numel=0).found


def test_tolerance():
    d = find_divergence(make_model('backward'), make_batch(), nn.MSELoss(), rtol=1e-4)
    assert not d.found and 'within' in repr(d)


def test_different_shapes_are_reported_with_advice():
    a = record_trace(make_model(), make_batch(16), nn.MSELoss())
    b = record_trace(make_model(), make_batch(8), nn.MSELoss())
    d = compare_traces(a, b)
    assert d.found and math.isnan(d.max_abs) and d.module == '<data>' and 'different shapes' in d.advice


def test_advice_maps_causes_to_fixes():
    assert 'cudnn.deterministic=True' in divergence_advice('backward', 'conv', 'Conv2d')
    assert 'use_deterministic_algorithms' in divergence_advice('backward', 'up', 'Upsample')
    assert 'use_deterministic_algorithms' in divergence_advice('backward', 'emb', 'Embedding')
    assert 'seed' in divergence_advice('forward', 'drop', 'Dropout')
    assert 'by design' in divergence_advice('forward', 'bn', 'BatchNorm2d')
    assert 'initialised differently' in divergence_advice('init', 'lin', 'Linear')
    assert 'set_reproducible(seed)' in divergence_advice('backward', 'lin', 'Linear', env_fingerprint())


# --- fastai Learner -----------------------------------------------------------------------------------------------

def tiny_learner(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g); y = x.sum(1, keepdim=True) + 0.1 * torch.randn(96, 1, generator=g)
    dls = DataLoaders.from_dsets(TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:]), bs=16)
    return Learner(dls, model, loss_func=nn.MSELoss(), lr=1e-2)


def test_finder_on_learner():
    learn = tiny_learner(make_model('backward'))
    with learn.no_logging(): learn.fit(1)
    opt, losses, rng = learn.opt, list(learn.recorder.losses), learn.dls.train.rng.getstate()
    w0 = {k: v.clone() for k, v in learn.model.state_dict().items()}
    cbs = list(learn.cbs)
    d = find_divergence(learn, n_steps=2)
    assert (d.module, d.direction, d.step) == ('body.1', 'backward', 0)
    assert list(learn.cbs) == cbs and learn.opt is opt and learn.recorder.losses == losses
    assert learn.dls.train.rng.getstate() == rng
    assert all(torch.equal(v, w0[k]) for k, v in learn.model.state_dict().items())
    assert not find_divergence(tiny_learner(make_model()), n_steps=2).found


# --- two processes ------------------------------------------------------------------------------------------------

CHILD = HELPERS + r'''
import sys
from fastai_accum.repro import record_trace
x, y = make_batch()
record_trace(make_model('backward'), (x, y), nn.MSELoss(), n_steps=2,
             opt=lambda ps: torch.optim.SGD(ps, lr=0.1), fname=sys.argv[1] + '.noisy.pt')
record_trace(make_model(), (x, y), nn.MSELoss(), n_steps=2,
             opt=lambda ps: torch.optim.SGD(ps, lr=0.1), fname=sys.argv[1] + '.clean.pt')
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


def test_environment_mismatch_warns_with_fields(tmp_path):
    a = record_trace(make_model(), make_batch(), nn.MSELoss(), fname=tmp_path/'a.pt')
    b = Trace.load(tmp_path/'a.pt')
    b.env = {**b.env, 'torch': '1.0.0', 'cudnn': 1234}
    with pytest.warns(EnvMismatchWarning, match='torch.*cudnn'):
        d = compare_traces(a, b)
    assert not d.found and set(d.env_diff) == {'torch', 'cudnn'} and 'environments differ' in repr(d)


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


def test_set_reproducible_reseeds_pytorch_dataloader():
    dl = torch.utils.data.DataLoader(list(range(20)), batch_size=5, shuffle=True)
    set_reproducible(1, dls=dl); a = [b.tolist() for b in dl]
    set_reproducible(1, dls=dl); b = [b.tolist() for b in dl]
    assert a == b


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

def test_find_divergence_on_learner_with_gradient_accumulation_is_clean():
    "The finder replays one fixed batch: GradientAccumulation (whose window pre-pass reads other batches) is left out."
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from fastai.basics import Learner, DataLoaders, DataLoader, CrossEntropyLossFlat
    from fastai_accum.all import GradientAccumulation, find_divergence
    x = torch.randn(64, 3, 8, 8); y = (x.mean((1, 2, 3)) > 0).long()
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=4, shuffle=True), DataLoader(TensorDataset(x, y), bs=64))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=GradientAccumulation(n_step=4))
    d = find_divergence(learn)
    assert 'no divergence' in str(d).lower()
