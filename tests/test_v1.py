"fastai v1 (1.0.61) path: runs in a subprocess with the .v1 overlay first on sys.path."
import json
from conftest import run_v1

def _result(r) -> dict:
    "The JSON a v1 script printed on its last line starting with 'RESULT '."
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.rsplit('RESULT ', 1)[1].splitlines()[0])

def test_v1_overlay_trains_one_epoch():
    r = run_v1('''
import fastai, torch
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner
from torch.utils.data import TensorDataset
assert fastai.__version__ == '1.0.61', fastai.__version__
torch.manual_seed(0)
x = torch.randn(64, 4); y = (x[:, 0] > 0).long()
data = DataBunch.create(TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:]), bs=8, num_workers=0)
learn = Learner(data, torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
                loss_func=torch.nn.CrossEntropyLoss())
learn.fit(1, 1e-2)
print('losses', len(learn.recorder.losses))
''')
    assert r.returncode == 0
    assert 'losses 6' in r.stdout

_IMAGES = '''
import warnings; warnings.simplefilter('ignore')
import numpy as np, torch
from functools import partial
from pathlib import Path
from PIL import Image as PILImage
root = Path({root!r})
rng = np.random.RandomState(0)
for split, n in (('train', 5), ('valid', 2)):
    for c in ('cat', 'dog'):
        (root/split/c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            a = rng.randint(0, 255, (32, 32, 3), dtype=np.uint8); a[..., 0] = 200 if c == 'cat' else 30
            PILImage.fromarray(a).save(root/split/c/f'{{i}}.png')
'''

def test_v1_create_cnn_callback_fns_window_policy(tmp_path):
    "The card's path (create_cnn + callback_fns, via `mnist_v1`): one step and one pre-pass per window, the window policy in the pre-flight table, train_dl restored."
    r = run_v1(_IMAGES.format(root=str(tmp_path)) + '''
import json
from fastai.basic_train import OptimWrapper
from fastai.basic_data import DeviceDataLoader
import fastai_accum.core as fw  # where the core calls the pre-pass
from fastai_accum.all import *
from fastai_accum.batchnorm import bn_layers
from fastai_accum.callback_v1 import GradientAccumulationV1, mnist_v1
assert GradientAccumulation is GradientAccumulationV1  # under fastai v1 the star import gives the v1 adapter
steps, prepasses = [], []
_step = OptimWrapper.step
OptimWrapper.step = lambda self: steps.append(1) or _step(self)
_pre = fw.window_prepasses
fw.window_prepasses = lambda model, xbs, *a, **k: prepasses.append(sum(x[0].shape[0] for x in xbs)) or _pre(model, xbs, *a, **k)
learn = mnist_v1(root, n_step=4, micro_bs=2, epochs=1, lr=1e-3, policy='window')
bns = bn_layers(learn.model)
print('RESULT', json.dumps(dict(n_batches=len(learn.data.train_dl), steps=len(steps), prepasses=prepasses, bn=len(bns),
      plain=not any(isinstance(b, AccumulateBatchNorm) for b in bns), tracked=sorted({int(b.num_batches_tracked) for b in bns}),
      restored=type(learn.data.train_dl) is DeviceDataLoader)))
''')
    out = _result(r)
    assert out['n_batches'] == 5                        # 10 images in micro-batches of 2: windows of 4 and 1
    windows = 2
    assert out['steps'] == windows
    assert out['bn'] == 22                              # 20 in the resnet18 body + 2 BatchNorm1d in the head
    assert out['plain']                                 # wrapped ('window') for the fit, torch's own layers after it
    assert out['tracked'] == [windows]                  # every BN layer committed once per optimizer step
    assert out['restored']
    assert out['prepasses'] == [8, 2]                   # one pre-pass per window, over the whole window
    assert r.stdout.count("GradientAccumulationV1: policy 'window' on 22 BatchNorm layers: each micro-batch is normalized with the whole window's statistics") == 1  # the pre-flight, once, in the adapter's name

_MLP = '''
import json, warnings; warnings.simplefilter('ignore')
import torch
from functools import partial
from torch.utils.data import TensorDataset, DataLoader
import fastai.callbacks.fp16 as fp16
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner, OptimWrapper
from fastai.train import *
from fastai_accum.all import *
from fastai_accum.batchnorm import bn_layers
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 8, generator=g); y = (x[:, :2].sum(1) > 0).long()
ds = TensorDataset(x, y)
steps, checks = [], []
_step, _overflow = OptimWrapper.step, fp16.grad_overflow
OptimWrapper.step = lambda self: steps.append(1) or _step(self)
fp16.grad_overflow = lambda params: checks.append(1) or _overflow(params)

def run(bs, n_step=None, fp16_kw=None, epochs=1, bn=False, **kw):
    "Train the MLP on the same 96 samples, in order; returns its parameters (float64), optimizer steps and scale checks."
    del steps[:], checks[:]
    data = DataBunch(DataLoader(ds, bs, shuffle=False), DataLoader(ds, 32), device=torch.device('cpu'))
    torch.manual_seed(1)
    # no bias before BatchNorm: its true gradient is 0, and Adam would turn each run's rounding noise into different steps
    model = torch.nn.Sequential(torch.nn.Linear(8, 32, bias=not bn), *([torch.nn.BatchNorm1d(32)] if bn else []), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    fns = [partial(GradientAccumulation, n_step=n_step, **kw)] if n_step else []
    learn = Learner(data, model, loss_func=torch.nn.CrossEntropyLoss(), callback_fns=fns)
    if fp16_kw is not None: learn.to_fp16(**fp16_kw)
    learn.fit(epochs, 1e-2)
    ps = torch.cat([p.detach().double().flatten() for p in learn.model.parameters()] +
                   [b.double().flatten() for m in learn.model.modules() if hasattr(m, 'running_var') for b in (m.running_mean, m.running_var)])
    return ps, len(steps), len(checks), getattr(learn, 'mp_cb', None)
'''

def test_v1_fp32_accumulation_is_the_big_batch():
    out = _result(run_v1(_MLP + '''
big, n_big, _, _ = run(32, epochs=2)
acc, n_acc, _, _ = run(8, n_step=4, epochs=2)
print('RESULT', json.dumps(dict(diff=(big - acc).abs().max().item(), steps=[n_big, n_acc])))
'''))
    assert out['diff'] <= 1e-6
    assert out['steps'] == [6, 6]  # 96 samples, windows of 32, 2 epochs

def test_v1_auto_trains_each_window_as_one_batch():
    "With BatchNorm in the model and a window that fits, 'auto' is 'exact' under v1 as under v2: the big batch's parameters and running statistics."
    r = run_v1(_MLP + '''
big, n_big, _, _ = run(32, epochs=2, bn=True)
acc, n_acc, _, _ = run(8, n_step=4, epochs=2, bn=True)
print('RESULT', json.dumps(dict(diff=(big - acc).abs().max().item(), steps=[n_big, n_acc])))
''')
    out = _result(r)
    assert out['diff'] <= 1e-6 and out['steps'] == [6, 6]
    assert "policy 'auto' -> 'exact'" in r.stdout

def test_v1_to_fp16_accumulates_exactly():
    "to_fp16(loss_scale=1, dynamic=False) and dynamic scaling: 4 x 8 equals bs 32 within 10x the fp16-vs-fp32 difference; one step and one scale check per window."
    out = _result(run_v1(_MLP + '''
res = {}
ref = run(32, epochs=2)[0]
for name, kw in (('static', dict(loss_scale=1, dynamic=False)), ('dynamic', dict(loss_scale=2.**8, max_noskip=2)),
                 ('flat', dict(loss_scale=2.**8, max_noskip=2, flat_master=True))):
    big, n_big, c_big, mp_big = run(32, fp16_kw=kw, epochs=2)
    acc, n_acc, c_acc, mp_acc = run(8, n_step=4, fp16_kw=kw, epochs=2)
    res[name] = dict(fp16_vs_fp32=(big - ref).abs().max().item(), acc_vs_big=(acc - big).abs().max().item(),
                     steps=[n_big, n_acc], checks=[c_big, c_acc], scale=[mp_big.loss_scale, mp_acc.loss_scale],
                     patched='on_backward_end' in vars(mp_acc))
# with BatchNorm, 'auto' is 'exact': the window is the big batch, under to_fp16 too
kw = dict(loss_scale=2.**8, max_noskip=2)
big, n_big, c_big, mp_big = run(32, fp16_kw=kw, epochs=2, bn=True)
acc, n_acc, c_acc, mp_acc = run(8, n_step=4, fp16_kw=kw, epochs=2, bn=True)
res['exact'] = dict(acc_vs_big=(acc - big).abs().max().item(), steps=[n_big, n_acc], checks=[c_big, c_acc], scale=[mp_big.loss_scale, mp_acc.loss_scale])
# overflow every window: the scale halves once per window and nothing steps
big, n_big, c_big, mp_big = run(32, fp16_kw=dict(loss_scale=2.**40), epochs=1)
acc, n_acc, c_acc, mp_acc = run(8, n_step=4, fp16_kw=dict(loss_scale=2.**40), epochs=1)
res['overflow'] = dict(acc_vs_big=(acc - big).abs().max().item(), steps=[n_big, n_acc], scale=[mp_big.loss_scale, mp_acc.loss_scale])
print('RESULT', json.dumps(res))
'''))
    print(out)
    for name in ('static', 'dynamic', 'flat'):
        o = out[name]
        assert 0 < o['fp16_vs_fp32'] < 0.1
        assert o['acc_vs_big'] <= 10 * o['fp16_vs_fp32'], (name, o)
        assert o['steps'] == [6, 6]                                  # one optimizer step per window
        assert not o['patched']                                      # MixedPrecision restored after the fit
    assert out['static']['checks'] == [0, 0]
    for name in ('dynamic', 'flat'):
        assert out[name]['checks'] == [6, 6]                         # one loss-scale check per window
        assert out[name]['scale'] == [2.**8 * 2**3] * 2              # doubled every 2 windows, as the big batch
    o = out['exact']
    assert o['acc_vs_big'] == 0 and o['steps'] == [6, 6] and o['checks'] == [6, 6] and o['scale'] == [2.**11] * 2
    o = out['overflow']
    assert o['scale'] == [2.**37] * 2 and o['acc_vs_big'] == 0 and o['steps'] == [3, 3]

def test_v1_unsupported_options_raise(tmp_path):
    "Bad options and clip_grad with to_fp16 raise ValueErrors naming the argument; a failing fit restores train_dl and MixedPrecision."
    out = _result(run_v1(_MLP + '''
from fastai.basic_data import DeviceDataLoader
from fastai.callback import Callback
res = {}
try: GradientAccumulation(None, n_step=4, policy='magic')
except ValueError as e: res['policy'] = str(e)
try: GradientAccumulation(None, n_step=4, prepass_bs=0)
except ValueError as e: res['prepass_bs'] = str(e)
data = DataBunch(DataLoader(ds, 8), DataLoader(ds, 32), device=torch.device('cpu'))
learn = Learner(data, torch.nn.Sequential(torch.nn.Linear(8, 2)), loss_func=torch.nn.CrossEntropyLoss(),
                callback_fns=[partial(GradientAccumulation, n_step=4)]).to_fp16().clip_grad(0.1)
try: learn.fit(1)
except ValueError as e: res['clip'] = str(e)
class Boom(Callback):
    def on_batch_end(self, num_batch, **kw):
        if num_batch == 5: raise RuntimeError('boom')
bn_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
learn = Learner(data, bn_model, loss_func=torch.nn.CrossEntropyLoss(),
                callback_fns=[partial(GradientAccumulation, n_step=4, policy='window', preflight=False)]).to_fp16()
try: learn.fit(1, callbacks=[Boom()])
except RuntimeError: pass
res['restored'] = type(learn.data.train_dl) is DeviceDataLoader
res['unpatched'] = 'on_backward_end' not in vars(learn.mp_cb)
res['pending'] = sum(b.pending.count for b in bn_layers(learn.model, accumulating=True))
print('RESULT', json.dumps(res))
'''))
    assert "(policy='magic'): unknown policy" in out['policy'] and 'prepass_bs must be at least 1' in out['prepass_bs']
    assert 'clip_grad(clip=0.1)' in out['clip'] and 'to_fp16(clip=' in out['clip']
    assert out['restored'] and out['unpatched'] and out['pending'] == 0

def test_v1_window_forward_is_the_big_batch(tmp_path):
    "Under v1 the window policy normalizes each micro-batch with its window's statistics: the first window's outputs equal the big batch's."
    out = _result(run_v1(_IMAGES.format(root=str(tmp_path)) + '''
from fastai.vision import *
from fastai.callback import Callback
from fastai_accum.all import *
from fastai_accum.batchnorm import bn_layers
import copy, json
torch.manual_seed(0)
data = ImageDataBunch.from_folder(root, bs=2, size=32, num_workers=0, ds_tfms=None)
learn = create_cnn(data, models.resnet18, pretrained=False, ps=0., callback_fns=[partial(GradientAccumulation, n_step=4, policy='window', preflight=False)])
plain = copy.deepcopy(learn.model)
class Probe(Callback):
    outs, ref = [], None
    def on_batch_begin(self, num_batch, train, **kw):
        if train and num_batch == 0:
            with torch.no_grad(): Probe.ref = plain.train()(torch.cat([b[0] for b in learn.data.train_dl.window]))
    def on_loss_begin(self, last_output, num_batch, train, **kw):
        if train and num_batch < 4: Probe.outs.append(last_output.detach())
learn.fit(1, 1e-3, callbacks=[Probe()])
outs = torch.cat(Probe.outs)
print('RESULT', json.dumps(dict(err=((outs - Probe.ref).abs().max() / Probe.ref.abs().max()).item(), n=len(outs))))
'''))
    assert out['n'] == 8 and out['err'] < 1e-4

def test_v1_every_fit_chooses_from_the_modes_it_trains_in():
    "v1 leaves the model in eval mode after a fit: the next fits still train 'exact', said once; all BatchNorm frozen (BnFreeze) trains as no BatchNorm."
    r = run_v1('''
import json, torch, warnings; warnings.simplefilter('ignore')
from functools import partial
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner
from fastai.train import BnFreeze
from torch.utils.data import TensorDataset
from fastai_accum.all import *
from fastai_accum.batchnorm import bn_layers
torch.manual_seed(0)
x = torch.randn(64, 4); y = (x[:, 0] > 0).long()
data = DataBunch.create(TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:]), bs=4, num_workers=0)
def learner(fns):
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return Learner(data, model, loss_func=torch.nn.CrossEntropyLoss(), callback_fns=fns)
learn = learner([partial(GradientAccumulation, n_step=4)])
for _ in range(3): learn.fit(1, 1e-2)
plain = type(learn.model[1]) is torch.nn.BatchNorm1d
frozen = learner([BnFreeze, partial(GradientAccumulation, n_step=4)])
frozen.model[1].requires_grad_(False)
frozen.fit(1, 1e-2); frozen.fit(1, 1e-2)
print('RESULT', json.dumps(dict(plain=plain, tracked=int(learn.model[1].num_batches_tracked), frozen_tracked=int(frozen.model[1].num_batches_tracked))))
''')
    out = _result(r)
    assert r.stdout.count("-> 'exact'") == 1 and 'BatchNorm layers,' not in r.stdout  # never window BN
    assert out['plain'] and out['tracked'] == 9                # 3 fits x 3 windows, each one batch
    assert r.stdout.count('are frozen (eval mode)') == 1 and out['frozen_tracked'] == 0

def test_v1_staged_exact_is_the_big_batch():
    "policy='staged' under v1: each window the big batch, computed stage by stage in chunks; the model's own forward after the fit."
    r = run_v1(_MLP + '''
big, n_big, _, _ = run(32, epochs=2, bn=True)
acc, n_acc, _, _ = run(8, n_step=4, epochs=2, bn=True, policy='staged', device_memory=40000)
print('RESULT', json.dumps(dict(diff=(big - acc).abs().max().item(), steps=[n_big, n_acc])))
''')
    out = _result(r)
    assert out['diff'] <= 1e-6 and out['steps'] == [6, 6]
    assert "policy 'staged' -> 'staged exact'" in r.stdout and 'in chunks of' in r.stdout
