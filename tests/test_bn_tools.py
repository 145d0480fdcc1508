"BatchNorm tools: precise_bn against a float64 reference and against stale EMA statistics; BN converters."
import copy, os, socket, warnings
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import update_bn
from fastai.callback.training import ShortEpochCallback
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.metrics import accuracy
from fastai.torch_core import set_seed
from fastai_accum.batchnorm import bn_layers, wrap_bn
from fastai_accum.bn_tools import (precise_bn, PreciseBN, FrozenBatchNorm, bn_to_frozen, frozen_to_bn,
                                   bn_to_groupnorm)


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    "Tiny tensors: one intra-op thread is faster, and far faster when other test runs share the 2 cores."
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def small_cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                         nn.ReLU(), nn.Linear(8, 3))

def drifting_batches(n=10, seed=0):
    "Batches of unequal size whose means drift, as from an unshuffled loader over sorted data."
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2 + i % 5, 3, 10, 10, generator=g) * (1 + 0.2*i) + 0.4*i for i in range(n)]

def reference_stats(model, batches):
    "Float64 mean / unbiased var of each BN layer's input over all batches (cat), in a train-mode pass of a copy."
    model, caps = copy.deepcopy(model).train(), {}
    hooks = [m.register_forward_pre_hook(lambda m, a: caps.setdefault(m, []).append(a[0].double()))
             for m in bn_layers(model)]
    with torch.no_grad():
        for b in batches: model(b[0] if isinstance(b, (tuple, list)) else b)
    for h in hooks: h.remove()
    out = []
    for xs in caps.values():
        x = torch.cat(xs); dims = [d for d in range(x.dim()) if d != 1]
        out.append((x.mean(dims), x.var(dims)))
    return out

def assert_matches_reference(model, ref, rtol=1e-5):
    layers = bn_layers(model)
    assert len(layers) == len(ref)
    for m, (mean, var) in zip(layers, ref):
        assert ((m.running_var.double() - var).abs() / var).max() <= rtol
        assert ((m.running_mean.double() - mean).abs() / var.sqrt()).max() <= rtol


@pytest.mark.parametrize('wrapped', [False, True])
def test_precise_bn_equals_float64_reference(wrapped):
    torch.manual_seed(0)
    model, batches = small_cnn(), drifting_batches()
    ref = reference_stats(model, batches)
    if wrapped: wrap_bn(model)
    model.eval()
    model[4].momentum = None
    nbt = [m.num_batches_tracked.clone() for m in bn_layers(model)]
    assert precise_bn(model, [(b, torch.zeros(len(b))) for b in batches], show_progress=False) == 3
    assert_matches_reference(model, ref)
    # state restored: eval flags, momentum, tracking, counts; no gradients; nothing pending in wrapped layers
    assert not any(m.training for m in model.modules())
    assert model[4].momentum is None and model[1].momentum == 0.1
    assert all(m.track_running_stats for m in bn_layers(model))
    assert [m.num_batches_tracked for m in bn_layers(model)] == nbt
    assert all(p.grad is None for p in model.parameters())
    if wrapped: assert [m.pending.count for m in bn_layers(model)] == [0, 0, 0]


def test_precise_bn_differs_from_update_bn():
    "update_bn averages per-batch variances: it misses the variance between batch means; we do not."
    torch.manual_seed(0)
    model, batches = small_cnn(), drifting_batches()
    ref = reference_stats(model, batches)
    swa = copy.deepcopy(model)
    update_bn(batches, swa)
    rel = ((swa[1].running_var.double() - ref[0][1]).abs() / ref[0][1]).max()
    assert rel > 0.1
    precise_bn(model, batches, show_progress=False)
    assert_matches_reference(model, ref)


def test_precise_bn_n_batches_train_mode_and_errors():
    torch.manual_seed(0)
    model, batches = small_cnn().train(), drifting_batches()
    precise_bn(model, batches, n_batches=4, show_progress=False)
    assert_matches_reference(model, reference_stats(model, batches[:4]))
    assert all(m.training for m in model.modules())
    # train_mode: dropout active during the pass, restored afterwards
    drop = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Dropout(0.5), nn.BatchNorm2d(4)).eval()
    torch.manual_seed(1); precise_bn(drop, batches, show_progress=False); v_eval = drop[2].running_var.clone()
    torch.manual_seed(1); precise_bn(drop, batches, train_mode=True, show_progress=False)
    assert not drop.training and not drop[1].training
    assert (drop[2].running_var > v_eval).all()  # dropout inflates the variance
    with pytest.raises(ValueError, match='pass `dl`'): precise_bn(model)
    with pytest.raises(ValueError, match='no batch'): precise_bn(model, [], show_progress=False)
    assert all(m.training for m in model.modules()) and all(m.track_running_stats for m in bn_layers(model))
    with pytest.warns(UserWarning, match='no BatchNorm'): assert precise_bn(nn.Linear(2, 2), [torch.randn(2, 2)]) == 0


def tabular_dls(scale=1., shift=0., shuffle=True):
    def data(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 10, generator=g)
        y = (x @ torch.linspace(-1, 1, 10) + 0.5*x[:, 0]*x[:, 1] > 0).long()
        return list(zip(x*scale + shift, y))
    return DataLoaders(DataLoader(data(1024, 0), bs=32, shuffle=shuffle, drop_last=True),
                       DataLoader(data(512, 1), bs=128))

def mlp(): return nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32),
                                nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))

def quiet_learner(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
    learn.remove_cb(learn.progress); learn.logger = lambda *a: None
    return learn


def test_learner_precise_bn_uses_train_dl():
    set_seed(0)
    learn = quiet_learner(tabular_dls(shuffle=False), mlp())
    learn.fit(1, 1e-2)
    batches = list(learn.dls.train)[:5]
    ref = reference_stats(learn.model, batches)
    assert learn.precise_bn(n_batches=5, show_progress=False) == 2
    assert_matches_reference(learn.model, ref)


@pytest.mark.parametrize('seed', [0, 1])
def test_precise_bn_callback_beats_stale_ema(seed):
    "Trained at one input scale, fine-tuned for a few batches at another: EMA stats are stale, precise ones are not."
    set_seed(seed)
    learn = quiet_learner(tabular_dls(), mlp())
    learn.fit(3, 1e-2)
    trained = copy.deepcopy(learn.model.state_dict())
    base_loss, base_acc = learn.validate()
    results = {}
    for cbs in ([], [PreciseBN(n_batches=16)]):
        set_seed(seed)
        learn = quiet_learner(tabular_dls(scale=0.25, shift=2.), mlp())
        learn.model.load_state_dict(trained)
        learn.fit(1, 1e-6, cbs=[ShortEpochCallback(pct=0.1)] + cbs)
        results[bool(cbs)] = learn.validate()
    (stale_loss, stale_acc), (loss, acc) = results[False], results[True]
    assert loss < stale_loss / 2 and acc > stale_acc + 0.1
    assert abs(loss - base_loss) < 0.05 and acc > base_acc - 0.03  # back to what the model does at the old scale


def test_precise_bn_callback_every_epoch_and_not_in_validate():
    set_seed(0)
    learn = quiet_learner(tabular_dls(), mlp())
    calls = []
    cb = PreciseBN(n_batches=2, every_epoch=True)
    import fastai_accum.bn_tools as bt
    orig = bt.precise_bn
    bt.precise_bn = lambda *a, **k: calls.append(learn.training) or orig(*a, **k)
    try:
        learn.fit(2, 1e-2, cbs=cb)
        assert len(calls) == 2            # once per epoch, before validation
        learn.add_cb(PreciseBN(n_batches=2))
        learn.validate(); learn.get_preds()
        assert len(calls) == 2            # never from validate/get_preds
        learn.fit(1, 1e-2)
        assert len(calls) == 3            # after_fit
    finally: bt.precise_bn = orig


def _dist_worker(rank, world, port, batches, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = small_cnn()
        precise_bn(model, batches[rank::world], show_progress=False)  # each rank its own shard, merged exactly
        out[rank] = [(m.running_mean.clone(), m.running_var.clone()) for m in bn_layers(model)]
    finally: dist.destroy_process_group()

def test_precise_bn_distributed_merges_ranks():
    batches = drifting_batches(8)
    torch.manual_seed(0)
    ref = reference_stats(small_cnn(), batches)
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_dist_worker, args=(2, port, batches, out), nprocs=2)
    for r in range(2):
        for (mean, var), (rmean, rvar) in zip(out[r], ref):
            assert ((var.double() - rvar).abs() / rvar).max() <= 1e-5
            assert ((mean.double() - rmean).abs() / rvar.sqrt()).max() <= 1e-5


# ---- converters ----

def resnet():
    from torchvision.models import resnet18
    torch.manual_seed(0)
    m = resnet18(weights=None, num_classes=4)
    with torch.no_grad():  # non-trivial running statistics and affine weights
        m.train()(torch.randn(4, 3, 32, 32))
        for bn in bn_layers(m): bn.weight.uniform_(0.5, 1.5); bn.bias.normal_()
    return m

def sgd_step_changes_params(model):
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    torch.manual_seed(1)
    loss = nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([0, 3]))
    loss.backward(); opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, params))
    return loss


@pytest.mark.parametrize('convert', ['groupnorm', 'frozen'])
def test_converted_resnet18_trains(convert):
    model = resnet()
    bn_keys = list(model.state_dict())
    affine = [(bn.weight, bn.bias) for bn in bn_layers(model)]
    n_bn = len(affine)
    x = torch.randn(2, 3, 32, 32)
    if convert == 'groupnorm':
        assert bn_to_groupnorm(model) == n_bn
        norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
        assert all(m.num_groups == 32 for m in norms)
        assert list(model.state_dict()) == [k for k in bn_keys if not k.rsplit('.', 1)[1] in
                                            ('running_mean', 'running_var', 'num_batches_tracked')]
    else:
        assert bn_to_frozen(model) == n_bn
        norms = [m for m in model.modules() if isinstance(m, FrozenBatchNorm)]
        assert list(model.state_dict()) == bn_keys
    assert not any(isinstance(m, _BatchNorm) for m in model.modules())
    assert [(m.weight, m.bias) for m in norms] == affine and all(
        m.weight is w and m.bias is b for m, (w, b) in zip(norms, affine))
    assert model.eval()(x).shape == (2, 4)
    sgd_step_changes_params(model)


def test_frozen_train_output_equals_bn_eval_output():
    model = resnet()
    frozen = copy.deepcopy(model)
    bn_to_frozen(frozen)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad(): expected = model.eval()(x)
    stats = [m.running_var.clone() for m in frozen.modules() if isinstance(m, FrozenBatchNorm)]
    frozen.train()
    assert torch.equal(frozen(x), expected)
    frozen(x * 3 + 1)  # statistics never move
    assert all(torch.equal(a, m.running_var) for a, m in
               zip(stats, [m for m in frozen.modules() if isinstance(m, FrozenBatchNorm)]))
    # strict loading both ways; a checkpoint without num_batches_tracked loads too
    frozen.load_state_dict(model.state_dict())
    model.load_state_dict(frozen.state_dict())
    frozen.load_state_dict({k: v for k, v in model.state_dict().items() if 'num_batches_tracked' not in k})
    # frozen affine: only the convs and the head train; the inverse restores BN and requires_grad
    m2 = copy.deepcopy(model)
    bn_to_frozen(m2, train_affine=False)
    assert not any(p.requires_grad for m in m2.modules() if isinstance(m, FrozenBatchNorm) for p in m.parameters())
    sgd_step_changes_params(m2)
    m2.train()
    n = frozen_to_bn(m2)
    assert n == len(bn_layers(model)) and all(type(m) is nn.BatchNorm2d for m in bn_layers(m2))
    assert all(p.requires_grad for p in m2.parameters())
    assert m2.training and all(m.training for m in bn_layers(m2))


def test_groupnorm_groups_and_layernorm_head():
    model = nn.Sequential(nn.Conv2d(3, 72, 1), nn.BatchNorm2d(72), nn.Conv2d(72, 7, 1), nn.BatchNorm2d(7),
                          nn.Flatten(), nn.Linear(7*4*4, 12), nn.BatchNorm1d(12, affine=False))
    model.eval()
    assert bn_to_groupnorm(model, groups=32, groups_1d=1) == 3
    assert [m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)] == [24, 7, 1]
    assert not model.training and not model[6].training and model[6].weight is None
    x = torch.randn(5, 3, 4, 4)
    h = model[:6](x)
    torch.testing.assert_close(model(x), nn.functional.layer_norm(h, (12,), eps=1e-5))


def test_converter_warnings_and_errors():
    with pytest.warns(UserWarning, match='no BatchNorm layer'): assert bn_to_groupnorm(nn.Linear(2, 2)) == 0
    with pytest.warns(UserWarning, match='no BatchNorm layer'): assert bn_to_frozen(nn.Linear(2, 2)) == 0
    with pytest.warns(UserWarning, match='no FrozenBatchNorm'): assert frozen_to_bn(nn.Linear(2, 2)) == 0
    with pytest.raises(ValueError, match='in place'): bn_to_frozen(nn.BatchNorm2d(3))
    with pytest.warns(UserWarning, match='no running statistics'):
        assert bn_to_frozen(nn.Sequential(nn.BatchNorm2d(3, track_running_stats=False))) == 0

    class BNAct(nn.BatchNorm2d):  # timm-style: forward does more than BN
        def forward(self, x): return super().forward(x).relu()
    with pytest.warns(UserWarning, match='does more than BatchNorm'):
        assert bn_to_groupnorm(nn.Sequential(BNAct(4), nn.BatchNorm2d(4)), groups=2) == 1
    wrapped = small_cnn(); wrap_bn(wrapped)
    assert bn_to_frozen(wrapped) == 3 and frozen_to_bn(wrapped) == 3
    assert type(wrapped[1]) is nn.BatchNorm2d and type(wrapped[9]) is nn.BatchNorm1d
