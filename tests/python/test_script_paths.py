"""What scripts do to an optimizer besides step(), beyond optimizer.state (test_state_surgery.py):
torch's state-dict hooks, writes to the weights by any path, pickling and copying the model, a
parameter swapped in param_groups, layouts and dtypes torch accepts, and other threads. Each case
against torch.optim.AdamW (or the rule torch follows), with and without ``model=``."""

import copy
import io
import pickle
import threading

import pytest
import torch

import hytrain

WITH_MODEL = pytest.mark.parametrize("with_model", [False, True], ids=["plain", "model"])


def _mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def _hybrid(model, with_model, **kw):
    kw.setdefault("lr", 3e-2)
    return hytrain.HybridAdamW(model.parameters(), model=model if with_model else None, **kw)


def _batches(n, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)) for _ in range(n)]


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


# -- torch's hooks -------------------------------------------------------------------------------------

@WITH_MODEL
def test_state_dict_hooks_run_as_torch_runs_them(with_model):
    def run(opt, model):
        calls = []
        opt.register_state_dict_pre_hook(lambda o: calls.append(("save_pre", o is opt)))
        opt.register_state_dict_post_hook(lambda o, sd: (calls.append(("save_post", len(sd["state"]))),
                                                         {**sd, "extra": 7})[1])
        opt.register_load_state_dict_pre_hook(
            lambda o, sd: (calls.append(("load_pre", sd.get("extra"))), _with_lr(sd, 0.125))[1])
        opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o.param_groups[0]["lr"])))
        x, y = _batches(1)[0]
        _loss(model, x, y).backward()
        opt.step()
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        return calls, sd.get("extra"), opt.param_groups[0]["lr"]

    m1, m2 = _mlp(), _mlp()
    got = run(_hybrid(m1, with_model), m1)
    want = run(torch.optim.AdamW(m2.parameters(), lr=3e-2), m2)
    assert got == want
    assert got[0] == [("save_pre", True), ("save_post", 6), ("load_pre", 7), ("load_post", 0.125)]


def _with_lr(sd, lr):
    sd = dict(sd)
    sd["param_groups"] = [{**g, "lr": lr} for g in sd["param_groups"]]
    return sd


def test_a_load_pre_hook_that_edits_the_dict_is_what_loads():
    model = _mlp()
    opt = _hybrid(model, True)
    for x, y in _batches(2):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())
    fresh = _hybrid(model, True)

    def zero_moments(o, d):
        for entry in d["state"].values():
            entry["exp_avg"] = torch.zeros_like(entry["exp_avg"])
    fresh.register_load_state_dict_pre_hook(zero_moments)
    fresh.load_state_dict(sd)
    got = fresh.state_dict()["state"]
    assert all(float(e["exp_avg"].abs().max()) == 0.0 for e in got.values())
    assert all(float(e["exp_avg_sq"].abs().max()) > 0.0 for e in got.values())


# -- writes to the weights -----------------------------------------------------------------------------

def _write(model, how):
    ps = list(model.parameters())
    if how == "data_zero":
        ps[0].data.zero_()
    elif how == "data_clamp":  # WGAN's weight clipping
        for p in ps:
            p.data.clamp_(-0.05, 0.05)
    elif how == "detached_copy":
        ps[2].detach().copy_(torch.full_like(ps[2], 0.25))
    elif how == "no_grad_inplace":
        with torch.no_grad():
            ps[4].mul_(0.5)
    elif how == "data_assigned":
        ps[0].data = torch.zeros_like(ps[0])
    else:
        raise AssertionError(how)


WRITES = ["data_zero", "data_clamp", "detached_copy", "no_grad_inplace", "data_assigned"]


def _reference(how, when, steps, dtype):
    """torch's AdamW over fp32 masters of a ``dtype`` model: each step from the weights the script
    left (a written element is what the next update starts from; the others keep their master's
    precision), the model's weights the masters' rounding after each step -- the rule torch's AdamW
    follows for its own parameters, at HybridAdamW's precision."""
    model = _mlp(dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=3e-2, foreach=False)
    out = []
    for i, (x, y) in enumerate(_batches(steps, dtype)):
        if i == 2 and when == "before_forward":
            _write(model, how)
        _loss(model, x, y).backward()
        if i == 2 and when == "before_step":
            _write(model, how)
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                # Elements the script wrote (not their master's rounding) take the written value.
                m.copy_(torch.where(p != m.to(dtype), p.float(), m))
                m.grad = p.grad.float()
                p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        out.append([m.detach().clone() for m in masters])
    return out


@WITH_MODEL
@pytest.mark.parametrize("when", ["before_forward", "before_step"])
@pytest.mark.parametrize("how", WRITES)
def test_weight_writes_are_what_the_next_update_starts_from(how, when, with_model):
    dtype = torch.bfloat16
    steps = 5
    model = _mlp(dtype)
    opt = _hybrid(model, with_model)
    got = []
    for i, (x, y) in enumerate(_batches(steps, dtype)):
        if i == 2 and when == "before_forward":
            _write(model, how)
        _loss(model, x, y).backward()
        if i == 2 and when == "before_step":
            _write(model, how)
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        got.append([opt.state[p]["master"].clone() for p in model.parameters()])
    want = _reference(how, when, steps, dtype)
    for step, (a, b) in enumerate(zip(got, want), 1):
        for i, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{how} {when}, step {step}, "
                                       f"param {i}: {m}")


def test_a_zeroed_weight_moves_by_one_step_only():
    """The issue's figure: after ``p.data.zero_()`` one step at lr moves each weight by at most about lr."""
    model = _mlp(torch.bfloat16)
    opt = _hybrid(model, True, lr=1e-3)
    x, y = _batches(1, torch.bfloat16)[0]
    _loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    for p in model.parameters():
        p.data.zero_()
    _loss(model, x, y).backward()
    opt.step()
    opt.synchronize()
    assert max(float(p.abs().max()) for p in model.parameters()) <= 1.1e-3


def test_watch_writes_false_sees_only_the_counters():
    model = _mlp(torch.bfloat16)
    opt = _hybrid(model, False, lr=1e-3, watch_writes=False)
    x, y = _batches(1, torch.bfloat16)[0]
    for _ in range(2):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        for p in model.parameters():
            p.data.zero_()  # unseen: the next step starts from the master
    assert max(float(opt.state[p]["master"].abs().max()) for p in model.parameters()) > 0.05
    with pytest.raises(TypeError, match="watch_writes"):
        hytrain.HybridAdamW(model.parameters(), watch_writes="yes")


def test_fingerprint_kernel_against_its_definition():
    """The host fingerprint against a Python transcription of fingerprint.h, on fresh random bytes."""
    from hytrain._native import native

    def mix(i, w):
        m = 0xFFFFFFFF
        x = ((i & m) * 0x9E3779B1 + ((w + 1) & m) * 0x85EBCA77) & m
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & m
        x ^= x >> 12
        x = (x * 0x297A2D39) & m
        return x ^ (x >> 15)

    g = torch.Generator().manual_seed(torch.seed() % (1 << 62))
    for n in (0, 1, 2, 7, 4096, 10001):
        b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        raw = bytes(b.tolist())
        words = [raw[2 * i] | (raw[2 * i + 1] << 8) for i in range(n // 2)] + ([raw[-1]] if n % 2 else [])
        want = sum(mix(i, w) for i, w in enumerate(words)) % (1 << 64)
        assert native().fingerprint(b.data_ptr() if n else 0, n) == want


# -- pickling and copying the model ------------------------------------------------------------------

def test_model_stays_picklable_and_copyable():
    model = _mlp()
    opt = _hybrid(model, True)
    for x, y in _batches(2):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save(model, buf)  # right after step(): the save waits for the updates in flight
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    clone = copy.deepcopy(model)
    pickled = pickle.loads(pickle.dumps(model))
    for other in (loaded, clone, pickled):
        for p, q in zip(model.parameters(), other.parameters()):
            assert torch.equal(p, q)
        x, y = _batches(1)[0]
        _loss(other, x, y).backward()  # the copies' hooks do nothing: they train with torch's AdamW
        torch.optim.AdamW(other.parameters()).step()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batches(1)[0]
    _loss(model, x, y).backward()
    opt.step()
    opt.synchronize()
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))


# -- a parameter swapped in param_groups ---------------------------------------------------------------

@WITH_MODEL
def test_a_parameter_swapped_in_param_groups_starts_afresh_as_in_torch(with_model):
    def run(make):
        model = _mlp()
        opt = make(model)
        out = []
        for i, (x, y) in enumerate(_batches(6)):
            if i == 3:
                fresh = torch.nn.Parameter(torch.full_like(model[2].weight, 0.01))
                model[2].weight = fresh
                opt.param_groups[0]["params"][2] = fresh
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            out.append([p.detach().clone() for p in model.parameters()])
        return out, opt, model

    got, opt, model = run(lambda m: _hybrid(m, with_model))
    want, ref, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-2, foreach=False))
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert float(opt.state[model[2].weight]["step"]) == 3.0
    # (torch's own state_dict() raises KeyError here: its state keeps the swapped-out parameter.)
    assert len(opt.state_dict()["state"]) == 6


def test_clipping_after_the_groups_were_swapped_reads_the_new_parameters():
    # What accelerate's FSDP2 preparation does: the optimizer is built over the model's parameters,
    # then its groups are given the sharded ones. A clip before the first step measures and clips the
    # gradients of the parameters in the groups now, as torch's clip_grad_norm_ over them would.
    torch.manual_seed(0)
    first, second = _mlp(), _mlp(seed=1)
    opt = hytrain.HybridAdamW(first.parameters(), lr=1e-2, workers=1)
    opt.param_groups[0]["params"] = list(second.parameters())
    x, y = _batches(1)[0]
    _loss(second, x, y).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in second.parameters()])
    assert float(opt.clip_grad_norm_(1e-3)) == pytest.approx(float(want), rel=1e-6) and float(want) > 1e-3
    before = [p.detach().clone() for p in second.parameters()]
    opt.step()
    opt.synchronize()
    assert all(not torch.equal(a, p) for a, p in zip(before, second.parameters()))


def test_a_model_whose_parameters_were_replaced_after_the_optimizer_is_refused():
    # fully_shard (or any swap of every parameter) after HybridAdamW(model=...) was built: the model's
    # new parameters would never be updated, silently; refused at the step instead.
    model = _mlp()
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-2, model=model, workers=1)
    for name, p in list(model.named_parameters()):
        module, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module), leaf, torch.nn.Parameter(p.detach().clone()))
    x, y = _batches(1)[0]
    _loss(model, x, y).backward()
    with pytest.raises(ValueError, match="none of this optimizer's parameters is a parameter of its model"):
        opt.step()


# -- layouts and dtypes --------------------------------------------------------------------------------

def _convnet(dtype=torch.float32, channels_last=True):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)).to(dtype)
    return m.to(memory_format=torch.channels_last) if channels_last else m


def _conv_run(model, opt, steps=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(2, 3, 10, 10, generator=g).to(dtype)
        if model[0].weight.is_contiguous(memory_format=torch.channels_last):
            x = x.to(memory_format=torch.channels_last)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize() if hasattr(opt, "synchronize") else None
    return [p.detach().clone() for p in model.parameters()]


@WITH_MODEL
def test_channels_last_trains_as_torch(with_model):
    a = _convnet(channels_last=True)
    assert not a[0].weight.is_contiguous()
    got = _conv_run(a, _hybrid(a, with_model))
    ref = _convnet(channels_last=True)
    want = _conv_run(ref, torch.optim.AdamW(ref.parameters(), lr=3e-2, foreach=False))
    for x, y in zip(got, want):
        assert x.stride() == y.stride()
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layout_changes_nothing_element_by_element(dtype):
    """The same values and gradients in a channels_last, a transposed and a contiguous parameter give
    the same updates, element by element, and the same state (read in each one's logical order).
    (fp32 states: compact ones round by position in memory -- bf16's stochastic rounding, 8-bit's
    blocks -- so a layout changes their rounding, not their accuracy; see the round trips below.)"""
    state_format = "fp32"
    g = torch.Generator().manual_seed(3)
    values = torch.randn(4, 6, 5, 3, generator=g).to(dtype)
    grads = [torch.randn(4, 6, 5, 3, generator=g).to(dtype) for _ in range(3)]
    layouts = {"contiguous": lambda t: t.contiguous(), "channels_last": lambda t: t.to(memory_format=torch.channels_last),
               "transposed": lambda t: t.transpose(0, 3).contiguous().transpose(0, 3)}
    out = {}
    for name, lay in layouts.items():
        p = torch.nn.Parameter(lay(values.clone()))
        assert name == "contiguous" or not p.is_contiguous()
        opt = hytrain.HybridAdamW([p], lr=1e-2, state_format=state_format)
        for gr in grads:
            p.grad = lay(gr.clone())
            opt.step()
        out[name] = (p.detach().clone(), {k: v.clone() for k, v in opt.state_dict()["state"][0].items()})
    base_w, base_s = out.pop("contiguous")
    for name, (w, st) in out.items():
        assert torch.equal(w, base_w), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], base_s[key]), (name, key)


def test_channels_last_8bit_states_keep_each_element_in_place():
    """fp32 m and v of a channels_last parameter through 8-bit states and back: each element within
    the quantisation error of its own value (a layout mix-up would move values between elements)."""
    model = _convnet()
    p = model[0].weight
    wide = _hybrid(model, True)
    _conv_run(model, wide, steps=2)
    sd = copy.deepcopy(wide.state_dict())
    narrow = _hybrid(model, True, state_format="8bit")
    narrow.load_state_dict(sd)
    _conv_run(model, narrow, steps=0)
    back = _hybrid(model, True)
    back.load_state_dict(narrow.state_dict())
    _conv_run(model, back, steps=0)
    want, got = sd["state"][0]["exp_avg"], back.state_dict()["state"][0]["exp_avg"]
    assert got.shape == p.shape
    scale = want.abs().amax()
    assert float((got - want).abs().max()) <= 0.05 * float(scale)
    want, got = sd["state"][0]["exp_avg_sq"], back.state_dict()["state"][0]["exp_avg_sq"]
    assert float(((got.sqrt() - want.sqrt()).abs()).max()) <= 0.05 * float(want.sqrt().amax())


@pytest.mark.parametrize("state_format", ["bf16", "8bit"])
def test_channels_last_compact_states_round_trip(state_format):
    """Compact m and v of a channels_last parameter: a state dict loaded into a new optimizer
    continues as the uninterrupted run does."""
    model = _convnet(torch.bfloat16)
    opt = _hybrid(model, True, state_format=state_format)
    _conv_run(model, opt, steps=3, dtype=torch.bfloat16)
    sd = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    want = _conv_run(model, opt, steps=2, dtype=torch.bfloat16)
    for p, w in zip(model.parameters(), weights):
        p.data.copy_(w)
    again = _hybrid(model, True, state_format=state_format)
    again.load_state_dict(sd)
    got = _conv_run(model, again, steps=2, dtype=torch.bfloat16)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_dtypes_and_duplicates_torch_would_take():
    with pytest.raises(TypeError, match="float64.*model.float"):
        hytrain.HybridAdamW(torch.nn.Linear(2, 2).double().parameters())
    with pytest.raises(TypeError, match="complex"):
        hytrain.HybridAdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))])
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="appears more than once.*pass each parameter once"):
        hytrain.HybridAdamW([lin.weight, lin.bias, lin.weight])
    with pytest.raises(ValueError, match="must be dense"):
        opt = hytrain.HybridAdamW([torch.nn.Parameter(torch.zeros(4, 4)[:, :2])])
        opt.param_groups[0]["params"][0].grad = torch.zeros(4, 2)
        opt.step()


# -- other threads -------------------------------------------------------------------------------------

def test_another_thread_sees_the_update_after_synchronize():
    """The contract's one call for other threads: after ``synchronize()`` (or a state dict taken on
    the training thread) a reader on another thread sees the updated weights."""
    model = _mlp(torch.bfloat16)
    opt = _hybrid(model, True)
    reference = copy.deepcopy(model)
    ref_opt = _hybrid(reference, False)  # without model=: step() returns with its updates done
    seen, ready, done = [], threading.Event(), threading.Event()

    def reader():
        while not done.is_set():
            if ready.wait(0.05):
                ready.clear()
                seen.append([p.detach().clone() for p in model.parameters()])
                consumed.set()
    consumed = threading.Event()
    t = threading.Thread(target=reader)
    t.start()
    try:
        for x, y in _batches(5, torch.bfloat16):
            for m, o in ((model, opt), (reference, ref_opt)):
                _loss(m, x, y).backward()
                o.step()
                o.zero_grad()
            opt.synchronize()
            ready.set()
            assert consumed.wait(10)
            consumed.clear()
            assert all(torch.equal(a, b) for a, b in zip(seen[-1], reference.parameters()))
    finally:
        done.set()
        t.join()


def test_lightning_async_checkpoint_holds_the_step_it_was_taken_at(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, _):
            x, y = batch
            return _loss(self.net, x, y)

        def configure_optimizers(self):
            return hytrain.HybridAdamW(self.parameters(), lr=3e-2, model=self.net)

    seen = {}

    class Snap(pl.Callback):
        def on_train_batch_end(self, trainer, module, *_):
            if trainer.global_step == 3:
                seen["weights"] = {k: v.clone() for k, v in module.state_dict().items()}
                trainer.save_checkpoint(tmp_path / "at3.ckpt")

    data = torch.utils.data.DataLoader(_batches(6), batch_size=None)
    trainer = pl.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[AsyncCheckpointIO()], callbacks=[Snap()],
                         accelerator="cpu", devices=1)
    trainer.fit(Module(), data)
    saved = torch.load(tmp_path / "at3.ckpt", weights_only=False)["state_dict"]
    assert saved.keys() == seen["weights"].keys()
    for k, v in saved.items():
        assert torch.equal(v, seen["weights"][k]), k


def test_dcp_async_save_holds_the_step_it_was_taken_at(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _mlp()
    opt = _hybrid(model, True)
    batches = _batches(6)
    for x, y in batches[:3]:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)  # on the training thread: waits for the updates in flight
    want = {k: v.clone() for k, v in msd.items()}
    future = dcp.async_save({"model": msd}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    for x, y in batches[3:]:  # training goes on while the writer thread runs
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    (future.upload_completion if hasattr(future, "upload_completion") else future).result()
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load({"model": got}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    for k in want:
        assert torch.equal(got[k], want[k]), k
