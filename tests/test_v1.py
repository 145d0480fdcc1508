"fastai v1 (1.0.61) path: runs in a subprocess with the .v1 overlay first on sys.path."
from conftest import run_v1

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

def test_v1_create_cnn_callback_fns_steps_per_window(tmp_path):
    "The card's path: create_cnn(..., callback_fns=[partial(GradientAccumulation, n_step=4)]) on tiny synthetic images."
    r = run_v1(f'''
import warnings; warnings.simplefilter('ignore')
import numpy as np, torch
from functools import partial
from pathlib import Path
from PIL import Image as PILImage
from fastai.vision import *
from fastai.basic_train import OptimWrapper
from fastai_accum.all import *
assert GradientAccumulation is GradientAccumulationV1

root = Path({str(tmp_path)!r})
rng = np.random.RandomState(0)
for split, n in (('train', 12), ('valid', 4)):
    for c in ('cat', 'dog'):
        (root/split/c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            a = rng.randint(0, 255, (32, 32, 3), dtype=np.uint8); a[..., 0] = 200 if c == 'cat' else 30
            PILImage.fromarray(a).save(root/split/c/f'{{i}}.png')
torch.manual_seed(0)
data = ImageDataBunch.from_folder(root, bs=2, size=32, num_workers=0, ds_tfms=None)
steps = []
_step = OptimWrapper.step
OptimWrapper.step = lambda self: steps.append(1) or _step(self)
learn = create_cnn(data, models.resnet18, pretrained=False, metrics=accuracy,
                   callback_fns=[partial(GradientAccumulation, n_step=4)])
n_batches = len(data.train_dl)
learn.fit(2, 1e-3)
bns = bn_layers(learn.model, accumulating=True)
print('n_batches', n_batches, 'steps', len(steps), 'bn', len(bns), 'tracked', sorted({{int(b.num_batches_tracked) for b in bns}}))
print('pending', sum(b.pending.count for b in bns))
''')
    assert r.returncode == 0
    out = dict(zip(*[iter(r.stdout.split('\n')[-3].split())]*2))
    n_batches, steps = int(out['n_batches']), int(out['steps'])
    assert steps == 2 * -(-n_batches // 4)           # ceil(n_batches / n_step) per epoch
    assert out['bn'] == '22'                          # 20 in the resnet18 body + 2 BatchNorm1d in the head
    assert f"[{steps}]" in r.stdout                   # every BN layer committed once per optimizer step
    assert 'pending 0' in r.stdout
