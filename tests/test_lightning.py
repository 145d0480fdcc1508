"`BatchNormAccumulation` with `Trainer(accumulate_grad_batches=n)`: big-batch gradients, exact BatchNorm, the window policy."
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
pytest.importorskip('pytorch_lightning')
from fastai_accum.lightning import BatchNormAccumulation, pl
from fastai_accum.batchnorm import bn_layers

def mlp(): return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
def bn_net(): return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
def rel(a, b): return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()

class Module(pl.LightningModule):
    "Records each training micro-batch and its output, for the checks."
    def __init__(self, net):
        super().__init__()
        self.net, self.seen = net, []
    def forward(self, x): return self.net(x)
    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.seen.append((x, y, out.detach()))
        return nn.functional.mse_loss(out, y)
    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.05)

class Probe(pl.Callback):
    "At each optimizer step (after our callback's work): `check(module, window of (x, y, out), parameters before the step)`."
    def __init__(self, check): self.check, self.steps = check, 0
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps += 1
        self.check(pl_module, list(pl_module.seen))
        pl_module.seen.clear()

def fit(net, n, bs, n_acc, check, dtype=torch.float32, epochs=1, **kw):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 6, generator=g, dtype=dtype) * 2 + 1, torch.randn(n, 1, generator=g, dtype=dtype)
    module = Module(net.to(dtype))
    cb, probe = BatchNormAccumulation(**kw), Probe(check)
    trainer = pl.Trainer(accelerator='cpu', max_epochs=epochs, accumulate_grad_batches=n_acc, callbacks=[cb, probe],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=bs))
    return module, cb, probe, trainer

@pytest.mark.parametrize('n,bs,n_acc', [(10, 4, 3), (10, 4, 4), (22, 2, 4)])
def test_bn_free_gradients_equal_big_batch(n, bs, n_acc):
    "Ragged last micro-batch (10 = 4+4+2), ragged window (4 over 3 micro-batches), several windows over 2 epochs."
    torch.manual_seed(0)
    losses = []
    def check(module, window):
        ref = mlp(); ref.load_state_dict(module.net.state_dict())
        loss = nn.functional.mse_loss(ref(torch.cat([w[0] for w in window])), torch.cat([w[1] for w in window]))
        loss.backward()
        for p, q in zip(module.net.parameters(), ref.parameters()): assert rel(p.grad, q.grad) <= 1e-6
        losses.append(loss.item())
    module, cb, probe, trainer = fit(mlp(), n, bs, n_acc, check, epochs=2)
    windows = -(-(-(-n // bs)) // n_acc)
    assert probe.steps == cb.steps == trainer.global_step == 2 * windows
    assert torch.allclose(torch.tensor(cb.losses), torch.tensor(losses), rtol=1e-5)  # each window's loss, as one big batch's

@pytest.mark.parametrize('policy', ['window', 'micro'])
def test_bn_stats_forward_and_steps(policy):
    "float64, 20 samples in micro-batches of 3, windows of 3 micro-batches: running statistics = BatchNorm on each window."
    torch.manual_seed(0)
    before = []
    def check(module, window):
        xw = torch.cat([w[0] for w in window])
        big = bn_net().double(); big.load_state_dict(module.net.state_dict())
        for bn, (rm, rv) in zip(bn_layers(big), before[-1]): bn.running_mean.copy_(rm); bn.running_var.copy_(rv)
        out = big(xw)  # plain BatchNorm on the concatenated window, from the running statistics before it
        if policy == 'window': assert rel(torch.cat([w[2] for w in window]), out.detach()) <= 1e-10
        for bn, rb in zip(bn_layers(module.net), bn_layers(big)):
            if policy == 'micro' and bn is not bn_layers(module.net)[0]: continue  # later layers' inputs differ under micro
            assert rel(bn.running_mean, rb.running_mean) <= 1e-12 and rel(bn.running_var, rb.running_var) <= 1e-12
        before.append([(bn.running_mean.clone(), bn.running_var.clone()) for bn in bn_layers(module.net)])
    net = bn_net()
    before.append([(bn.running_mean.clone().double(), bn.running_var.clone().double()) for bn in bn_layers(net)])
    module, cb, probe, trainer = fit(net, 20, 3, 3, check, dtype=torch.float64, policy=policy)
    assert probe.steps == cb.steps == trainer.global_step == 3
    assert cb.path == policy and [type(m) for m in bn_layers(module.net)] == [nn.BatchNorm1d] * 2  # plain again after the fit

def test_policies_checked():
    for policy in ('exact', 'staged'):
        with pytest.raises(ValueError, match='accumulate_grad_batches=1'): BatchNormAccumulation(policy=policy)
    with pytest.raises(ValueError, match=r"BatchNormAccumulation\(policy='nope'\): unknown policy"): BatchNormAccumulation(policy='nope')
    with pytest.raises(ValueError, match='prepass_bs'): BatchNormAccumulation(prepass_bs=0)
    assert BatchNormAccumulation(policy='auto').policy == 'window'
