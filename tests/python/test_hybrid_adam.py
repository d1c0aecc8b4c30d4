"""HybridAdamW against a reference (the same model with fp32 master weights and torch.optim.AdamW under
the same mixed precision and clipping), 30 steps of a small Llama-style model on the CPU; accumulation,
LR schedules, GradScaler with a forced overflow, state_dict round trips, and bad input."""

import copy
import json

import pytest
import torch

import hytrain
from hytrain.models import LlamaConfig, LlamaModel

STEPS = 30
CFG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                  num_kv_heads=2, max_seq_len=64)


def counting(g, shape, vocab):
    """Rows that count up from a random start (mod ``vocab``): each token predicts the next, so the
    next-token loss can fall (on random tokens it stays at ln V, whatever the optimizer does)."""
    start = torch.randint(0, vocab, (*shape[:-1], 1), generator=g)
    return (start + torch.arange(shape[-1])) % vocab


def batches(n, micro=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[counting(g, (2, 32), CFG.vocab_size) for _ in range(micro)] for _ in range(n)]


class Reference:
    """fp32 master copies + torch.optim.AdamW(foreach=False); the model keeps its own dtype."""

    def __init__(self, model, lr, max_grad_norm=None, **kw):
        self.model = model
        self.params = list(model.parameters())
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, foreach=False, **kw)
        self.max_grad_norm = max_grad_norm
        self.clipped = 0
        self.norms = []

    def step(self, inv_scale=1.0, skip=False):
        if skip:
            return
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float() * inv_scale
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.master, self.max_grad_norm)
            self.norms.append(float(norm))
            self.clipped += int(norm > self.max_grad_norm)
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def pair(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    model = LlamaModel(CFG).to(dtype)
    return model, copy.deepcopy(model)


def assert_close_models(a, b, losses_a, losses_b, dtype):
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(torch.tensor(losses_a), torch.tensor(losses_b), rtol=tol, atol=tol)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.float(), pb.float(), rtol=tol, atol=tol, msg=name)


def train(model, opt, data, *, scaler=None, step_fn=None, overflow_at=None, sched=None):
    losses = []
    for i, micro in enumerate(data):
        for x in micro:
            loss = model(x, x) / len(micro)
            if overflow_at == i:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler else loss).backward()
        losses.append(loss.item() * len(micro))
        if step_fn is not None:
            step_fn(i)
        elif scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    if isinstance(opt, hytrain.HybridAdamW):
        opt.synchronize()
    return losses


@pytest.mark.parametrize("with_model", [True, False])
@pytest.mark.parametrize("max_grad_norm", [None, 0.3])
def test_matches_reference_bf16(with_model, max_grad_norm):
    model, ref_model = pair()
    opt = hytrain.HybridAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, max_grad_norm=max_grad_norm,
                              model=model if with_model else None, workers=2)
    ref = Reference(ref_model, lr=3e-3, weight_decay=0.1, max_grad_norm=max_grad_norm)
    data = batches(STEPS)
    norms = []
    losses = train(model, opt, data, step_fn=lambda i: (opt.step(), norms.append(opt.last_grad_norm)))
    ref_losses = []
    for micro in data:
        ref_losses.append(ref_model(micro[0], micro[0]).item())
        ref_model(micro[0], micro[0]).backward()
        ref.step()
        ref.zero_grad()
    assert_close_models(model, ref_model, losses, ref_losses, torch.bfloat16)
    if max_grad_norm is not None:
        assert 0 < ref.clipped < STEPS or ref.clipped == STEPS, "clipping should fire"
        assert ref.clipped > 0
        # bf16 weights: the two trajectories drift apart by bf16 roundings, more so as the loss falls fast
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref.norms), rtol=4e-2, atol=0)
    else:
        assert norms == [None] * STEPS
    assert losses[-1] < losses[0]


def test_fp32_model_is_nearly_exact_and_nothing_changes_before_step():
    model, ref_model = pair(torch.float32)
    # release_grads=True: the loop does not touch the gradients between backward and step(); the
    # weights still change only in step(), as torch's (the loop may change lr until then).
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, workers=2, release_grads=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
    data = batches(10)
    losses, updated_in_backward = [], []
    for (x,) in data:
        before = [p.detach().clone() for p in model.parameters()]
        loss = model(x, x)
        loss.backward()
        opt.synchronize()  # waits for the updates launched from the backward hooks (if any)
        updated_in_backward.append([not torch.equal(a, p) for a, p in zip(before, model.parameters())])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.synchronize()
    ref_losses = train(ref_model, ref, data)
    assert_close_models(model, ref_model, losses, ref_losses, torch.float32)
    assert not any(any(u) for u in updated_in_backward)


def test_accumulation_over_4_micro_batches_equals_one_big_step():
    model, ref_model = pair(torch.float32)
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, accumulation_steps=4, workers=2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
    data = batches(8, micro=4)
    assert_close_models(model, ref_model, train(model, opt, data), train(ref_model, ref, data), torch.float32)


def test_an_extra_backward_accumulates_as_in_torch():
    """On the CPU nothing is handed off during backward: a second backward before step() adds to the
    gradients, as with torch's optimizers (on CUDA with released gradients it is refused: see the GPU
    tests)."""
    model, ref_model = pair(torch.float32)
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, workers=2, release_grads=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
    x = batches(1)[0][0]
    for m, o in ((model, opt), (ref_model, ref)):
        for _ in range(3):
            m(x, x).backward()
            m(x, x).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_lr_scheduler_changes_lr_every_step():
    model, ref_model = pair(torch.float32)
    opt = hytrain.HybridAdamW(model.parameters(), lr=2e-3, model=model, workers=2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=2e-3, foreach=False)
    s1 = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    s2 = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1.0 / (1 + s))
    data = batches(12)
    a = train(model, opt, data, sched=s1)
    b = train(ref_model, ref, data, sched=s2)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 / 13)
    assert_close_models(model, ref_model, a, b, torch.float32)


def test_grad_scaler_skips_the_overflow_step():
    model, ref_model = pair(torch.float32)
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, workers=2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
    sa = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sb = torch.amp.GradScaler("cpu", init_scale=1024.0)
    data = batches(10)
    a = train(model, opt, data, scaler=sa, overflow_at=4)
    b = train(ref_model, ref, data, scaler=sb, overflow_at=4)
    assert sa.get_scale() == sb.get_scale() == 512.0  # halved once, by the forced overflow
    step_counts = {int(st["step"].item()) for st in opt.state.values()}
    assert step_counts == {9}
    assert_close_models(model, ref_model, a[:4] + a[5:], b[:4] + b[5:], torch.float32)


def test_state_dict_round_trip_continues_identically(tmp_path):
    data = batches(12)
    model, _ = pair()
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, workers=2)
    full = train(model, opt, data)
    model2, _ = pair()
    opt2 = hytrain.HybridAdamW(model2.parameters(), lr=1e-3, model=model2, workers=2)
    first = train(model2, opt2, data[:6])
    torch.save({"model": model2.state_dict(), "opt": opt2.state_dict()}, tmp_path / "ck.pt")
    saved = torch.load(tmp_path / "ck.pt")
    assert {"exp_avg", "exp_avg_sq", "step", "master"} <= set(saved["opt"]["state"][0])
    assert saved["opt"]["state"][0]["exp_avg"].device.type == "cpu"
    model3, _ = pair(seed=1)
    model3.load_state_dict(saved["model"])
    opt3 = hytrain.HybridAdamW(model3.parameters(), lr=1e-3, model=model3, workers=2)
    opt3.load_state_dict(saved["opt"])
    second = train(model3, opt3, data[6:])
    assert first + second == full  # bit-identical on the CPU
    for a, b in zip(model.parameters(), model3.parameters()):
        assert torch.equal(a, b)


def test_zero_lr_step_on_zero_gradients_is_harmless():
    model, _ = pair(torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    opt = hytrain.HybridAdamW(model.parameters(), lr=0.0, workers=1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_input():
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="non-leaf|not a leaf"):
        hytrain.HybridAdamW([lin.weight * 2])
    with pytest.raises(TypeError, match="complex64"):
        hytrain.HybridAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    # A frozen int64 one is skipped (as torch skips it); alone, the message says what it got.
    with pytest.raises(ValueError, match=r"no parameter that requires gradients: all 1 have requires_grad=False "
                                         r"\(int64\)"):
        hytrain.HybridAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)])
    with pytest.raises(ValueError, match="empty parameter list"):  # torch's own check
        hytrain.HybridAdamW([])
    # Device and dtype are those the parameters have at the first step (they may still move).
    with pytest.raises(TypeError, match="float64.*model.float"):  # refused at construction
        hytrain.HybridAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    cast_later = torch.nn.Parameter(torch.zeros(3))
    opt = hytrain.HybridAdamW([cast_later], workers=1)
    cast_later.data = cast_later.data.double()  # cast after construction: refused at the first step
    cast_later.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        opt.step()
    for params, kw, err, msg in [([lin.weight, torch.nn.Parameter(torch.zeros(3, device="meta"))], {}, ValueError,
                                  "is on meta"),
                                 (list(lin.parameters()), {"gpu_blocks": 1}, ValueError, "gpu_blocks > 0 needs CUDA")]:
        opt = hytrain.HybridAdamW(params, workers=1, **kw)
        with pytest.raises(err, match=msg):
            opt.step()
        assert not opt.bound and len(opt.state) == 0
    with pytest.raises(ValueError, match="only 1 blocks"):
        hytrain.HybridAdamW(lin.parameters(), gpu_blocks=2)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        hytrain.HybridAdamW(lin.parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        hytrain.HybridAdamW(lin.parameters(), max_grad_norm=0.0)
    for bad in ("sometimes", -1, 1.5):
        with pytest.raises((TypeError, ValueError), match="speculate"):
            hytrain.HybridAdamW(lin.parameters(), speculate=bad)
    with pytest.raises(ValueError, match="host_memory_limit"):
        hytrain.HybridAdamW(lin.parameters(), host_memory_limit=0)
    opt = hytrain.HybridAdamW(lin.parameters(), workers=1)
    opt.param_groups[0]["lr"] = float("nan")
    lin.weight.grad = torch.ones(4, 4)
    before = lin.weight.detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr must be finite"):
        opt.step()
    assert torch.equal(lin.weight, before)  # a refused step changes nothing
    opt.param_groups[0]["lr"] = 1e-3
    opt.step()
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    bad["state"][0]["exp_avg"] = torch.zeros(5)
    state_before = opt.state[lin.weight]["exp_avg"].clone()
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state_dict(bad)
    assert torch.equal(opt.state[lin.weight]["exp_avg"], state_before)


def test_trace_of_the_cpu_path(tmp_path):
    model, _ = pair()
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, workers=2, trace=True)
    train(model, opt, batches(4))
    events = json.load(open(opt.export_trace(tmp_path / "t.json")))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    n = len(opt.blocks)
    assert {f"forward block {b}" for b in range(n - 1)} <= names
    assert {f"backward block {b}" for b in range(n)} <= names
    assert {f"AdamW block {b}" for b in range(n)} <= names
    # The last three iterations are kept, each with one update per block.
    updates = [e for e in spans if e["name"].startswith("AdamW")]
    assert len(updates) == 3 * n and all(e["dur"] > 0 for e in updates)
    its = sorted({e["args"]["iteration"] for e in spans})
    assert its == [1, 2, 3]
    with pytest.raises(RuntimeError, match="trace=True"):
        hytrain.HybridAdamW(model.parameters(), workers=1).export_trace(tmp_path / "x.json")


def test_exhausted_pool_is_a_clear_error_at_the_first_step():
    model, _ = pair()
    small = hytrain.PinnedPool("1MiB", slab_bytes="1MiB", pinned=False)
    opt = hytrain.HybridAdamW(model.parameters(), model=model, pool=small, workers=1)
    x = batches(1)[0][0]
    model(x, x).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    # Refused before anything is allocated, naming the bytes needed and the pool's room.
    with pytest.raises(hytrain.CapacityError, match=r"needs 1\.\d\d MiB of pinned host memory .* the pool given has room for 1\.00 MiB"):
        opt.step()
    # Nothing half made: no state, the weights and gradients as they were, and training can go on
    # with an optimizer whose pool is large enough.
    assert not opt.bound and len(opt.state) == 0 and small.stats()["in_use"] == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert all(p.grad is not None for p in model.parameters())
    del opt
    opt = hytrain.HybridAdamW(model.parameters(), model=model, workers=1)
    opt.step()
    opt.synchronize()
    assert any(not torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_clipping_refuses_a_non_finite_norm_and_keeps_the_state():
    torch.manual_seed(0)
    model = LlamaModel(CFG)
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0, model=model, workers=2)
    data = batches(2)
    train(model, opt, data[:1])
    saved = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    x = data[1][0]
    model(x, x).backward()
    next(model.parameters()).grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite gradient norm"):
        opt.step()
    opt.zero_grad()
    after = opt.state_dict()
    for i, st in saved["state"].items():
        for key, t in st.items():
            assert torch.equal(t, after["state"][i][key]), (i, key)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    train(model, opt, data[1:])  # and training goes on


def test_a_state_the_host_cannot_hold_is_refused_before_anything_is_allocated(monkeypatch):
    from hytrain.hybrid import budgets

    assert hytrain.pool.available_memory_bytes() > 0  # this machine tells
    model, _ = pair()
    opt = hytrain.HybridAdamW(model.parameters(), model=model, workers=1)
    x = batches(1)[0][0]
    model(x, x).backward()
    need = sum(opt._engine.store.block_host_bytes())
    per = 8 + (4 if next(model.parameters()).dtype != torch.float32 else 0)  # m, v (and an fp32 master)
    exact = sum(p.numel() for p in model.parameters()) * per
    assert exact <= need <= exact + 256 * 3 * len(list(model.parameters()))  # each tensor rounded to 256 bytes
    monkeypatch.setattr(budgets, "available_memory_bytes", lambda: need - 1)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(hytrain.CapacityError, match=r"of \d+ parameters needs \d+\.\d\d MiB of pinned host memory .* is \d+\.\d\d MiB"):
        opt.step()
    assert not opt.bound and len(opt.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    # The host keeps a margin beside the state (1 GiB, and 5 % of what is available or a tenth of
    # the memory in all): exactly enough is need plus that.
    from hytrain import pool as pool_module

    monkeypatch.setattr(pool_module, "memory_total_bytes", lambda: 40 << 30)  # (host_margin lives in pool.py)
    assert budgets.host_margin(80 << 30) == (1 << 30) + (4 << 30) == budgets.host_margin(20 << 30)
    assert budgets.host_margin(200 << 30) == (1 << 30) + (10 << 30)
    enough = need + (5 << 30) - 2
    while enough - budgets.host_margin(enough) < need:
        enough += 1
    monkeypatch.setattr(budgets, "available_memory_bytes", lambda: enough - 1)
    with pytest.raises(hytrain.CapacityError):
        opt.step()
    monkeypatch.setattr(budgets, "available_memory_bytes", lambda: enough)
    opt.step()  # exactly enough
    assert opt.bound
