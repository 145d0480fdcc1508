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
