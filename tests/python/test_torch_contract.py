"""torch.optim's contract to the letter, on the CPU: every case below is run with HybridAdamW and then,
separately, with ``torch.optim.AdamW(foreach=False)`` on a copy of the same model and data (never
interleaved step by step: interleaving would hide the races), and the results compared element by
element. Updates overlap what follows ``step()`` (with ``model=``), so the cases that read or write
weights or gradients right after ``step()`` check the fence (hybrid/fence.py); the layers are large
enough, with one worker thread, that an update is still running when the loop reads."""

import copy
import gc
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hytrain

TOL = dict(rtol=1e-5, atol=1e-6)


class Layer(nn.Module):
    def __init__(self, d, wide):
        super().__init__()
        self.up = nn.Linear(d, wide)
        self.down = nn.Linear(wide, d)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class Net(nn.Module):
    """A head, repeated layers (a ModuleList, or a Sequential with ``sequential=True``), a tail."""

    def __init__(self, d=32, wide=64, layers=3, sequential=False):
        super().__init__()
        self.embed = nn.Linear(16, d)
        stack = [Layer(d, wide) for _ in range(layers)]
        self.layers = nn.Sequential(*stack) if sequential else nn.ModuleList(stack)
        self.head = nn.Linear(d, 1)

    def body(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return h

    def forward(self, x):
        return self.head(self.body(x)).pow(2).mean()


def big_net():
    """Layers of 2 M parameters each: with one worker an update runs for tens of milliseconds."""
    return Net(d=512, wide=2048, layers=3)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def pair(make=Net, hybrid=None, torch_kw=None, with_model=False, exact=False, **kw):
    """The same model twice (seed 0): one with HybridAdamW(**kw) (and model= the model), one with
    torch's AdamW -- or, ``exact``, with HybridAdamW(overlap=False), which updates inside step() with
    the same kernels (large layers: the rounding of two AdamW implementations, amplified by Adam's
    normalisation over a few steps, would hide a race; the same kernels agree bit for bit)."""
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    hkw = dict(lr=1e-2, weight_decay=0.1, workers=1)
    hkw.update(kw)
    params = hybrid(model) if hybrid is not None else model.parameters()
    opt = hytrain.HybridAdamW(params, model=model if with_model else None, **hkw)
    tkw = {k: v for k, v in hkw.items() if k in ("lr", "weight_decay", "betas", "eps", "amsgrad", "maximize")}
    tkw.update(torch_kw or {})
    ref_params = hybrid(ref) if hybrid is not None else ref.parameters()
    if exact:
        return model, opt, ref, hytrain.HybridAdamW(ref_params, overlap=False, **hkw)
    return model, opt, ref, torch.optim.AdamW(ref_params, foreach=False, **tkw)


def train(model, opt, xs, *, forward=None, before_step=None, after_step=None, zero=None):
    """A plain loop. It never calls synchronize(): what reads the weights afterwards must see the
    last step's updates through the fence, as torch promises."""
    out = []
    for i, x in enumerate(xs):
        loss = model(x) if forward is None else forward(model, x)
        loss.float().backward()
        if before_step is not None:
            before_step(i)
        opt.step()
        if after_step is not None:
            out.append(after_step(i))
        (zero or opt.zero_grad)()
    return out


def assert_same_weights(model, ref, exact=False):
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        if exact:
            assert torch.equal(a.detach(), b.detach()), (name, (a - b).abs().max().item())
        else:
            torch.testing.assert_close(a.detach(), b.detach(), msg=name, **TOL)


def both(case, with_model=True, make=Net, steps=4, exact=False, **kw):
    """Runs ``case(model, opt, xs)`` with each optimizer, one after the other; returns both results."""
    model, opt, ref, ref_opt = pair(make, with_model=with_model, exact=exact, **kw)
    xs = batches(steps)
    got = case(model, opt, xs)
    want = case(ref, ref_opt, xs)
    assert_same_weights(model, ref, exact)
    return got, want


def assert_same_tensors(got, want, exact):
    for a, b in zip(got, want):
        if exact:
            assert torch.equal(a, b), (a - b).abs().max().item()
        else:
            torch.testing.assert_close(a, b, **TOL)


# ---- reads and writes right after step() --------------------------------------------------------


def ema_case(model, opt, xs):
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    train(model, opt, xs, after_step=lambda i: ema.update_parameters(model))
    return [p.detach().clone() for p in ema.parameters()]


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
@pytest.mark.parametrize("big", [False, True], ids=["torch", "race"])
def test_ema_read_right_after_step(with_model, big):
    got, want = both(ema_case, with_model, make=big_net if big else Net, steps=3, exact=big)
    assert_same_tensors(got, want, big)


def test_without_the_fence_the_ema_reads_updates_in_flight():
    """The EMA case with the fence off reads weights still being updated: what the fence prevents
    is real (this run would pass if it were not)."""
    model, opt, ref, ref_opt = pair(big_net, with_model=True, exact=True, fence=False)
    xs = batches(3)
    got, want = ema_case(model, opt, xs), ema_case(ref, ref_opt, xs)
    assert any(not torch.equal(a, b) for a, b in zip(got, want))


def test_fence_leaves_the_stack_once_the_updates_landed():
    model, opt, _, _ = pair(big_net, with_model=True)
    depth = torch._C._len_torch_function_stack()
    for x in batches(2):
        model(x).backward()
        opt.step()
        assert opt._engine.fence.armed and torch._C._len_torch_function_stack() == depth + 1
        opt.zero_grad()
        model.zero_grad()
        assert opt._engine.in_flight()  # dropping .grad does not wait for the updates
    with torch.no_grad():
        model(batches(1)[0])  # the forward waits for every block, then the fence is taken off
    assert not opt._engine.fence.armed and torch._C._len_torch_function_stack() == depth


@pytest.mark.parametrize("big", [False, True], ids=["torch", "race"])
@pytest.mark.parametrize("how", ["model.zero_grad", "grad.zero_"])
def test_gradients_zeroed_in_place_right_after_step(how, big):
    def case(model, opt, xs):
        def zero():
            if how == "model.zero_grad":
                model.zero_grad(set_to_none=False)
            else:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
        train(model, opt, xs, zero=zero)
    both(case, make=big_net if big else Net, steps=3, exact=big)


@pytest.mark.parametrize("big", [False, True], ids=["torch", "race"])
def test_model_load_state_dict_right_after_step_is_a_rollback(big):
    def case(model, opt, xs):
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, xs[:1])

        def rollback(i):
            if i == 0:
                model.load_state_dict(saved)
        train(model, opt, xs[1:], after_step=rollback)
    both(case, make=big_net if big else Net, steps=4, exact=big)


# ---- blocks found on any model, parameters used in any order ----------------------------------------


class LateParam(Net):
    """A parameter registered after the layers, used before them."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, x):
        h = self.embed(x) * self.scale
        for layer in self.layers:
            h = layer(h)
        return self.head(h).pow(2).mean()


def functional_forward(model, x):
    """Layer weights used without calling the layers."""
    h = model.embed(x)
    for layer in model.layers:
        h = h + F.linear(torch.tanh(F.linear(h, layer.up.weight, layer.up.bias)), layer.down.weight,
                         layer.down.bias)
    return model.head(h).pow(2).mean()


def parts_forward(model, x):
    """The loop calls the submodules itself, never the model."""
    return model.head(model.body(x)).pow(2).mean()


@pytest.mark.parametrize("name,make,forward", [
    ("late-parameter", LateParam, None),
    ("functional", Net, functional_forward),
    ("parts", Net, parts_forward),
    ("sequential", lambda: Net(sequential=True), None),
])
def test_parameters_used_in_any_order(name, make, forward):
    def case(model, opt, xs):
        train(model, opt, xs, forward=forward)
    both(case, make=make, steps=4)


def test_sequential_layers_are_blocks():
    model = Net(sequential=True)
    opt = hytrain.HybridAdamW(model.parameters(), model=model)
    assert len(opt.blocks) == 5  # head, three layers, tail


@pytest.mark.parametrize("when", ["before", "after"])
def test_compiled_model(when):
    """torch.compile'd models (the eager backend: dynamo's tracing, hooks and graph breaks, without
    a C++ toolchain): given as model=, or compiled after the optimizer was built."""
    def case(model, opt, xs):
        compiled = getattr(case, "compiled")
        train(compiled, opt, xs)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager")
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, workers=1,
                              model=compiled if when == "before" else model)
    xs = batches(4)
    case.compiled = compiled
    case(model, opt, xs)
    torch._dynamo.reset()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    case.compiled = torch.compile(ref, backend="eager")
    case(ref, ref_opt, xs)
    assert_same_weights(model, ref)


def test_model_compiled_after_the_optimizer_is_not_recompiled_every_step():
    """A model compiled after the optimizer was built enters its compiled frames with the fence on
    the stack (updates in flight after step()). The fence runs outside the graphs, so the frames'
    guards do not depend on which blocks are in flight: the frames compile a bounded number of times
    (they recompiled at every step, until dynamo's recompile limit sent them back to eager), and the
    weights still follow torch's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, workers=1, model=model)
    compiled = torch.compile(model, backend="eager")
    xs = batches(12)
    train(compiled, opt, xs)
    graphs = counters["stats"]["unique_graphs"]
    assert opt._engine.fence is not None and opt._engine.settings.fence
    assert graphs <= 6, f"{graphs} graphs for 12 steps: the frames recompile with the fence's state"
    torch._dynamo.reset()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    train(torch.compile(ref, backend="eager"), ref_opt, xs)
    assert_same_weights(model, ref)


def test_vit_blocks():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                                 image_size=16, patch_size=8, num_labels=3)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg)
    opt = hytrain.HybridAdamW(model.parameters(), model=model)
    assert len(opt.blocks) == 5  # embeddings, three encoder layers, the final norm and classifier

    def case(m, o, xs):
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            px = torch.randn(2, 3, 16, 16, generator=g)
            m(pixel_values=px, labels=torch.tensor([0, 2])).loss.backward()
            o.step()
            o.zero_grad()

    # Against the same kernels inside step() (overlap=False): the attention's key bias has a zero
    # gradient up to rounding, which Adam's normalisation turns into full steps in either direction.
    ref = copy.deepcopy(model)
    case(model, opt, [])
    case(ref, hytrain.HybridAdamW(ref.parameters(), overlap=False), [])
    assert_same_weights(model, ref, exact=True)


# ---- atomic steps ---------------------------------------------------------------------------------


class SparseLast(Net):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, 1, sparse=True)

    def forward(self, x):
        return super().forward(x) + self.table(torch.tensor([1, 2])).sum()


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_a_refused_step_changes_nothing_and_dropping_the_optimizer_is_safe(with_model):
    torch.manual_seed(0)
    model = SparseLast()
    model.table.weight.requires_grad_(False)  # dense for the first steps
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-2, workers=1, model=model if with_model else None)
    for x in batches(2):
        model(x).backward()
        opt.step()
        opt.zero_grad()
    model.table.weight.requires_grad_(True)
    model(batches(1, seed=5)[0]).backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p.detach(), w)
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, state[id(p)][k]), k
    del opt
    gc.collect()  # dropping it with nothing in flight, and without a crash
    model.zero_grad()


def test_dropping_an_optimizer_with_updates_in_flight_waits():
    model = big_net()
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-2, workers=1, model=model)
    for x in batches(2):
        model(x).backward()
        opt.step()
    assert opt._engine.in_flight()
    del opt
    gc.collect()
    model.zero_grad()
    model(batches(1)[0]).backward()  # the model is still usable


# ---- torch's semantics ----------------------------------------------------------------------------


def test_clip_after_every_micro_batch_is_torchs():
    def case(model, opt, xs):
        norms = []
        for i, x in enumerate(xs):
            model(x).backward()
            clip = opt.clip_grad_norm_ if isinstance(opt, hytrain.HybridAdamW) else (
                lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m))
            norms.append(float(clip(0.05)))
            if i % 3 == 2:
                opt.step()
                opt.zero_grad()
        return norms
    got, want = both(case, steps=6, accumulation_steps=3)
    assert got == pytest.approx(want, rel=1e-5)
    assert len(set(round(n, 6) for n in got[:3])) == 3  # a fresh norm at every call


@pytest.mark.parametrize("release_grads", [True, False])
def test_lr_changed_between_backward_and_step(release_grads):
    def case(model, opt, xs):
        def set_lr(i):
            for g in opt.param_groups:
                g["lr"] = 1e-2 / (i + 1)
        train(model, opt, xs, before_step=set_lr)
    both(case, steps=4, release_grads=release_grads)


def test_loop_clip_with_release_grads():
    def case(model, opt, xs):
        clip = (opt.clip_grad_norm_ if isinstance(opt, hytrain.HybridAdamW)
                else lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m))
        train(model, opt, xs, before_step=lambda i: clip(0.05))
    both(case, steps=4, release_grads=True)


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_maximize(with_model):
    def case(model, opt, xs):
        train(model, opt, xs)
    both(case, with_model, steps=3, maximize=True)


def test_maximize_in_one_param_group():
    def groups(m):
        return [{"params": list(m.embed.parameters()) + list(m.layers.parameters())},
                {"params": m.head.parameters(), "maximize": True}]
    model, opt, ref, ref_opt = pair(hybrid=groups)
    xs = batches(3)
    train(model, opt, xs)
    train(ref, ref_opt, xs)
    assert_same_weights(model, ref)


def test_partial_state_dict_resets_the_missing_state():
    def case(model, opt, xs):
        train(model, opt, xs[:3])
        sd = copy.deepcopy(opt.state_dict())
        train(model, opt, xs[3:5])
        del sd["state"][0]  # the first parameter starts afresh, as torch's AdamW does
        opt.load_state_dict(sd)
        train(model, opt, xs[5:])
        return opt.state_dict()["state"]
    got, want = both(case, steps=7)
    for i in want:
        assert float(got[i]["step"]) == float(want[i]["step"])


def test_scheduler_built_after_load_state_dict():
    def case(model, opt, xs):
        train(model, opt, xs[:2])
        return opt.state_dict()

    def resume(model, opt, sd, xs):
        opt.load_state_dict(sd)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        for x in xs:
            model(x).backward()
            opt.step()
            sched.step()
            opt.zero_grad()

    model, opt, ref, ref_opt = pair(with_model=True)
    xs = batches(5)
    sd, ref_sd = case(model, opt, xs), case(ref, ref_opt, xs)
    opt2 = hytrain.HybridAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, workers=1, model=model)
    ref_opt2 = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    resume(model, opt2, copy.deepcopy(sd), xs[2:])
    resume(ref, ref_opt2, ref_sd, xs[2:])
    assert_same_weights(model, ref)


def test_frozen_parameters_are_skipped_and_can_be_unfrozen():
    def case(model, opt, xs):
        train(model, opt, xs[:2])
        for p in model.embed.parameters():
            p.requires_grad_(True)  # unfrozen mid-run
        train(model, opt, xs[2:])
        return len(opt.state_dict()["state"])

    def freeze(m):
        for p in m.embed.parameters():
            p.requires_grad_(False)
        return m

    got, want = both(case, make=lambda: freeze(Net()), steps=5)
    assert got == want


def test_a_frozen_integer_parameter_is_skipped_as_torch_skips_it():
    # torch's optimizers accept a parameter that never gets a gradient whatever its dtype (an index
    # table kept as a frozen nn.Parameter); a complex one HybridAdamW cannot update is refused.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ref = copy.deepcopy(model)
    table = torch.nn.Parameter(torch.arange(4), requires_grad=False)
    opt = hytrain.HybridAdamW([*model.parameters(), table], lr=1e-2)
    ref_opt = torch.optim.AdamW([*ref.parameters(), torch.nn.Parameter(torch.arange(4), requires_grad=False)],
                                lr=1e-2, foreach=False)
    for _ in range(3):
        x = torch.randn(4, 8)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(model.weight, ref.weight)
    assert table.tolist() == [0, 1, 2, 3] and len(opt.state_dict()["state"]) == 2
    with pytest.raises(TypeError, match=r"parameter 0 \(shape \(2,\)\) has dtype torch.complex64"):
        hytrain.HybridAdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))])


def test_add_param_group_progressive_unfreezing():
    def case(model, opt, xs):
        train(model, opt, xs[:2])
        opt.add_param_group({"params": model.embed.parameters(), "lr": 3e-3})
        train(model, opt, xs[2:])

    def build(m):
        return [p for n, p in m.named_parameters() if not n.startswith("embed")]
    model, opt, ref, ref_opt = pair(hybrid=build)
    xs = batches(5)
    case(model, opt, xs)
    case(ref, ref_opt, xs)
    assert_same_weights(model, ref)


def test_torch_keywords():
    model = Net()
    hytrain.HybridAdamW(model.parameters(), foreach=False, fused=False, maximize=False)
    hytrain.HybridAdamW(model.parameters(), foreach=True, fused=None, capturable=False, differentiable=False)
    with pytest.raises(ValueError, match="capturable"):
        hytrain.HybridAdamW(model.parameters(), capturable=True)
    with pytest.raises(ValueError, match="differentiable"):
        hytrain.HybridAdamW(model.parameters(), differentiable=True)


def test_amsgrad_switched_mid_run_is_refused_by_name():
    model = Net()
    opt = hytrain.HybridAdamW(model.parameters(), workers=1)
    train(model, opt, batches(1))
    opt.param_groups[0]["amsgrad"] = True
    model(batches(1)[0]).backward()
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()


# ---- torch's own optimizer test inputs for AdamW ----------------------------------------------------


def _adamw_info():
    pytest.importorskip("expecttest")
    from torch.testing._internal.common_optimizers import optim_db
    return next(o for o in optim_db if o.optim_cls is torch.optim.AdamW)


def test_torch_optim_db_inputs():
    """Every AdamW configuration of torch's optimizer tests, trained against torch's AdamW."""
    info = _adamw_info()
    inputs = info.optim_inputs_func(device="cpu", dtype=torch.float32)
    assert inputs
    for inp in inputs:
        def case(model, opt, xs):
            train(model, opt, xs)
        both(case, with_model=False, steps=3, **inp.kwargs)


# Cases where HybridAdamW's answer differs from torch's on purpose (the expected type is then ours).
_ERROR_DIFFERENCES = {
    # torch warns and keeps the duplicate (it would be stepped twice); HybridAdamW refuses it.
    "a param group cannot have duplicate parameters": ValueError,
    # A limit of torch's foreach kernels; HybridAdamW's update takes tensor hyperparameters.
    "lr as Tensor doesn't work with foreach & not capturable": None,
    "betas\\[0\\] as a Tensor is not supported for capturable=False and foreach=True": None,
}


def test_torch_optim_db_error_inputs():
    """Every AdamW error case of torch's optimizer tests: HybridAdamW refuses it with the same type
    of error (or, where listed above, on purpose differently)."""
    import warnings

    info = _adamw_info()
    cases = info.optim_error_inputs_func(device="cpu", dtype=torch.float32)
    assert cases
    for case in cases:
        inp = case.optimizer_error_input
        params = inp.params if inp.params is not None else [torch.nn.Parameter(torch.randn(2, 2))]
        expected = _ERROR_DIFFERENCES.get(inp.desc, case.error_type)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                opt = hytrain.HybridAdamW(params, **inp.kwargs)
                if case.error_on.name == "STEP_ERROR":
                    for p in opt.param_groups[0]["params"]:
                        p.grad = torch.rand_like(p)
                    opt.step()
                raised = None
            except Exception as e:  # noqa: BLE001
                raised = e
        if expected is None:
            assert raised is None, (inp.desc, raised)
        elif issubclass(expected, Warning):
            assert any(issubclass(w.category, expected) for w in seen) or raised is not None, inp.desc
        else:
            assert isinstance(raised, expected), (inp.desc, raised)


def test_timm_vision_transformer_blocks():
    timm = pytest.importorskip("timm")
    model = timm.models.vision_transformer.VisionTransformer(img_size=16, patch_size=8, embed_dim=32, depth=3,
                                                             num_heads=2, num_classes=3)
    opt = hytrain.HybridAdamW(model.parameters(), model=model)
    assert len(opt.blocks) == 5  # patch embedding and tokens, three blocks, the final norm and head


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_bf16_weights_rolled_back_are_what_training_continues_from(with_model):
    """bf16 weights with fp32 masters: weights the loop writes between steps (a rollback) are where
    the next update starts, as with torch's AdamW on those weights (here: on fp32 copies of them)."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, workers=1,
                              model=model if with_model else None)
    master = [p.detach().float().clone().requires_grad_(True) for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1, foreach=False)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    xs = [x.to(torch.bfloat16) for x in batches(5)]
    for i, x in enumerate(xs):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).float().backward()
            if o is ref_opt:
                for mp, p in zip(master, ref.parameters()):
                    mp.grad = p.grad.float()
            o.step()
            if o is ref_opt:
                with torch.no_grad():
                    for mp, p in zip(master, ref.parameters()):
                        p.copy_(mp)
            m.zero_grad()
        if i == 2:  # roll both back to the initial weights; the moments go on
            model.load_state_dict(saved)
            ref.load_state_dict(saved)
            with torch.no_grad():
                for mp, p in zip(master, ref.parameters()):
                    mp.copy_(p)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2, msg=name)
        assert (a.float() - b.float()).abs().max() <= 2 * a.float().abs().max() * 2 ** -8, name


def test_step_right_after_step_waits_for_the_previous_update():
    """A second step() (no gradients, or more after zero_grad) while the first step's CPU updates are
    still running: it waits for them, and the result is torch's."""
    model, opt, ref, ropt = pair(make=big_net, with_model=True, exact=True)
    x = batches(1)[0]
    for m, o in ((model, opt), (ref, ropt)):
        m(x).backward()
        o.step()
        o.zero_grad()
        o.step()  # nothing to update: torch does nothing either
        m(x).backward()
        o.step()
        o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_the_state_read_or_written_right_after_step_is_current():
    """opt.state[p] right after step() is the state that step wrote, and a write to it is not lost
    to the update still running (the fence waits for the block first)."""
    model, opt, _, _ = pair(make=big_net, with_model=True)
    x = batches(1)[0]
    seen, wrote = [], []
    for _ in range(3):
        model(x).backward()
        opt.step()
        p = model.layers[0].up.weight
        early = opt.state[p]["exp_avg"].clone()
        opt.synchronize()
        seen.append(torch.equal(early, opt.state[p]["exp_avg"]))
        model(x).backward()
        opt.step()
        opt.state[p]["exp_avg"].zero_()
        opt.synchronize()
        wrote.append(not opt.state[p]["exp_avg"].any())
        opt.zero_grad()
    assert all(seen) and all(wrote)


def test_pickling_or_copying_the_optimizer_is_refused_clearly():
    import pickle

    model, opt, _, _ = pair(with_model=True)
    model(batches(1)[0]).backward()
    opt.step()
    for copier in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="state_dict"):
            copier(opt)
    opt.step()  # the original goes on


# ---- FSDP2 parameters (DTensors): their local shards read right after step() ---------------------


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one process, in this process (FSDP2 shards over a mesh of one)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded_pair(fence=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = []
    for overlap in (True, False):
        torch.manual_seed(0)
        model = big_net()
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        out += [model, hytrain.HybridAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, workers=1,
                                           model=model, overlap=overlap, fence=fence)]
    return out


READS = {"to_local": lambda p: p.to_local().clone(), "full_tensor": lambda p: p.full_tensor().clone(),
         "to_local_no_grad": lambda p: _no_grad(lambda: p.to_local().clone())}


def _no_grad(f):
    with torch.no_grad():
        return f()


@pytest.mark.parametrize("read", list(READS))
def test_fsdp2_shards_read_right_after_step_see_the_updates(one_rank, read):
    # p.to_local() hands out the shard (a view of it with grad enabled), and full_tensor() gathers it:
    # neither touches the parameter itself, so the fence must know the shards, and views by their base.
    model, opt, ref, ref_opt = _sharded_pair()
    xs = batches(3)
    got = train(model, opt, xs, after_step=lambda i: [READS[read](p) for p in model.parameters()])
    want = train(ref, ref_opt, xs, after_step=lambda i: [READS[read](p) for p in ref.parameters()])
    assert_same_tensors([t for step in got for t in step], [t for step in want for t in step], True)

