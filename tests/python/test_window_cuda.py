"""Streamed weights on the GPU: the same model trained with its last layers streamed through a window
(hytrain.stream_model) and resident, one run after the other, bit for bit -- weights, masters,
moments, losses -- for k auto, 0 and 2; clipping with speculation; bf16 and fp16 under a GradScaler
with an overflow; fp32, bf16 and 8-bit states; accumulation; activation checkpointing. And what the
window saves: streamed layers hold no device memory between uses, the read-ahead runs, k stays below
the first streamed block."""

import copy

import pytest
import torch

import hytrain
from hytrain.models import LlamaConfig, LlamaModel

pytestmark = pytest.mark.gpu

DEV = "cuda"
CFG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_layers=6, num_heads=4,
                  num_kv_heads=2, max_seq_len=64)
STREAMED = 4  # layers 2..5: blocks 3..6 (block 0 is the embedding, 7 the norm and head)


def make(dtype=torch.bfloat16, seed=0, checkpointing=False):
    torch.manual_seed(seed)
    return LlamaModel(CFG, checkpointing=checkpointing).to(dtype).to(DEV)


def data(n, micro=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, CFG.vocab_size, (4, 65), generator=g).to(DEV) for _ in range(micro)] for _ in range(n)]


def run(m, opt, batches, scaler=None, overflow_at=None):
    losses = []
    for i, micro in enumerate(batches):
        for t in micro:
            loss = m(t[:, :-1], t[:, 1:]) / len(micro)
            if i == overflow_at:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler is not None else loss).backward()
            losses.append(loss.item())
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    opt.synchronize()
    return losses


def both(kw, *, dtype=torch.bfloat16, checkpointing=False, micro=1, steps=8, scaled=False, seed=0,
         stream=STREAMED, ends="auto"):
    """The resident run, then the streamed one (never interleaved); returns both and the window."""
    batches = data(steps, micro, seed)
    out = []
    for streamed in (False, True):
        m = make(dtype, seed, checkpointing)
        window = hytrain.stream_model(m, DEV, stream=stream, ends=ends) if streamed else None
        opt = hytrain.HybridAdamW(m.parameters(), model=m, workers=2, **kw)
        scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=3) if scaled else None
        losses = run(m, opt, batches, scaler, overflow_at=4 if scaled else None)
        out.append((m, opt, losses, window))
    return out


def assert_same(resident, streamed):
    (mr, opt_r, lr_, _), (ms, opt_s, ls, window) = resident, streamed
    assert lr_ == ls
    for (name, pr), ps in zip(mr.named_parameters(), ms.parameters()):
        got = window.weights(ps) if window.streams(ps) else ps.detach().cpu()
        assert torch.equal(pr.detach().cpu(), got.cpu()), name
        for key, val in opt_r.state[pr].items():
            assert torch.equal(val.cpu(), opt_s.state[ps][key].cpu()), (name, key)


@pytest.mark.parametrize("gpu_blocks", ["auto", 0, 2])
def test_streamed_is_resident_bit_for_bit_for_any_k(gpu_blocks):
    r, s = both(dict(lr=1e-3, weight_decay=0.1, gpu_blocks=gpu_blocks))
    assert_same(r, s)
    window, opt = s[3], s[1]
    assert window.streamed == [2, 3, 4, 5]
    assert all(p.untyped_storage().nbytes() == 0 for p in window.params)
    assert max(opt.residency()["gpu"], default=-1) < 3  # k stays below the first streamed block
    assert window.stats["prefetched"] > 0 and window.stats["max_loaded"] <= window.depth
    # The streamed layers' masters and moments never cross PCIe: ordinary memory; the CPU-updated
    # resident blocks' page-locked (they may move to the GPU); the homes page-locked (copied in).
    streamed_ids = {id(p) for p in window.params}
    for p in s[0].parameters():
        st = opt.state[p]
        if st["exp_avg"].is_cuda:
            continue  # (a GPU-updated block: k)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert st[key].is_pinned() is (id(p) not in streamed_ids), (tuple(p.shape), key)
    assert all(window.home(p).is_pinned() for p in window.params)


@pytest.mark.parametrize("case", ["fp32-auto-clip", "8bit-fp16-scaled", "bf16-accumulation"])
def test_the_embeddings_and_the_head_streamed_too_bit_for_bit(case):
    # ends=True: the embeddings and the head (final norm, LM head) are units of the window too; with
    # the embeddings streamed every block is updated on the host, whatever k the resident run takes.
    kw = {"fp32-auto-clip": dict(lr=1e-3, max_grad_norm=0.3, gpu_blocks="auto"),
          "8bit-fp16-scaled": dict(lr=1e-3, state_format="8bit", gpu_blocks="auto"),
          "bf16-accumulation": dict(lr=1e-3, state_format="bf16", accumulation_steps=2, gpu_blocks=0)}[case]
    r, s = both(kw, ends=True, dtype=torch.float16 if "fp16" in case else torch.bfloat16, scaled="fp16" in case,
                micro=2 if "accumulation" in case else 1, checkpointing="clip" in case)
    assert_same(r, s)
    window, opt, m = s[3], s[1], s[0]
    assert window.ends == ["embeddings", "head"] and window.streamed == [0, 3, 4, 5, 6, 7]
    assert opt.residency()["gpu"] == []
    ends = [m.embed.weight, m.norm.weight, m.lm_head.weight]
    assert all(window.streams(p) and p.untyped_storage().nbytes() == 0 for p in ends)
    assert window.stats["prefetched"] > 0 and window.stats["max_loaded"] <= window.depth


@pytest.mark.parametrize("state_format", ["bf16", "8bit"])
def test_streamed_state_formats_with_clipping_and_speculation(state_format):
    # (a limit that never clips: the resident run speculates and adopts; the streamed blocks never do)
    r, s = both(dict(lr=2e-3, max_grad_norm=1e6, gpu_blocks=1, state_format=state_format, speculate=1), steps=10)
    assert_same(r, s)
    counts = r[1].speculation_counts  # the resident run speculated; streamed blocks never do
    assert counts["adopted"] + counts["redone"] > 0, counts


def test_streamed_fp32_states_with_undo_records_and_checkpointing():
    r, s = both(dict(lr=2e-3, max_grad_norm=0.3, gpu_blocks=0, speculate=2), checkpointing=True, steps=10)
    assert_same(r, s)


def test_streamed_accumulation():
    r, s = both(dict(lr=1e-3, accumulation_steps=2, gpu_blocks=1), micro=2)
    assert_same(r, s)


@pytest.mark.parametrize("kw", [dict(max_grad_norm=1.0), dict(release_grads=False, speculate=False),
                                dict(max_grad_norm=1e6, speculate=1)], ids=["released", "kept", "speculated"])
@pytest.mark.parametrize("streamed", [False, True])
def test_accumulation_the_optimizer_was_not_told_of_is_refused_at_the_forward(kw, streamed):
    # After the first step, a backward hands its blocks to the host's update: a second micro-batch's
    # forward before step() (accumulation without accumulation_steps) is refused in one line before
    # it reads anything, and the step then goes on as if the loop had not tried: the same weights
    # and state as a run that never did.
    batches = data(4)
    out = []
    for tries in (False, True):
        m = make()
        if streamed:
            hytrain.stream_model(m, DEV, stream=STREAMED)
        opt = hytrain.HybridAdamW(m.parameters(), model=m, workers=2, lr=1e-3, gpu_blocks=1, **kw)
        for i, (t,) in enumerate(batches):
            m(t[:, :-1], t[:, 1:]).backward()
            if tries and i == 2:
                with pytest.raises(RuntimeError, match=r"accumulation_steps=<micro-batches per step>"):
                    m(t[:, :-1], t[:, 1:])
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        out.append((m, opt))
    (m0, opt0), (m1, opt1) = out
    for p0, p1 in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(opt0.state[p0]["master"].cpu(), opt1.state[p1]["master"].cpu())


def test_streamed_fp16_grad_scaler_with_an_overflow():
    r, s = both(dict(lr=1e-3, max_grad_norm=1e6, gpu_blocks=1, speculate=3), dtype=torch.float16, scaled=True,
                steps=10)
    assert_same(r, s)


def test_the_window_frees_device_memory_and_k_cannot_pass_it():
    m = make(seed=1)
    before = torch.cuda.memory_allocated()
    window = hytrain.stream_model(m, DEV, stream=STREAMED)
    layer_bytes = sum(window.layer_bytes(i) for i in window.streamed)
    assert before - torch.cuda.memory_allocated() >= layer_bytes
    opt = hytrain.HybridAdamW(m.parameters(), model=m, gpu_blocks=4)
    t = data(1, seed=1)[0][0]
    m(t[:, :-1], t[:, 1:]).backward()
    with pytest.raises(hytrain.CapacityError, match="gpu_blocks=4, but blocks 3 and up stream"):
        opt.step()


def test_auto_streams_every_layer_then_keeps_what_fits_bit_for_bit(monkeypatch):
    # Auto where the weights would not leave half of the device: every layer streams until the
    # second forward is measured, then those that fit stay (here all of them: the model is small).
    import hytrain.window_plan as window_module

    # The first question (everything resident, half of the device for the rest?) answered no.
    monkeypatch.setattr(window_module, "fits_resident", lambda *args, **kwargs: False)
    r, s = both(dict(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, gpu_blocks="auto"), stream="auto", steps=8)
    assert_same(r, s)
    window = s[3]
    assert window.streamed == list(range(CFG.num_layers)) and window.kept_layers == window.streamed
    assert window.stats["kept"] == CFG.num_layers and window.stats["loads"] > CFG.num_layers
    assert all(p.untyped_storage().nbytes() > 0 for p in window.params)  # kept on the device now


def _host_state_bytes(ps, staged=False):
    """fp32 states on the host: master, m and v (and bf16 staging), each rounded to the pool's 256 B."""
    return sum(-(-nb // 256) * 256 for p in ps for nb in [4 * p.numel()] * 3 + ([2 * p.numel()] if staged else []))


def test_a_host_too_small_for_every_streamed_state_keeps_the_first_layers_resident_bit_for_bit(monkeypatch):
    # Auto streams every layer; the optimizer's pool holds the states of blocks 3 and up only (layers
    # 2..5 and the head), so the host's floor (3) is past the first streamed block (1): the first two
    # layers become resident, their homes given back, and their blocks' states live on the GPU.
    import hytrain.window_plan as window_module

    monkeypatch.setattr(window_module, "fits_resident", lambda *args, **kwargs: False)
    probe = make()
    head = list(probe.norm.parameters()) + list(probe.lm_head.parameters())
    capacity = _host_state_bytes([p for layer in probe.layers[2:] for p in layer.parameters()]) + \
        _host_state_bytes(head, staged=True) + (1 << 20)
    batches = data(6, seed=3)
    out = []
    for streamed in (False, True):
        m = make(seed=3)
        window = hytrain.stream_model(m, DEV, stream="auto") if streamed else None
        pool = hytrain.PinnedPool(capacity) if streamed else None
        opt = hytrain.HybridAdamW(m.parameters(), model=m, workers=2, lr=1e-3, weight_decay=0.1, max_grad_norm=1.0,
                                  pool=pool)
        out.append((m, opt, run(m, opt, batches), window))
    assert_same(*out)
    window, opt = out[1][3], out[1][1]
    assert window.stats["made_resident"] == 2 and window.streamed == [2, 3, 4, 5]
    assert all(not window.streams(p) and p.untyped_storage().nbytes() > 0 for p in out[1][0].layers[1].parameters())
    assert opt.residency()["gpu"] == [0, 1, 2]


def test_where_the_gpu_cannot_hold_what_the_host_cannot_it_is_refused_naming_both(monkeypatch):
    import hytrain.window_plan as window_module

    monkeypatch.setattr(window_module, "fits_resident", lambda *args, **kwargs: False)
    m = make(seed=4)
    window = hytrain.stream_model(m, DEV, stream="auto")
    opt = hytrain.HybridAdamW(m.parameters(), model=m, pool=hytrain.PinnedPool(1 << 20),
                              gpu_memory_limit=torch.cuda.memory_allocated() + (1 << 20))
    t = data(1, seed=4)[0][0]
    # Refused at the first backward's first gradient, before anything of the state is allocated.
    with pytest.raises(hytrain.CapacityError, match=r"the host can hold the optimizer states of (blocks \d+ to 7 "
                                                    r"only|no block).*of GPU memory, and .* is free beside"):
        m(t[:, :-1], t[:, 1:]).backward()
    assert len(opt.state) == 0 and window.stats["made_resident"] == 0 and len(window.streamed) == CFG.num_layers
