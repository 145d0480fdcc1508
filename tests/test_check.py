"check_accumulation: exact on BatchNorm-free models, catches broken loss weighting, attributes BatchNorm differences."
import copy
import pytest
import torch
from torch import nn
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat, BCEWithLogitsLossFlat, MSELossFlat
from fastai.torch_core import TensorImage, TensorCategory
from torch.utils.data import TensorDataset
import fastai_accum.window
from fastai_accum.batchnorm import AccumulateBatchNorm, bn_layers
from fastai_accum.callback import GradientAccumulation
from fastai_accum.check import check_accumulation, AccumulationReport, gradient_screen


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def conv_net(bn:bool, seed=0):
    torch.manual_seed(seed)
    norm2, norm1 = (nn.BatchNorm2d, nn.BatchNorm1d) if bn else (lambda c: nn.Identity(), lambda c: nn.Identity())
    return nn.Sequential(nn.Conv2d(3, 8, 3), norm2(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), norm2(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 16), norm1(16), nn.ReLU(), nn.Linear(16, 4))

def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

def images(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 10, 10, generator=g), torch.randint(0, 4, (n,), generator=g)

def tabular(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)

def learner(bn=True, n=256, bs=16, **kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g); y = (x[:, :4] @ torch.randn(4, 3, generator=g)).argmax(1)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=bs, shuffle=True), DataLoader(TensorDataset(x, y), bs=bs))
    torch.manual_seed(0)
    norm = nn.BatchNorm1d if bn else (lambda c: nn.Identity())
    model = nn.Sequential(nn.Linear(6, 16), norm(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), **kw)


# --- exact without BatchNorm -------------------------------------------------------------------------------------

@pytest.mark.parametrize('make,data', [(mlp, tabular), (lambda: conv_net(bn=False), images)])
@pytest.mark.parametrize('n_step', [4, 5])  # 5 does not divide 32: unequal micro-batches, weighted exactly
def test_bn_free_matches(make, data, n_step):
    r = check_accumulation(make(), data(), n_step, nn.CrossEntropyLoss())
    assert isinstance(r, AccumulationReport)
    assert r.ok and r.cause == 'none' and r.max_rel_diff <= 1e-6
    assert r.max_rel_diff_bn_eval is None and r.grad_rel_err <= 1e-12 and r.grad_cosine == pytest.approx(1, abs=1e-12)
    assert 'matches' in r.diagnosis
    assert (r.rows[r.rows.kind == 'grad'].rel_diff <= 1e-6).all()

@pytest.mark.parametrize('loss_func,target', [(CrossEntropyLossFlat(), 'cls'), (BCEWithLogitsLossFlat(), 'multi'),
                                              (MSELossFlat(), 'reg'), (nn.CrossEntropyLoss(reduction='sum'), 'cls')])
def test_losses_in_float64(loss_func, target):
    "fastai's BaseLoss casts float64 predictions to float32: the check computes them in float64; 'sum' needs weight 1."
    x, y = tabular(30)
    if target == 'multi': y = (torch.rand(30, 4) > 0.5).float()
    if target == 'reg': y = torch.randn(30, 4)
    r = check_accumulation(mlp(), (x, y), 4, loss_func)
    assert r.ok, r
    assert r.rows.set_index('name').loc['<loss>', 'rel_diff'] <= 1e-12

def test_fastai_tensor_types():
    x, y = images(16)
    r = check_accumulation(conv_net(bn=False), (TensorImage(x), TensorCategory(y)), 4, CrossEntropyLossFlat())
    assert r.ok


# --- a broken accumulation is flagged, and not blamed on BatchNorm ------------------------------------------------

@pytest.mark.parametrize('bn', [False, True])
def test_broken_loss_weighting_is_flagged(monkeypatch, bn):
    "Each micro-batch's loss weighted 1 (micro-batch means summed, not averaged): the check must fail, and say why."
    orig = fastai_accum.window.AccumulationWindow.add
    monkeypatch.setattr(fastai_accum.window.AccumulationWindow, 'add', lambda self, bs, loss=None: (orig(self, bs, loss), 1.)[1])
    r = check_accumulation(conv_net(bn=bn), images(), 4, nn.CrossEntropyLoss())
    assert not r.ok and r.cause == 'other'
    assert 'not explained by BatchNorm' in r.diagnosis and 'weighted wrongly' in r.diagnosis
    assert r.max_rel_diff > 0.5
    if bn: assert r.max_rel_diff_bn_eval > 0.5 and 'persist with every BatchNorm in eval mode' in r.diagnosis
    else: assert 'no BatchNorm layer' in r.diagnosis

def test_loss_weight_hook():
    r = check_accumulation(mlp(), tabular(), 4, nn.CrossEntropyLoss(), loss_weight_fn=lambda bs, window: bs / 16)
    assert not r.ok and r.cause == 'other'
    assert r.grad_rel_err == pytest.approx(1, rel=1e-9)  # weights twice too large: the gradient doubles

def test_unwrappable_bn_statistics_are_flagged():
    "A BatchNorm subclass with its own forward stays unwrapped and updates per micro-batch: gradients fine, stats not."
    class MyBN(nn.BatchNorm2d):
        def forward(self, x): return super().forward(x)
    model = conv_net(bn=True); model[1] = MyBN(8)
    with pytest.warns(UserWarning, match='unwrapped'):
        r = check_accumulation(model, images(), 4, nn.CrossEntropyLoss())
    assert r.cause == 'other' and 'not committed exactly once' in r.diagnosis
    assert r.rows.set_index('name').loc['1.num_batches_tracked', 'abs_diff'] == 3


# --- BatchNorm: differences attributed to it ----------------------------------------------------------------------

def test_bn_differences_attributed_to_bn():
    model, data = conv_net(bn=True), images()
    r = check_accumulation(model, data, 4, nn.CrossEntropyLoss(), policy='micro')
    assert not r.ok and r.cause == 'batchnorm'
    assert 'explained by BatchNorm micro-batch normalization' in r.diagnosis
    assert r.max_rel_diff > 1e-3 and r.max_rel_diff_bn_eval <= 1e-6
    rows = r.rows.set_index('name')
    # gradients: every module differs (the forward differs after the first BN), all agree with BN frozen
    assert (r.rows[r.rows.kind == 'grad'].rel_diff_bn_eval <= 1e-6).all()
    assert rows.loc['1.weight', 'rel_diff'] > 1e-3
    # running statistics: the first BN's input is the data, its committed window statistics are exact
    assert rows.loc['1.running_mean', 'rel_diff'] <= 1e-12 and rows.loc['1.running_var', 'rel_diff'] <= 1e-12
    assert not rows.loc['1.running_var', 'bn_forward'] and rows.loc['4.running_var', 'bn_forward']
    assert rows.loc['4.running_var', 'rel_diff'] > 1e-6
    # flags: the last Linear is after the last BN and not before any; the first conv is before one
    assert rows.loc['11.weight', 'bn_forward'] and not rows.loc['11.weight', 'bn_backward']
    assert rows.loc['0.weight', 'bn_backward'] and rows.loc['9.weight', 'bn_forward']
    top = r.top(3)
    assert set(top.layer) <= {'BatchNorm2d', 'BatchNorm1d', 'Conv2d', 'Linear'}
    assert set(r.layers.module) == {'0', '1', '3', '4', '8', '9', '11'}

def test_window_policy_shrinks_differences():
    model, data = conv_net(bn=True), images()
    micro = check_accumulation(model, data, 4, nn.CrossEntropyLoss(), policy='micro')
    window = check_accumulation(model, data, 4, nn.CrossEntropyLoss(), policy='window')
    assert window.cause == 'batchnorm' and window.policy == 'window'
    assert window.grad_rel_err < micro.grad_rel_err and window.grad_cosine > micro.grad_cosine
    rows = window.rows
    # the forward is the big batch's: loss, running statistics and every gradient not flowing through BN statistics
    # (to 1e-6, not 1e-15: for >= 32 values per channel the layer renormalizes with r, d computed in float32)
    assert rows.set_index('name').loc['<loss>', 'rel_diff'] <= 1e-6
    assert rows[rows.kind.isin(['running_mean', 'running_var'])].rel_diff.max() <= 1e-12
    g = rows[rows.kind == 'grad']
    assert g[~g.bn_backward.astype(bool)].rel_diff.max() <= 1e-6
    assert 'exact here' in window.diagnosis and any('pre-passes' in n for n in window.notes)


# --- Learner: defaults from the callback, nothing of the user's state changes --------------------------------------

def _state(learn):
    m = learn.model
    return (copy.deepcopy(m.state_dict()), [p.grad for p in m.parameters()], [x.training for x in m.modules()],
            [type(x) for x in m.modules()], torch.get_rng_state())

def _same_state(a, b):
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert a[2:4] == b[2:4] and torch.equal(a[4], b[4])

def test_learner_defaults_and_untouched_state():
    learn = learner(cbs=GradientAccumulation(n_step=4, policy='micro'))
    learn.model.eval()  # whatever mode it is in stays
    before = _state(learn)
    r = learn.check_accumulation()
    _same_state(before, _state(learn))
    assert (r.n_step, r.n_samples, r.policy) == (4, 64, 'micro')
    assert r.cause == 'batchnorm' and r.dropout == ['3'] and any('eval mode' in n for n in r.notes)
    assert not learn.model.training

def test_learner_after_accumulated_fit():
    "A model trained with GradientAccumulation('window') has wrapped BN layers: checked as they are, left wrapped."
    learn = learner(cbs=GradientAccumulation(n_step=2, policy='window'))
    learn.fit(1, 1e-2)
    assert all(isinstance(m, AccumulateBatchNorm) for m in bn_layers(learn.model))
    before = _state(learn)
    r = learn.check_accumulation()
    _same_state(before, _state(learn))
    assert r.policy == 'window' and r.n_step == 2 and r.cause == 'batchnorm'
    assert all(isinstance(m, AccumulateBatchNorm) and m.policy == 'window' and not m.pending.count
               for m in bn_layers(learn.model))
    assert learner(bn=False).check_accumulation(n_step=4).ok

def test_report_display():
    r = check_accumulation(conv_net(bn=True), images(), 4, nn.CrossEntropyLoss())
    text, md = repr(r), r._repr_markdown_()
    assert text.startswith('accumulation differs') and 'diagnosis: explained by BatchNorm' in text
    assert '| module | layer |' in md and 'BatchNorm2d' in md and md.startswith('**accumulation differs')
    assert not bool(r)

def test_bad_input():
    model = mlp()
    with pytest.raises(ValueError, match='loss_func'): check_accumulation(model, tabular(), 4)
    with pytest.raises(ValueError, match='fewer than n_step'): check_accumulation(model, tabular(3), 4, nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match='tuple of tensors'): check_accumulation(model, tabular()[0], 4, nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match='Unknown BatchNorm policy'):
        check_accumulation(model, tabular(), 4, nn.CrossEntropyLoss(), policy='ghost')
    with pytest.raises(ValueError, match='at least 2 samples'):  # 'micro' BN cannot normalize 1-sample micro-batches
        check_accumulation(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)), tabular(4), 4, nn.CrossEntropyLoss())


# --- policies beyond BatchNorm's: the callback's 'exact' and 'auto', fastai's naive accumulation --------------------

def test_exact_auto_and_naive():
    model, data = conv_net(bn=True), images()
    exact = check_accumulation(model, data, 4, nn.CrossEntropyLoss(), policy='exact')
    assert exact.ok and exact.cause == 'none' and exact.grad_cosine == pytest.approx(1, abs=1e-12)
    auto = check_accumulation(model, data, 4, nn.CrossEntropyLoss(), policy='auto')  # the window fits: as the callback, 'exact'
    assert auto.policy == 'exact' and auto.ok and any("policy 'auto' is 'exact'" in n for n in auto.notes)
    naive, micro = (check_accumulation(model, data, 4, nn.CrossEntropyLoss(), policy=p) for p in ('naive', 'micro'))
    assert naive.grad_cosine == pytest.approx(micro.grad_cosine, abs=1e-12)  # the same gradient ...
    rows = naive.rows.set_index('name')  # ... but running statistics updated by every micro-batch, even the first layer's
    assert rows.loc['1.num_batches_tracked', 'abs_diff'] == 3 and rows.loc['1.running_var', 'rel_diff'] > 1e-6
    assert naive.cause == 'batchnorm' and 'once per micro-batch' in naive.diagnosis

def test_per_module_agreement():
    r = check_accumulation(conv_net(bn=True), images(), 4, nn.CrossEntropyLoss(), policy='micro', explain=False)
    lay = r.layers.set_index('module')
    assert lay.loc['11', 'grad_cosine'] < 1 and lay.loc['0', 'grad_l2_err'] > 0
    assert set(r.grad_layers) == {'0', '1', '3', '4', '8', '9', '11'}
    assert r.max_rel_diff_bn_eval is None and r.cause == 'unexplained'

def test_previous_window_fills_the_backward_terms():
    "With `previous`, the 'window' policy's small layers project with the previous window's means, not this one's so far."
    model, (x, y) = conv_net(bn=True), images(64)
    first = check_accumulation(model, (x[32:], y[32:]), 4, nn.CrossEntropyLoss(), policy='window')
    later = check_accumulation(model, (x[32:], y[32:]), 4, nn.CrossEntropyLoss(), policy='window', previous=(x[:32], y[:32]))
    assert later.grad_cosine != first.grad_cosine and 'pooled window terms are those of `previous`' in later.notes[-1]
    # only the gradient moves: the forward, the loss and the committed statistics are this window's, exactly
    for r in (first, later):
        assert r.rows.set_index('name').loc['<loss>', 'rel_diff'] <= 1e-6
        assert r.rows[r.rows.kind.isin(['running_mean', 'running_var'])].rel_diff.max() <= 1e-12
    with pytest.raises(TypeError, match='previous'): check_accumulation(model, (x, y), 4, nn.CrossEntropyLoss(), previous=x)


# --- gradient_screen -----------------------------------------------------------------------------------------------

def windows(n=6, bs=32):
    x, y = images(n * bs, seed=1)
    return [(x[i:i + bs], y[i:i + bs]) for i in range(0, n * bs, bs)]

def test_gradient_screen():
    model = conv_net(bn=True)
    before = copy.deepcopy(model.state_dict())
    s = gradient_screen(model, windows(), 4, nn.CrossEntropyLoss(), at=(0, 5), lr=1e-2, progress=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model itself is not trained
    t = s.table.set_index(['step', 'policy'])
    assert list(s.cosines().index) == ['naive', 'micro', 'window', 'exact'] and list(s.cosines().columns) == [0, 5]
    for k in (0, 5):
        assert t.loc[(k, 'exact'), 'cosine'] == pytest.approx(1, abs=1e-6) and t.loc[(k, 'exact'), 'rel_err'] < 1e-5
        assert t.loc[(k, 'naive'), 'cosine'] == pytest.approx(t.loc[(k, 'micro'), 'cosine'], abs=1e-6)
        assert t.loc[(k, 'micro'), 'cosine'] < 0.99
    assert s.reports[0, 'window'].notes[-1].endswith("first window") and 'previous' in s.reports[5, 'window'].notes[-1]
    # the points differ: training moved the model between them
    assert t.loc[(0, 'micro'), 'cosine'] != t.loc[(5, 'micro'), 'cosine']
    lay = s.layers(5, 'micro')
    assert lay.grad_cosine.is_monotonic_increasing and {'grad_cosine', 'grad_l2_err'} <= set(lay.columns)
    with pytest.raises(ValueError, match='unknown policies'): gradient_screen(model, windows(), 4, nn.CrossEntropyLoss(), policies=('ghost',))

@pytest.mark.parametrize('weight,cos_max,err_min', [
    (lambda bs, w: 1., 1.01, 14.9),                      # every micro-batch weighted 1, not 1/16: direction kept, size x16
    (lambda bs, w: float(w.n_micro == 16) / 16, 0.7, 0.9), # only the last micro-batch: the direction is lost (measured 0.44, 0.56)
])
def test_gradient_screen_catches_broken_weighting(weight, cos_max, err_min):
    "A window of 32 in 16 micro-batches of 2, a BatchNorm-free net (accumulation exact): a broken weighting shows."
    s = gradient_screen(conv_net(bn=False), windows(2), 16, nn.CrossEntropyLoss(), policies=('micro',), at=(0, 1),
                        progress=False, loss_weight_fn=weight)
    assert (s.table.cosine < cos_max).all() and (s.table.rel_err > err_min).all()
    assert gradient_screen(conv_net(bn=False), windows(2), 16, nn.CrossEntropyLoss(), policies=('micro',), at=(0,),
                           progress=False).table.cosine[0] == pytest.approx(1, abs=1e-9)
