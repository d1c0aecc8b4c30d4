"""8-bit optimizer states (``state_format="8bit"``: blockwise-quantised m and v beside fp32 masters).

The maps rebuilt from their definition; ``hytrain.quant8.quantize`` against a brute-force nearest
code; the CPU kernel against a float64 run of torch's AdamW formula on fresh random codes and scales,
on every SIMD path; HybridAdamW with 8-bit states in a plain loop (training follows the fp32-state
run; about 2 bytes of state per parameter beside the fp32 weights); state dicts converting between
formats both ways; checkpoints recording the format; refusals. GPU: the fused CUDA kernel byte for
byte against the CPU one (HybridAdamW with blocks moving between GPU and host, byte for byte against
k = 0: test_compact_states).
"""

import copy

import pytest
import torch

import hytrain
from hytrain import quant8
from test_compact_states import _model
from test_hybrid_adam import Reference, batches, train

PATHS = hytrain.simd_paths()["supported"]


def magnitudes(signed: bool) -> torch.Tensor:
    """0, seven decades cut into 64 (signed) or 128 parts at the top and half as many below, each part
    at its midpoint: j * width + first midpoint, the two rounded to float and the result rounded once
    (exact in float64 first: a fused multiply-add); 1."""
    out = [torch.zeros(1, dtype=torch.float64)]
    for d in range(6, -1, -1):
        parts = (64 if signed else 128) >> d
        first = torch.tensor(10.0 ** -d * (0.1 + 0.45 / parts)).float().double()
        width = torch.tensor(10.0 ** -d * 0.9 / parts).float().double()
        out.append(torch.arange(parts, dtype=torch.float64) * width + first)
    return torch.cat(out + [torch.ones(1, dtype=torch.float64)]).float()


def values(signed: bool) -> torch.Tensor:
    a = magnitudes(signed)
    if not signed:
        return a
    return torch.cat([a, -a[1:128]])  # codes 0..128: +a; 129..255: -a[1..127]


def nearest_codes(y: torch.Tensor, signed: bool) -> torch.Tensor:
    """The definition, by brute force: the midpoints below |y| (ties to the smaller magnitude)."""
    a = magnitudes(signed)
    mid = (a[:-1] + a[1:]) * 0.5
    j = (y.abs()[:, None] > mid[None, :]).sum(1)
    if signed:
        return torch.where((y < 0) & (j > 0), 128 + j.clamp(max=127), j)
    return torch.where((y > 0) & (j == 0), 1, j)  # a nonzero root is never coded 0


def split(buf: torch.Tensor, n: int):
    """(codes, scales) of an 8-bit buffer."""
    return buf[:n].long(), buf[quant8.codes_bytes(n):quant8.state_bytes(n)].clone().view(torch.float32)


def random_buffer(n, signed, scale, gen):
    buf = torch.zeros(quant8.state_bytes(n), dtype=torch.uint8)
    buf[:n] = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    buf[quant8.codes_bytes(n):] = (torch.rand(quant8.blocks(n), generator=gen) * scale).view(torch.uint8)
    return buf


def test_maps_are_their_definition():
    for signed in (True, False):
        value, _ = quant8._map(signed)
        assert torch.equal(value, values(signed))


def test_quantize_picks_the_nearest_code():
    gen = torch.Generator().manual_seed(0)
    n = 5000
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 4)
    x[::97] = 0.0
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        y = x if signed else x * x  # v: its root is coded
        buf = quant8.quantize(y, key)
        codes, scales = split(buf, n)
        coded = y if signed else y.sqrt()
        blocks = torch.nn.functional.pad(coded, (0, quant8.blocks(n) * 256 - n)).view(-1, 256)
        assert torch.equal(scales, blocks.abs().amax(1))
        norm = (blocks * torch.where(scales > 0, 1 / scales, 0)[:, None]).reshape(-1)[:n]
        assert torch.equal(codes, nearest_codes(norm, signed))
        # Each value within half a step of the map around it: a few per cent of its block's scale
        # at most (finer near the top).
        back = quant8.dequantize(buf, n, key)
        back = back if signed else back.sqrt()
        err = (back - coded).abs() / scales.repeat_interleave(256)[:n].clamp(min=1e-30)
        assert err.max() < 0.05


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [1, 255, 257, 4099])
def test_cpu_kernel_matches_float64(path, n):
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    m, v = random_buffer(n, True, 1e-2, gen), random_buffer(n, False, 1e-4, gen)
    g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    copy_ = torch.empty(n, dtype=torch.bfloat16)
    lr, wd, scale, step, (b1, b2), eps = 1e-3, 0.05, 0.5, 4, (0.9, 0.999), 1e-8
    (mc, ms), (vc, vs) = split(m, n), split(v, n)
    m0 = values(True)[mc].double() * ms.repeat_interleave(256)[:n].double()
    v0 = (values(False)[vc].double() * vs.repeat_interleave(256)[:n].double()) ** 2  # v is kept as its root
    gd = g.double() * scale
    m64 = m0 + (1 - b1) * (gd - m0)
    v64 = b2 * v0 + (1 - b2) * gd * gd
    u = lr / (1 - b1 ** step) * m64 / (v64.sqrt() / (1 - b2 ** step) ** 0.5 + eps)
    p64 = p.double() * (1 - lr * wd) - u

    p_out = p.clone()
    hytrain.adamw_step(p_out, g, m, v, step=step, lr=lr, weight_decay=wd, grad_scale=scale, param_copy=copy_,
                       simd=path, num_threads=2)
    assert ((p_out.double() - p64).abs() <= 2e-6 * p64.abs().clamp(min=1e-3) + 1e-5 * u.abs()).all()
    assert torch.equal(copy_, p_out.bfloat16())
    for buf, ref, signed in ((m, m64, True), (v, v64.sqrt(), False)):
        codes, scales = split(buf, n)
        blocks = torch.nn.functional.pad(ref, (0, quant8.blocks(n) * 256 - n)).view(-1, 256)
        want_scale = blocks.abs().amax(1)
        assert ((scales.double() - want_scale).abs() <= 1e-5 * want_scale).all()
        norm = ref / scales.double().repeat_interleave(256)[:n]
        # fp32 arithmetic may move a value across a midpoint it is within 1e-5 of
        ok = torch.zeros(n, dtype=torch.bool)
        for d in (0.0, 1e-5, -1e-5):
            ok |= codes == nearest_codes((norm * (1 + d)).float(), signed)
        assert ok.all(), f"{int((~ok).sum())} codes off"


def test_cpu_kernel_refuses_bad_8bit_buffers():
    n = 1000
    p, g = torch.zeros(n), torch.zeros(n)
    m, v = torch.zeros(quant8.state_bytes(n), dtype=torch.uint8), torch.zeros(quant8.state_bytes(n), dtype=torch.uint8)
    hytrain.adamw_step(p, g, m, v, step=1)
    with pytest.raises(ValueError, match=f"exp_avg has {n} elements .* but {quant8.state_bytes(n)} were expected"):
        hytrain.adamw_step(p, g, torch.zeros(n, dtype=torch.uint8), v, step=1)
    with pytest.raises(TypeError, match="exp_avg and exp_avg_sq must have one dtype"):
        hytrain.adamw_step(p, g, m, torch.zeros(n), step=1)
    with pytest.raises(ValueError, match="amsgrad needs float32"):
        hytrain.adamw_step(p, g, m, v, step=1, amsgrad=True, max_exp_avg_sq=torch.zeros(n))
    base = torch.zeros(quant8.state_bytes(n) + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="4-byte aligned"):
        hytrain.adamw_step(p, g, base[1:], v, step=1)


def test_hybrid_8bit_states_train_like_fp32_states():
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = hytrain.HybridAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model, state_format="8bit")
    ref = Reference(ref_model, lr=3e-3, weight_decay=0.1)
    data = batches(30)
    losses, ref_losses = train(model, opt, data), train(ref_model, ref, data)
    assert opt.state_format == "8bit"
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            t = opt.state[p][key]
            assert t.dtype == torch.uint8 and t.shape == (quant8.state_bytes(p.numel()),)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=1e-2)
    assert losses[-1] < losses[0] - 0.5
    # About 2 bytes of state per parameter (the fp32 weights are their own masters): 1 byte each for
    # m and v, a 4-byte scale per 256 elements, padding to 64 bytes.
    n = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items() if k != "step")
    assert 2 * n < state < 2.05 * n + 256 * len(opt.state)


def _trained(data, state_format="fp32"):
    """A model trained on ``data`` and (a copy of) its HybridAdamW's state dict."""
    model = _model()
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, state_format=state_format)
    train(model, opt, data)
    return model, copy.deepcopy(opt.state_dict())


def test_8bit_state_dicts_convert_between_formats_both_ways():
    data = batches(12)
    model, sd = _trained(data[:6])

    def bound(state_format):
        m = copy.deepcopy(model)
        opt = hytrain.HybridAdamW(m.parameters(), lr=1e-3, model=m, state_format=state_format)
        train(m, opt, data[6:7])
        return m, opt

    # fp32 -> 8bit: quantised as the kernels quantise; training goes on from them.
    model_q, q8 = bound("8bit")
    q8.load_state_dict(sd)
    for i, q in enumerate(model_q.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(q8.state[q][key], quant8.quantize(sd["state"][i][key], key)), (i, key)
    train(model_q, q8, data[7:8])
    sd_q = copy.deepcopy(q8.state_dict())
    assert all(e["exp_avg"].dtype == torch.uint8 for e in sd_q["state"].values())

    # 8bit -> 8bit: the bytes themselves.
    model_s, same = bound("8bit")
    same.load_state_dict(sd_q)
    for i, q in enumerate(model_s.parameters()):
        assert torch.equal(same.state[q]["exp_avg"], sd_q["state"][i]["exp_avg"])

    # 8bit -> fp32 and bf16: the values the buffers hold.
    for fmt in ("fp32", "bf16"):
        model_c, back = bound(fmt)
        back.load_state_dict(sd_q)
        for i, q in enumerate(model_c.parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                want = quant8.dequantize(sd_q["state"][i][key], q.numel(), key).view(q.shape)
                assert torch.equal(back.state[q][key], want.to(back.state[q][key].dtype)), (fmt, i, key)
        train(model_c, back, data[8:9])

    # A buffer of the wrong size is refused by name before anything changes.
    bad = copy.deepcopy(sd_q)
    bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"][:-4]
    with pytest.raises(ValueError, match="parameter 0: 8-bit state 'exp_avg' has shape"):
        same.load_state_dict(bad)
    cast = copy.deepcopy(sd_q)
    cast["state"][0]["exp_avg"] = cast["state"][0]["exp_avg"].float()
    with pytest.raises(ValueError, match="the size of an 8-bit state, which loads as uint8, not torch.float32"):
        same.load_state_dict(cast)


def test_a_state_dict_loaded_before_the_first_step_comes_back_in_the_optimizers_format():
    # As torch's load_state_dict casts at once: until the first step creates the buffers, state_dict()
    # gives the loaded entries converted as the buffers will hold them, and the first step starts
    # from exactly those.
    data = batches(8)
    model, sd = _trained(data[:4])
    for fmt, dtype in (("8bit", torch.uint8), ("bf16", torch.bfloat16)):
        m = copy.deepcopy(model)
        opt = hytrain.HybridAdamW(m.parameters(), lr=1e-3, model=m, state_format=fmt)
        opt.load_state_dict(sd)
        early = copy.deepcopy(opt.state_dict())
        for i, q in enumerate(m.parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                got = early["state"][i][key]
                want = quant8.quantize(sd["state"][i][key], key) if fmt == "8bit" else sd["state"][i][key].bfloat16()
                assert got.dtype == dtype and torch.equal(got, want), (fmt, i, key)
        # The first step starts from what state_dict() gave: as an optimizer that loaded that instead.
        twin_model = copy.deepcopy(model)
        twin = hytrain.HybridAdamW(twin_model.parameters(), lr=1e-3, model=twin_model, state_format=fmt)
        twin.load_state_dict(early)
        train(m, opt, data[4:6])
        train(twin_model, twin, data[4:6])
        for q, r in zip(m.parameters(), twin_model.parameters()):
            assert torch.equal(q, r)
    q8 = hytrain.HybridAdamW(copy.deepcopy(model).parameters(), lr=1e-3, state_format="8bit")
    q8.load_state_dict(sd)
    back = hytrain.HybridAdamW(copy.deepcopy(model).parameters(), lr=1e-3)
    back.load_state_dict(q8.state_dict())  # 8-bit into fp32, before either has stepped
    for i, q in enumerate(model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            want = quant8.dequantize(quant8.quantize(sd["state"][i][key], key), q.numel(), key).view(q.shape)
            assert torch.equal(back.state_dict()["state"][i][key], want), (i, key)


def test_an_8bit_state_dict_reaches_torch_adamw_through_an_fp32_hybrid_adamw():
    # torch's AdamW cannot read 8-bit buffers; an fp32-state HybridAdamW converts them on load and its
    # state_dict() (before any step) is one torch's AdamW loads and trains on.
    data = batches(6)
    model, sd = _trained(data[:3], "8bit")
    bridge = hytrain.HybridAdamW(copy.deepcopy(model).parameters(), lr=1e-3)
    bridge.load_state_dict(sd)
    plain = copy.deepcopy(model)
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    adamw.load_state_dict(bridge.state_dict())
    for i, p in enumerate(plain.parameters()):
        st = adamw.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            want = quant8.dequantize(sd["state"][i][key], p.numel(), key).view(p.shape)
            assert st[key].dtype == torch.float32 and torch.equal(st[key], want), (i, key)
    train(plain, adamw, data[3:4])


def test_8bit_refusals_and_checkpoint_format(tmp_path):
    from hytrain import checkpoint

    model = _model()
    with pytest.raises(ValueError, match="amsgrad needs state_format='fp32'"):
        hytrain.HybridAdamW(model.parameters(), amsgrad=True, state_format="8bit")
    # An amsgrad state dict is refused at the load, before anything changes.
    ams = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, amsgrad=True)
    train(model, ams, batches(1))
    fresh = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, state_format="8bit")
    with pytest.raises(ValueError, match="saved param group 0 has amsgrad=True, which needs fp32 states, but this "
                                         "optimizer's state_format is '8bit'"):
        fresh.load_state_dict(ams.state_dict())
    assert fresh.param_groups[0]["amsgrad"] is False
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, state_format="8bit")
    train(model, opt, batches(2))
    path = checkpoint.save(tmp_path, 2, model, opt, None, {"preset": "test"})
    assert checkpoint.read_meta(path)["state_format"] == "8bit"
    saved = torch.load(path / "optimizer.pt", weights_only=True)
    assert all(e["exp_avg"].dtype == torch.uint8 for e in saved["state"].values())


def test_a_bad_q8_encoder_setting_is_refused_before_anything_is_written():
    """HYTRAIN_Q8_ENCODER is read when the first 8-bit step is validated: another value raises an
    error naming it, with weights and states untouched (a fresh process: the setting is read once)."""
    import os
    import subprocess
    import sys

    code = """
import torch, hytrain
from hytrain import quant8
n = 1000
p = torch.ones(n); g = torch.full((n,), 0.1).bfloat16()
m, v = (torch.zeros(quant8.state_bytes(n), dtype=torch.uint8) for _ in range(2))
try:
    hytrain.adamw_step(p, g, m, v, step=1, lr=1e-3, num_threads=2)
except Exception as e:
    print(type(e).__name__, e)
print("untouched", bool((p == 1).all() and (m == 0).all() and (v == 0).all()))
"""
    env = dict(os.environ, HYTRAIN_Q8_ENCODER="fast")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HYTRAIN_Q8_ENCODER must be 'table' or 'arithmetic', got 'fast'" in out.stdout, out.stdout
    assert "untouched True" in out.stdout


# ---- GPU --------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_kernel_matches_the_cpu_kernel_byte_for_byte():
    sizes = [1, 300, 4097, 1_000_003]
    gen = torch.Generator().manual_seed(1)
    cpu = [[torch.randn(n, generator=gen), random_buffer(n, True, 1e-2, gen), random_buffer(n, False, 1e-4, gen),
            torch.empty(n, dtype=torch.bfloat16)] for n in sizes]
    gpu = [[t.cuda() for t in ts[:3]] for ts in cpu]
    gpu_g = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    gpu_w = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    fused = hytrain.CudaAdamW([t[0] for t in gpu], [t[1] for t in gpu], [t[2] for t in gpu], gpu_g, weights=gpu_w)
    for step in (1, 2, 3):
        grads = [(torch.randn(n, generator=gen) * 1e-2).bfloat16() for n in sizes]
        for g, gg in zip(grads, gpu_g):
            gg.copy_(g)
        fused.step(step=step, lr=1e-3, weight_decay=0.05)
        for (p, m, v, w), g in zip(cpu, grads):
            hytrain.adamw_step(p, g, m, v, step=step, lr=1e-3, weight_decay=0.05, param_copy=w)
    torch.cuda.synchronize()
    for n, (p, m, v, w), (gp, gm, gv), gw in zip(sizes, cpu, gpu, gpu_w):
        assert torch.equal(gp.cpu(), p) and torch.equal(gw.cpu(), w)
        for a, b in ((gm.cpu(), m), (gv.cpu(), v)):
            assert torch.equal(a[:n], b[:n]) and torch.equal(split(a, n)[1], split(b, n)[1])
