"""Every input a user brings (issue #46): the big batch's step, or a clear refusal naming the option or the cause —
never a crash inside the library, never a window other than the one asked for. One test per row of the issue's table;
each failed (crashed, trained another window, or said nothing) before the change it checks."""
import copy, warnings
import pytest, torch
from torch import nn
import torch.nn.functional as F
from fastai_accum.core import Accumulation

def cnn(bn=None):
    torch.manual_seed(0)
    bn = bn or nn.BatchNorm2d(4)
    return nn.Sequential(nn.Conv2d(3, 4, 3), bn, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).double()

def micro_batches(n=8, bs=2, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 3, size, size, generator=g, dtype=torch.float64), torch.randint(0, 2, (bs,), generator=g))
            for _ in range(n)]

def loop(model, data, x_of=lambda b: b[0], y_of=lambda b: b[1], **kw):
    "One epoch of the plain loop, no optimizer step: the core, and the gradients of its last window."
    acc = Accumulation(model, **kw)
    for b in acc.batches(data):
        model.zero_grad() if acc.window.empty else None
        acc.backward(F.cross_entropy(model(x_of(b)), y_of(b)))
    return acc

def big_batch(model, data):
    "The last window's gradients and the running statistics after all windows, each window as one plain batch."
    for i in range(0, len(data), 4):
        model.zero_grad()
        x, y = (torch.cat(t) for t in zip(*data[i:i + 4]))
        F.cross_entropy(model(x), y).backward()
    return model

def assert_same(a, b):
    for (k, p), q in zip(a.state_dict().items(), b.state_dict().values()): assert torch.allclose(p.double(), q.double(), atol=1e-10), k
    for (k, p), q in zip(a.named_parameters(), b.parameters()): assert torch.allclose(p.grad, q.grad, atol=1e-10), k

def test_n_acc_below_the_batch_is_refused_on_every_path():
    "n_acc=16 with micro-batches of 32: 'auto' trained windows of 32 (the whole-window path skipped the check)."
    data = micro_batches(4, bs=32)
    for policy in ('auto', 'exact', 'micro'):
        with pytest.raises(ValueError, match='micro-batch has 32 samples, more than the effective batch n_acc=16'):
            loop(cnn().train(), data, n_acc=16, policy=policy)

@pytest.mark.parametrize('value, said', [(-1, 'device_memory=-1: a memory budget must be a positive number'),
                                         ('1 parsec', "device_memory='1 parsec': give bytes as a number or a string")])
def test_budgets_are_checked_where_given(value, said):
    with pytest.raises(ValueError, match=said): Accumulation(cnn(), n_step=4, device_memory=value)

def test_a_budget_in_words_is_bytes():
    acc = loop(cnn().train(), micro_batches(), n_step=4, device_memory='1GB', host_memory='2 GiB')
    assert (acc.device_memory, acc.host_memory, acc.path) == (10**9, 2 * 2**30, 'exact')

def test_a_policy_typo_names_policy_and_the_nearest():
    with pytest.raises(ValueError, match=r"Accumulation\(policy='stagde'\): unknown policy \(did you mean 'staged'\?\)"):
        Accumulation(cnn(), n_step=4, policy='stagde')

def test_a_model_without_parameters_is_refused():
    with pytest.raises(ValueError, match='the model has no parameters'):
        Accumulation(nn.Sequential(nn.BatchNorm2d(3, affine=False)), n_step=4)

def test_an_empty_loader_says_so():
    with pytest.warns(UserWarning, match='Accumulation: the training loader is empty'):
        acc = loop(cnn().train(), [], n_step=4)
    assert acc.steps == 0

def test_a_model_left_in_eval_mode_is_told_to_train():
    with pytest.warns(UserWarning, match=r'Accumulation: the model is in eval mode.*call model.train\(\)'):
        loop(cnn().eval(), micro_batches(), n_step=4)

def test_the_plain_loop_speaks_as_accumulation(capsys):
    loop(cnn().train(), micro_batches(), n_step=4, preflight=True)
    said = capsys.readouterr().out
    assert said.startswith("Accumulation: policy 'auto' -> 'exact'") and 'GradientAccumulation' not in said

def test_lazy_modules_take_their_shapes_before_planning():
    "A LazyBatchNorm2d and a LazyLinear not run yet: planning cloned an UninitializedBuffer; now the big batch's step."
    def lazy():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2)).double()
    data = micro_batches()
    torch.manual_seed(1); ours = lazy().train()
    acc = loop(ours, data, n_step=4)
    torch.manual_seed(1); ref = lazy().train()
    with torch.no_grad(): ref.eval()(data[0][0]); ref.train()  # the same first draws give the same initial values
    assert acc.path == 'exact' and ours[1].num_batches_tracked.item() == 2
    assert_same(ours, big_batch(ref, data))

@pytest.mark.parametrize('policy', ['auto', 'exact', 'staged'])
def test_micro_batches_of_other_shapes_are_refused_by_the_exact_paths_before_they_claim_them(policy, capsys):
    "2x3x8x8 then 2x3x10x10 in one window: the exact paths announced themselves, then torch.cat failed."
    data = [b for pair in zip(micro_batches(4), micro_batches(4, size=10)) for b in pair]
    if policy != 'auto':
        with pytest.raises(ValueError, match=rf"policy='{policy}'\) trains each window as one batch, but element 0 of a "
                                             r"micro-batch differs in shape .* \[3, 8, 8\], \[3, 10, 10\]"):
            loop(cnn().train(), data, n_step=4, policy=policy)
        return
    acc = loop(cnn().train(), data, n_step=4, preflight=True)
    assert acc.path == 'window' and 'the window cannot be trained as one batch: element 0' in capsys.readouterr().out

def test_dict_batches_train_as_the_big_batch():
    "Batches as dicts (Hugging Face datasets): the keys were taken for the batch; `inputs=` names the model's part."
    data = micro_batches()
    dicts = [{'x': x, 'y': y} for x, y in data]
    with pytest.raises(TypeError, match=r"a batch is a dict \(keys 'x', 'y'\).*inputs=lambda b: \(b\['x'\],\)"):
        loop(cnn().train(), dicts, n_step=4, x_of=lambda b: b['x'], y_of=lambda b: b['y'])
    for policy in ('exact', 'staged'):
        ours = cnn().train()
        acc = loop(ours, dicts, n_step=4, policy=policy, inputs=lambda b: (b['x'],), x_of=lambda b: b['x'], y_of=lambda b: b['y'])
        assert acc.exact
        assert_same(ours, big_batch(cnn().train(), data))

def test_batchnorm_without_bias_trains_under_window():
    "torch's BatchNorm2d(bias=False): the window policy added the missing bias; it trains as a zero bias that never moves."
    no_bias = cnn(nn.BatchNorm2d(4, bias=False)).train()
    zero = cnn().train()
    zero[1].bias.requires_grad_(False)
    data = micro_batches()
    loop(no_bias, data, n_step=4, policy='window')
    loop(zero, data, n_step=4, policy='window')
    for k, b in zero.state_dict().items():
        if k != '1.bias': assert torch.allclose(no_bias.state_dict()[k], b, atol=1e-12), k
    for (k, p), q in zip(no_bias.named_parameters(), [p for p in zero.parameters() if p.requires_grad]):
        assert torch.allclose(p.grad, q.grad, atol=1e-12), k

@pytest.mark.parametrize('policy', ['auto', 'staged'])
def test_a_non_finite_sample_commits_no_statistics_on_the_whole_window_paths(policy):
    "NaN pixels in micro-batch 2 of window 0: torch's BatchNorm counted NaN running statistics and nothing was said."
    data = micro_batches()
    data[2][0][1] = float('nan')
    ours = cnn().train()
    with pytest.warns(RuntimeWarning, match='micro-batch 2 of window 0 has a non-finite loss'):
        acc = loop(ours, data, n_step=4, policy=policy)
    assert acc.path == {'auto': 'exact', 'staged': 'staged exact'}[policy]
    ref = big_batch(cnn().train(), data[4:])  # window 0 left no trace: the model has seen window 1 only
    assert_same(ours, ref)

def test_a_fit_cancelled_on_a_non_finite_window_keeps_its_statistics_and_says_so():
    "fastai's TerminateOnNaNCallback cancels the fit before the window's end: the statistics are taken back, said."
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders, TfmdDL
    from fastai.losses import CrossEntropyLossFlat
    from fastai.callback.tracker import TerminateOnNaNCallback
    from fastai_accum.callback import GradientAccumulation
    x, y = (torch.cat(t) for t in zip(*micro_batches()))
    x[5] = float('nan')
    dls = DataLoaders(TfmdDL(list(zip(x, y)), bs=2), TfmdDL(list(zip(x[:4], y[:4])), bs=2))
    for policy in ('auto', 'window'):
        learn = Learner(dls, cnn(), loss_func=CrossEntropyLossFlat(), cbs=[TerminateOnNaNCallback()])
        with pytest.warns(RuntimeWarning, match='window 0 was dropped before its end .* after a non-finite loss'):
            with learn.no_logging(), learn.no_bar(): learn.fit(1, cbs=GradientAccumulation(n_step=4, policy=policy))
        bn = learn.model[1]
        assert torch.equal(bn.running_mean, torch.zeros(4, dtype=torch.float64)) and bn.num_batches_tracked.item() == 0

def test_a_training_set_smaller_than_a_batch_is_refused_in_fastais_words():
    "fastai drops the incomplete last batch: 0 training batches gave an IndexError in before_train."
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders, TfmdDL
    from fastai.losses import CrossEntropyLossFlat
    from fastai_accum.callback import GradientAccumulation
    x, y = (torch.cat(t) for t in zip(*micro_batches(3)))
    dls = DataLoaders(TfmdDL(list(zip(x, y)), bs=8, drop_last=True), TfmdDL(list(zip(x, y)), bs=8))
    learn = Learner(dls, cnn(), loss_func=CrossEntropyLossFlat())
    with pytest.raises(ValueError, match=r'the training set has fewer samples \(6\) than bs=8'):
        with learn.no_logging(), learn.no_bar(): learn.fit(1, cbs=GradientAccumulation(n_step=2))

class Deeper(nn.Module):
    "Two BatchNorm stages and a head: a budget below the window makes 'auto' stage it."
    def __init__(s, checkpointed=False):
        super().__init__()
        s.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        s.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        s.head, s.checkpointed = nn.Linear(8, 2), checkpointed
    def forward(s, x):
        from torch.utils.checkpoint import checkpoint
        x = s.a(x)
        x = checkpoint(s.b, x, use_reentrant=False) if s.checkpointed else s.b(x)
        return s.head(x.mean((2, 3)))

def deeper(checkpointed=False):
    torch.manual_seed(0)
    return Deeper(checkpointed).double().train()

def test_a_compiled_model_trains_on_the_paths_of_its_module(capsys):
    "torch.compile(model) under a budget: dynamo crashed on the pre-flight's hooks, the tracers refused OptimizedModule."
    from fastai_accum.exact import staging_budget
    data = micro_batches(8, size=16)
    for policy in ('auto', 'staged'):
        ours = deeper()
        compiled = torch.compile(ours, backend='eager')
        budget = staging_budget(ours, (data[0][0],), 8)
        acc = loop(compiled, data, n_step=4, policy=policy, preflight=True, device_memory=budget,
                   x_of=lambda b: b[0])
        assert acc.path == 'staged exact' and "-> 'staged exact'" in capsys.readouterr().out
        assert_same(ours, big_batch(deeper(), data))

def test_a_compiled_model_in_a_learner():
    "`learn.model = torch.compile(model)`: the callback plans and wraps the module inside; the step is the big batch's."
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders, TfmdDL
    from fastai.losses import CrossEntropyLossFlat
    from fastai.optimizer import SGD
    from fastai_accum.callback import GradientAccumulation
    from fastai_accum.exact import staging_budget
    x, y = (torch.cat(t) for t in zip(*micro_batches(8, size=16)))
    dls = DataLoaders(TfmdDL(list(zip(x, y)), bs=2), TfmdDL(list(zip(x[:4], y[:4])), bs=2))
    results = []
    for compiled in (False, True):
        net = deeper()
        learn = Learner(dls, torch.compile(net, backend='eager') if compiled else net, loss_func=CrossEntropyLossFlat(),
                        opt_func=SGD, lr=0.1)
        ga = GradientAccumulation(n_step=4, device_memory=staging_budget(net, (x[:2],), 8))
        with learn.no_logging(), learn.no_bar(): learn.fit(1, cbs=ga)
        results.append((ga.path, net.state_dict()))
    assert results[0][0] == results[1][0] == 'staged exact'
    for k, v in results[0][1].items(): assert torch.allclose(v.double(), results[1][1][k].double(), atol=1e-10), k

def test_activation_checkpointing_is_named():
    "torch.utils.checkpoint inside the model: the check refused staging naming a running mean 'off by 0.3'."
    from fastai_accum.exact import staging_budget
    from fastai_accum.plan import StagedMismatchError
    from fastai_accum.exact import ExactModeRefusedError
    data = micro_batches(8, size=16)
    budget = staging_budget(deeper(), (data[0][0],), 8)
    with pytest.raises(ExactModeRefusedError, match=r'runs BatchNorm layer b.1 again \(activation '
                                                                          r'checkpointing.*set_grad_checkpointing\(False\)'):
        loop(deeper(True), data, n_step=4, policy='staged', device_memory=budget)
    ours = deeper(True)
    acc = loop(ours, data, n_step=4)  # the window fits: trained whole, its statistics counted once per window
    assert acc.path == 'exact' and ours.b[1].num_batches_tracked.item() == 2  # torch's own checkpointed batch: 4
    assert_same(ours, big_batch(deeper(), data))  # the big batch without checkpointing

def test_a_micro_batch_sliced_from_a_larger_tensor_is_measured_by_its_own_bytes():
    "`x[i:i+2]` of one big tensor: its footprint was its storage's (112 KiB a sample for 19), and 'auto' staged a window that fits."
    from fastai_accum.exact import measure_footprint
    big = torch.randn(64, 3, 16, 16, dtype=torch.float64)
    model = deeper()
    sliced, own = measure_footprint(model, big[4:6]), measure_footprint(model, big[4:6].clone())
    assert (sliced.saved, sliced.working) == (own.saved, own.working)
    data = [(big[i:i + 2], torch.randint(0, 2, (2,))) for i in range(0, 16, 2)]
    assert loop(deeper(), data, n_step=4).path == 'exact'

@pytest.mark.parametrize('option, said', [(dict(offload='yes'), r"offload='yes'\): give True or False"),
                                          (dict(verify='no'), r"verify='no'\): give True or False"),
                                          (dict(inputs='x'), r"inputs='x'\): give a function of a batch")])
def test_flags_and_inputs_are_checked_where_given(option, said):
    with pytest.raises((ValueError, TypeError), match=said): Accumulation(cnn(), n_step=4, **option)

def test_inputs_none_is_the_default():
    assert loop(cnn().train(), micro_batches(), n_step=4, inputs=None).path == 'exact'
