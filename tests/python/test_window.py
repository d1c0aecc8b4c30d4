"""Streamed weights (hytrain.stream_model) on the CPU: the window's plan on fake budgets, its refusals,
and training with the last layers streamed against the same model resident, bit for bit (weights,
masters, moments, losses), with activation checkpointing, accumulation, clipping and the state formats.
The CPU path runs the same window logic as CUDA (loads, frees, the optimizer writing the homes); the
copy stream and read-ahead run on the GPU tests (test_window_cuda.py)."""

import copy

import pytest
import torch

import hytrain
from hytrain.models import LlamaConfig, LlamaModel
from hytrain.window import plan_window, window_of

CFG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=4, num_heads=4,
                  num_kv_heads=2, max_seq_len=64)
GiB = 1 << 30


# -- the plan -------------------------------------------------------------------------------------------

def test_plan_keeps_everything_resident_when_it_fits():
    assert plan_window([GiB] * 8, GiB, 20 * GiB, depth=2, reserve_bytes=4 * GiB) == 0


def test_plan_streams_the_fewest_last_layers_that_make_room():
    # 8 layers of 1 GiB, 1 GiB outside them, 4 GiB reserved, 10 GiB free: resident layers + a window
    # of 2 must fit in 5 GiB -> 3 resident, 5 streamed (3 + 2 = 5).
    assert plan_window([GiB] * 8, GiB, 10 * GiB, depth=2, reserve_bytes=4 * GiB) == 5
    # A deeper window costs a layer more.
    assert plan_window([GiB] * 8, GiB, 10 * GiB, depth=3, reserve_bytes=4 * GiB) == 6
    # The window holds the largest streamed layers.
    # (Streaming n layers through a window of d saves n - d of them.)
    assert plan_window([GiB] * 4, 0, 3 * GiB, depth=1, reserve_bytes=0) == 2
    assert plan_window([GiB, GiB, GiB, 2 * GiB], 0, 3 * GiB, depth=1, reserve_bytes=0) == 3


def test_plan_refuses_in_one_line_naming_the_bytes():
    with pytest.raises(hytrain.CapacityError) as e:
        plan_window([GiB] * 8, 6 * GiB, 10 * GiB, depth=2, reserve_bytes=4 * GiB)
    msg = str(e.value)
    assert "\n" not in msg and "12.00 GiB" in msg and "10.00 GiB" in msg and "8 of its 8 layers" in msg


def test_plan_streams_only_a_run_of_streamable_last_layers():
    ok = [True, True, False, True, True]
    assert plan_window([GiB] * 5, 0, 4 * GiB, depth=1, reserve_bytes=0, streamable=ok) == 2
    with pytest.raises(hytrain.CapacityError, match="2 of its 5 layers"):
        plan_window([GiB] * 5, 0, 3 * GiB, depth=1, reserve_bytes=0, streamable=ok)


# -- refusals -------------------------------------------------------------------------------------------

def model(dtype=torch.bfloat16, seed=0, checkpointing=False):
    torch.manual_seed(seed)
    return LlamaModel(CFG, checkpointing=checkpointing).to(dtype)


def test_bad_arguments_are_refused():
    m = model()
    with pytest.raises(ValueError, match="stream must be"):
        hytrain.stream_model(m, "cpu", stream=5)
    with pytest.raises(ValueError, match="depth"):
        hytrain.stream_model(m, "cpu", stream=1, depth=0)
    with pytest.raises(ValueError, match="repeated layers"):
        hytrain.stream_model(torch.nn.Linear(4, 4).to(torch.bfloat16), "cpu", stream=0)
    with pytest.raises(ValueError, match="layer 3 cannot stream: its parameters must all be bfloat16"):
        hytrain.stream_model(model(torch.float32), "cpu", stream=1)
    hytrain.stream_model(m, "cpu", stream=1)
    with pytest.raises(ValueError, match="already streams"):
        hytrain.stream_model(m, "cpu", stream=1)


def test_a_layer_sharing_a_weight_with_another_module_does_not_stream():
    m = model()
    m.norm.weight = m.layers[3].mlp_norm.weight  # tied: used outside the layer too
    with pytest.raises(ValueError, match="layer 3 cannot stream"):
        hytrain.stream_model(m, "cpu", stream=1)
    hytrain.stream_model(m, "cpu", stream=0)  # nothing streamed: nothing to refuse


def test_auto_on_the_cpu_streams_nothing():
    w = hytrain.stream_model(model(), "cpu")
    assert w.streamed == [] and w.host_bytes() == 0


# -- training, streamed against resident --------------------------------------------------------------

def batches(n, micro=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, CFG.vocab_size, (2, 33), generator=g) for _ in range(micro)] for _ in range(n)]


def train(m, opt, data, *, scaler_like=None):
    losses = []
    for micro in data:
        for tokens in micro:
            loss = m(tokens[:, :-1], tokens[:, 1:]) / len(micro)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def weights(m, window=None):
    out = {}
    for name, p in m.named_parameters():
        out[name] = (window.weights(p) if window is not None and window.streams(p) else p.detach()).clone()
    return out


@pytest.mark.parametrize("state_format", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_streamed_training_is_the_resident_training_bit_for_bit(state_format, checkpointing):
    resident = model(checkpointing=checkpointing)
    streamed = copy.deepcopy(resident)
    window = hytrain.stream_model(streamed, "cpu", stream=3)
    assert window.streamed == [1, 2, 3] and window_of(streamed) is window
    data = batches(6)
    kw = dict(lr=3e-3, weight_decay=0.1, state_format=state_format)
    opt_r = hytrain.HybridAdamW(resident.parameters(), model=resident, **kw)
    ref_losses = train(resident, opt_r, data)
    opt_s = hytrain.HybridAdamW(streamed.parameters(), model=streamed, **kw)
    losses = train(streamed, opt_s, data)
    assert losses == ref_losses
    a, b = weights(resident), weights(streamed, window)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for (pr, ps) in zip(resident.parameters(), streamed.parameters()):
        for key, val in opt_r.state[pr].items():
            assert torch.equal(val, opt_s.state[ps][key]), key
    # Between uses a streamed layer holds no memory on its device; the others do.
    for i, layer in enumerate(streamed.layers):
        for p in layer.parameters():
            assert (p.untyped_storage().nbytes() == 0) == (i >= 1)
    assert window.stats["max_loaded"] <= window.depth


def test_accumulation_and_clipping_streamed_match_resident():
    resident = model(seed=1)
    streamed = copy.deepcopy(resident)
    window = hytrain.stream_model(streamed, "cpu", stream=2)
    data = batches(5, micro=2, seed=1)
    kw = dict(lr=1e-2, max_grad_norm=0.05, accumulation_steps=2)
    opt_r = hytrain.HybridAdamW(resident.parameters(), model=resident, **kw)
    ref_losses = train(resident, opt_r, data)
    opt_s = hytrain.HybridAdamW(streamed.parameters(), model=streamed, **kw)
    assert train(streamed, opt_s, data) == ref_losses
    a, b = weights(resident), weights(streamed, window)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_inference_and_state_dict_of_a_streamed_model():
    resident = model(seed=2)
    streamed = copy.deepcopy(resident)
    window = hytrain.stream_model(streamed, "cpu", stream=4)
    tokens = batches(1, seed=2)[0][0]
    with torch.no_grad():
        assert torch.equal(resident(tokens), streamed(tokens))
    sd_r, sd_s = resident.state_dict(), streamed.state_dict()
    assert sd_r.keys() == sd_s.keys()
    assert all(torch.equal(sd_r[k], sd_s[k]) for k in sd_r)
    assert all(p.untyped_storage().nbytes() == 0 for p in window.params)
    window.remove()
    assert window_of(streamed) is None
    with torch.no_grad():
        assert torch.equal(resident(tokens), streamed(tokens))


def test_a_plan_block_mixing_streamed_and_resident_parameters_is_refused():
    m = model(seed=3)
    hytrain.stream_model(m, "cpu", stream=1)
    ps = list(m.parameters())
    last = list(m.layers[3].parameters())
    ids = {id(p) for p in last}
    others = [p for p in ps if id(p) not in ids]
    blocks = [others[:-1], [others[-1], *last]]
    opt = hytrain.HybridAdamW(ps, model=m, blocks=blocks)
    t = batches(1, seed=3)[0][0]
    m(t[:, :-1], t[:, 1:]).backward()
    with pytest.raises(ValueError, match="streamed layer must be whole blocks"):
        opt.step()


def test_touching_a_streamed_weight_outside_its_layer_raises_instead_of_reading_freed_memory():
    m = model(seed=4)
    window = hytrain.stream_model(m, "cpu", stream=2)
    p = m.layers[3].q.weight
    assert isinstance(p, torch.nn.Parameter) and p.shape == (64, 64) and p.dtype == torch.bfloat16
    for touch in (lambda: p.sum(), lambda: p.detach().norm(), lambda: p.data.clone(), lambda: p * 2,
                  lambda: copy.deepcopy(m), lambda: torch.nn.utils.parameters_to_vector(m.parameters())):
        with pytest.raises(RuntimeError, match="streamed parameter of shape"):
            touch()
    assert window.home(p).shape == p.shape and bool(window.home(p).abs().sum() > 0)
    tokens = batches(1, seed=4)[0][0]
    m(tokens[:, :-1], tokens[:, 1:]).backward()  # inside forward and backward it works
    assert p.grad is not None and p.grad.shape == p.shape


def test_a_streamed_run_resumed_from_its_state_dicts_is_the_uninterrupted_run():
    data = batches(6, seed=5)
    kw = dict(lr=3e-3, weight_decay=0.1, state_format="bf16")
    resident = model(seed=5)
    first = copy.deepcopy(resident)
    opt_r = hytrain.HybridAdamW(resident.parameters(), model=resident, **kw)
    ref_losses = train(resident, opt_r, data)

    hytrain.stream_model(first, "cpu", stream=3)
    opt = hytrain.HybridAdamW(first.parameters(), model=first, **kw)
    losses = train(first, opt, data[:3])
    saved_model = copy.deepcopy(first.state_dict())  # the streamed weights come from their homes
    saved_opt = copy.deepcopy(opt.state_dict())

    second = model(seed=99)  # other weights: the saved ones are loaded, then it streams
    second.load_state_dict(saved_model)
    window = hytrain.stream_model(second, "cpu", stream=3)
    opt2 = hytrain.HybridAdamW(second.parameters(), model=second, **kw)
    opt2.load_state_dict(saved_opt)
    losses += train(second, opt2, data[3:])
    assert losses == ref_losses
    a, b = weights(resident), weights(second, window)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_loaded_master_follows_the_streamed_weights_as_a_resident_one_does():
    # torch's rule, as for resident weights: an optimizer state does not change the weights; where a
    # weight is not its loaded master's rounding, the master takes the weight.
    data = batches(2, seed=6)
    runs = []
    for streamed in (False, True):
        m = model(seed=6)
        window = hytrain.stream_model(m, "cpu", stream=2) if streamed else None
        opt = hytrain.HybridAdamW(m.parameters(), model=m, lr=1e-2)
        train(m, opt, data)
        sd = copy.deepcopy(opt.state_dict())
        p = m.layers[3].q.weight
        i = [id(q) for q in m.parameters()].index(id(p))
        sd["state"][i]["master"] = torch.full_like(sd["state"][i]["master"], 0.125)
        before = weights(m, window)
        opt.load_state_dict(sd)
        train(m, opt, batches(1, seed=7))
        runs.append((weights(m, window), before))
    (a, a0), (b, b0) = runs
    assert all(torch.equal(a[n], b[n]) for n in a) and all(torch.equal(a0[n], b0[n]) for n in a0)


def test_pickling_a_streamed_model_saves_its_weights_and_remove_is_refused_under_an_optimizer(tmp_path):
    m = model(seed=8)
    window = hytrain.stream_model(m, "cpu", stream=2)
    torch.save(m, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    sd = m.state_dict()
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in sd.items())
    opt = hytrain.HybridAdamW(m.parameters(), model=m, lr=1e-2)
    train(m, opt, batches(1, seed=8))
    with pytest.raises(RuntimeError, match="remove\\(\\) the window before that optimizer"):
        window.remove()


def test_moving_a_streamed_model_where_it_is_passes_and_elsewhere_raises():
    m = model(seed=7)
    window = hytrain.stream_model(m, "cpu", stream=2)
    p = m.layers[3].q.weight
    assert m.to("cpu") is m and m.layers[3].q.weight is p and p.untyped_storage().nbytes() == 0
    m.cpu()
    m.to(torch.device("cpu"), non_blocking=True)
    with pytest.raises(RuntimeError, match="streamed parameter"):
        m.to(torch.float32)
    assert window.home(p).dtype == torch.bfloat16


def test_a_rollback_with_load_state_dict_is_refused_before_anything_is_written():
    m = model(seed=9)
    saved = copy.deepcopy(m.state_dict())
    window = hytrain.stream_model(m, "cpu", stream=2)
    opt = hytrain.HybridAdamW(m.parameters(), model=m, lr=1e-2)
    train(m, opt, batches(2, seed=9))
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(RuntimeError, match="load_state_dict would write 18 streamed parameters"):
        m.load_state_dict(saved)
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the resident ones untouched too
    p = m.layers[3].q.weight
    with pytest.raises(RuntimeError, match="assigning .data of a streamed parameter"):
        p.data = torch.zeros_like(window.home(p))
    with pytest.raises(ValueError, match="does not stream"):
        window.weights(m.layers[0].q.weight)
    with pytest.raises(ValueError, match="that this window does not stream has no home"):
        window.home(m.layers[0].q.weight)
    train(m, opt, batches(1, seed=10))  # training goes on


class _Wrapper(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, tokens):
        return self.inner(tokens)


def test_state_dict_and_load_of_a_module_inside_the_streamed_model():
    # A wrapper streams; its inner module's state_dict (what a checkpoint of the wrapper holds) has
    # the streamed layers' weights, and its load_state_dict is refused before writing anything.
    resident = model(seed=4)
    wrapped = _Wrapper(copy.deepcopy(resident))
    hytrain.stream_model(wrapped, "cpu", stream=3)
    sd_r, sd_s = resident.state_dict(), wrapped.inner.state_dict()
    assert sd_r.keys() == sd_s.keys() and all(torch.equal(sd_r[k], sd_s[k]) for k in sd_r)
    assert torch.equal(wrapped.inner.layers[2].state_dict()["q.weight"], resident.layers[2].q.weight)
    zeros = {k: torch.zeros_like(v) for k, v in sd_r.items()}
    for target, sd in ((wrapped.inner, zeros), (wrapped.inner.layers, {k[len("layers."):]: v for k, v in zeros.items()
                                                                       if k.startswith("layers.")})):
        with pytest.raises(RuntimeError, match="load_state_dict would write 27 streamed parameters"):
            target.load_state_dict(sd)
    after = wrapped.inner.state_dict()
    assert all(torch.equal(sd_r[k], after[k]) for k in sd_r)  # nothing written, resident ones included


def test_a_model_on_the_meta_device_is_placed_empty_and_read_into_its_places():
    # stream_model of a meta model allocates each streamed parameter's home and everything else on
    # the device, uninitialised and untouched (tied weights stay tied); written there, it is the model.
    resident = model(seed=6)
    with torch.device("meta"):
        meta = LlamaModel(CFG).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"buffer \S+ is on the meta device"):  # (computed: not read)
        hytrain.stream_model(meta, "cpu", stream=2)
    for name, b in resident.named_buffers():  # real buffers, as init_empty_weights(include_buffers=False) makes
        owner, _, leaf = name.rpartition(".")
        setattr(meta.get_submodule(owner), leaf, b.clone())
    meta.lm_head.weight = meta.embed.weight  # tied, outside the layers
    resident.lm_head.weight = resident.embed.weight
    window = hytrain.stream_model(meta, "cpu", stream=2)
    assert not any(p.is_meta for p in meta.parameters()) and meta.lm_head.weight is meta.embed.weight
    assert all(p.untyped_storage().nbytes() == 0 for p in window.params)
    assert window.host_bytes() == sum(p.numel() * 2 for i in (2, 3) for p in resident.layers[i].parameters())
    own = dict(meta.named_parameters())
    with torch.no_grad():
        for name, p in resident.named_parameters():
            (window.home(own[name]) if window.streams(own[name]) else own[name]).copy_(p)
    tokens = batches(1, seed=6)[0][0]
    with torch.no_grad():
        assert torch.equal(resident(tokens), meta(tokens))
    opt_r = hytrain.HybridAdamW(resident.parameters(), model=resident, lr=1e-2)
    opt_s = hytrain.HybridAdamW(meta.parameters(), model=meta, lr=1e-2)
    data = batches(2, seed=7)
    assert train(resident, opt_r, data) == train(meta, opt_s, data)


# -- the ends: the embeddings and the head (final norm, LM head) as units of the window ----------------

def test_the_ends_stream_only_where_the_layers_alone_leave_too_little():
    from hytrain.window_plan import end_units, layout, plan_ends

    m = model()
    layers, ok, layer_bytes, fixed = layout(m)
    embeddings, head = end_units(m, layers)
    assert [type(x).__name__ for x in embeddings.members] == ["Embedding"]
    assert [type(x).__name__ for x in head.members] == ["RMSNorm", "Linear"]
    emb_b = CFG.vocab_size * CFG.hidden_size * 2
    head_b = emb_b + CFG.hidden_size * 2
    rest = sum(b.numel() * b.element_size() for b in m.buffers())
    assert fixed == emb_b + head_b + rest
    one = layer_bytes[0]

    def plan(free, ends="auto"):
        count, units = plan_ends(m, layers, ok, layer_bytes, fixed, free, depth=1, reserve_bytes=0, ends=ends)
        return count, [u.name for u in units]

    assert plan(fixed + 4 * one) == (0, [])  # everything resident
    assert plan(fixed + one) == (4, [])  # every layer streams, one at a time: the ends stay
    assert plan(rest + emb_b + one) == (4, ["head"])  # the head goes too (the window holds the largest unit)
    assert plan(rest + one) == (4, ["head", "embeddings"])
    assert plan(fixed + one, ends=True) == (4, ["embeddings", "head"])
    assert plan(fixed + 4 * one, ends=True) == (0, ["embeddings", "head"])
    with pytest.raises(hytrain.CapacityError) as e:
        plan(rest + one // 2)
    assert "\n" not in str(e.value) and "layers streamed" in str(e.value)
    with pytest.raises(hytrain.CapacityError):
        plan(rest + emb_b + one, ends=False)
    # Tied embeddings never stream: auto leaves them, True is refused naming them.
    tied = model()
    tied.lm_head.weight = tied.embed.weight
    layers, ok, layer_bytes, fixed = layout(tied)
    assert plan_ends(tied, layers, ok, layer_bytes, fixed, fixed + one, depth=1, reserve_bytes=0, ends="auto")[1] == []
    with pytest.raises(ValueError, match="embeddings cannot stream .*shares the embeddings' weight"):
        plan_ends(tied, layers, ok, layer_bytes, fixed, fixed + one, depth=1, reserve_bytes=0, ends=True)


@pytest.mark.parametrize("state_format", ["fp32", "8bit"])
def test_streaming_the_embeddings_and_the_head_is_the_resident_training_bit_for_bit(state_format):
    resident = model(seed=3, checkpointing=True)
    streamed = copy.deepcopy(resident)
    window = hytrain.stream_model(streamed, "cpu", stream=2, ends=True)
    # units: the embeddings, the 4 layers, the head; streamed: the ends and the last 2 layers
    assert window.streamed == [0, 3, 4, 5] and window.ends == ["embeddings", "head"]
    assert "with the embeddings and the head" in repr(window)
    ends = [streamed.embed.weight, streamed.norm.weight, streamed.lm_head.weight]
    assert all(window.streams(p) and p.untyped_storage().nbytes() == 0 for p in ends)
    data = batches(5, micro=2, seed=3)
    kw = dict(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5, accumulation_steps=2, state_format=state_format)
    opt_r = hytrain.HybridAdamW(resident.parameters(), model=resident, **kw)
    ref_losses = train(resident, opt_r, data)
    opt_s = hytrain.HybridAdamW(streamed.parameters(), model=streamed, **kw)
    assert train(streamed, opt_s, data) == ref_losses
    assert opt_s.gpu_blocks == 0  # the embeddings stream: every block is updated on the host
    a, b = weights(resident), weights(streamed, window)
    assert all(torch.equal(a[n], b[n]) for n in a)
    for (pr, ps) in zip(resident.parameters(), streamed.parameters()):
        for key, val in opt_r.state[pr].items():
            assert torch.equal(val, opt_s.state[ps][key]), key
    assert all(p.untyped_storage().nbytes() == 0 for p in ends)  # between uses: nothing on the device
    sd_r, sd_s = resident.state_dict(), streamed.state_dict()
    assert all(torch.equal(sd_r[k], sd_s[k]) for k in sd_r)
    tokens = batches(1, seed=4)[0][0]
    with torch.no_grad():
        assert torch.equal(resident(tokens), streamed(tokens))


def test_ends_argument_is_checked():
    for bad in ("yes", 1, 1.0, None):  # (1 == True: refused, not taken for False)
        with pytest.raises(ValueError, match="ends must be"):
            hytrain.stream_model(model(), "cpu", stream=1, ends=bad)
    frozen = model()
    frozen.embed.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="the embeddings cannot stream .*none of its parameters is trainable"):
        hytrain.stream_model(frozen, "cpu", stream=1, ends=True)
    wide = model()
    wide.lm_head.float()
    with pytest.raises(ValueError, match="the head cannot stream .*bfloat16 or float16, and some are float32"):
        hytrain.stream_model(wide, "cpu", stream=1, ends=True)
    tied = model()
    tied.lm_head.weight = tied.embed.weight
    with pytest.raises(ValueError, match="embeddings cannot stream"):
        hytrain.stream_model(tied, "cpu", stream=1, ends=True)
    assert hytrain.stream_model(model(), "cpu", stream=1).ends == []


@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_streamed_unit_called_outside_the_models_forward_reads_the_current_weights(clip):
    # The embeddings called on their own (to build inputs_embeds) get no wait of the optimizer's (its
    # waits are the model's hooks): right after step() their update may still be writing the home,
    # and between backward and step() the home stages their gradients. The window's load asks the
    # optimizer what the weights are now, so the output is the resident model's, every time.
    resident = model(seed=5)
    streamed = copy.deepcopy(resident)
    hytrain.stream_model(streamed, "cpu", stream=2, ends=True)
    data = batches(4, seed=5)
    seen = []
    for m in (resident, streamed):
        opt = hytrain.HybridAdamW(m.parameters(), model=m, lr=3e-2, max_grad_norm=clip, workers=1)
        out = []
        for (tokens,) in data:
            out.append(m.embed(tokens))  # right after the last step()
            loss = m(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            out.append(m.embed(tokens))  # between backward and step()
            opt.step()
            opt.zero_grad()
        seen.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*seen)), [torch.equal(a, b) for a, b in zip(*seen)]


def test_a_layer_made_resident_mid_backward_trains_as_if_it_had_never_streamed():
    # What the optimizer does where the host cannot hold every streamed block's state: the first
    # streamed layer stays on the device for good, its home given back. Here in the first backward,
    # after the streamed layers' forwards freed them and before their backwards loaded them again.
    resident = model(seed=11, checkpointing=True)
    streamed = copy.deepcopy(resident)
    window = hytrain.stream_model(streamed, "cpu", stream=3)
    data = batches(4, seed=11)
    kw = dict(lr=3e-3, weight_decay=0.1)
    opt_r = hytrain.HybridAdamW(resident.parameters(), model=resident, **kw)
    ref_losses = train(resident, opt_r, data)
    with pytest.raises(ValueError, match="layer 0 does not stream"):
        window.make_resident(0)
    moved = list(streamed.layers[1].parameters())
    home_bytes = window.host_bytes()
    made = []

    def once(p):
        if not made:
            window.make_resident(1)
            made.append(1)

    streamed.layers[3].mlp_norm.weight.register_post_accumulate_grad_hook(once)
    opt_s = hytrain.HybridAdamW(streamed.parameters(), model=streamed, **kw)
    assert train(streamed, opt_s, data) == ref_losses
    assert made and window.streamed == [2, 3] and window.stats["made_resident"] == 1
    assert not any(window.streams(p) for p in moved)
    assert all(type(p) is torch.nn.Parameter and p.untyped_storage().nbytes() > 0 for p in moved)
    assert window.host_bytes() == home_bytes - sum(p.numel() * p.element_size() for p in moved)
    a, b = weights(resident), weights(streamed, window)
    assert all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(RuntimeError, match="only before that optimizer's first step"):
        window.make_resident(2)


def test_auto_streams_where_the_host_cannot_hold_the_optimizers_state(monkeypatch):
    # The GPU would hold the weights with half of it free (nothing would stream), but the host cannot
    # hold the state of every parameter in the format asked: every layer streams (then the optimizer
    # makes the first ones resident again, their states on the GPU, as many as the GPU holds).
    import hytrain.window_plan as wp

    m = model()
    n = sum(p.numel() for p in m.parameters())
    layers, ok, layer_bytes, fixed = wp.layout(m)
    monkeypatch.setattr(wp.torch.cuda, "mem_get_info", lambda device=None: (80 * GiB, 80 * GiB))
    cuda = torch.device("cuda", 0)
    from hytrain import state_formats

    for fmt in ("fp32", "bf16", "8bit"):  # master 4 + m and v + staging or home 2 bytes a parameter
        need = int(n * (6 + state_formats.get(fmt).bytes_per_parameter()))
        monkeypatch.setattr(wp, "host_margin", lambda available: 0)
        monkeypatch.setattr(wp, "available_memory_bytes", lambda: need + 4096)
        assert not wp.host_short(m, fmt) and not wp.host_short(m, None)
        kw = dict(stream="auto", depth=2, reserve_bytes=None, ends="auto")
        assert wp.choose_streamed(m, layers, ok, layer_bytes, fixed, cuda, state_format=fmt, **kw) == (0, [], False)
        monkeypatch.setattr(wp, "available_memory_bytes", lambda: need - 4096)
        assert wp.host_short(m, fmt) and not wp.host_short(m, None)
        assert wp.choose_streamed(m, layers, ok, layer_bytes, fixed, cuda, state_format=fmt, **kw) == \
            (CFG.num_layers, [], True)
        assert wp.choose_streamed(m, layers, ok, layer_bytes, fixed, cuda, **kw) == (0, [], False)  # (not asked)
