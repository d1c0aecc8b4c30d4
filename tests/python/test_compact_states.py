"""Compact optimizer states (``state_format="bf16"``: bf16 m and v beside fp32 masters).

The CPU kernel against a float64 run of torch's AdamW formula with the stochastic rounding written
out again in torch (the hash in int64 arithmetic), on every SIMD path; HybridAdamW with compact
states in a plain loop (the state is bf16, training follows the fp32-state run); state dicts
converting between formats both ways; checkpoints recording the format; and bad configurations
refused by name. GPU: the fused CUDA kernel bit for bit against the CPU one, and HybridAdamW with
blocks moving between the GPU and the host every few steps bit for bit against k = 0 (with bf16 and
with 8-bit states).
"""

import copy

import pytest
import torch

import hytrain
from hytrain import quant8
from hytrain.state_formats import FORMATS
from hytrain.models import LlamaModel
from test_hybrid_adam import CFG, Reference, batches, train

PATHS = hytrain.simd_paths()["supported"]
M32 = 0xFFFFFFFF


def mix(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash on int64 tensors (products of 32-bit values and 31-bit constants fit in 63 bits)."""
    x = x & M32
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & M32
    x = ((x ^ (x >> 15)) * 0x735A2D97) & M32
    return x ^ (x >> 15)


def random_bits(seed: int, step: int, n: int) -> torch.Tensor:
    key = mix(torch.tensor(seed) ^ mix(torch.tensor(step)))
    return mix(torch.arange(n, dtype=torch.int64) + key)


def round_sr(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, adding 16 random bits below the kept ones (NaN stays NaN)."""
    bits = x.float().view(torch.int32).to(torch.int64) & M32
    out = ((bits + r16) >> 16) & 0xFFFF
    out = torch.where(torch.isnan(x), torch.full_like(out, 0x7FC0), out)
    return out.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def reference_step(p, m, v, g, *, step, lr, wd, scale, seed, betas=(0.9, 0.999), eps=1e-8):
    """One AdamW step in float64 from bf16 m, v; returns (p, m and v in float64, m and v rounded)."""
    b1, b2 = betas
    g = g.double() * scale
    m64 = m.double() + (1 - b1) * (g - m.double())
    v64 = b2 * v.double() + (1 - b2) * g * g
    denom = v64.sqrt() / (1 - b2 ** step) ** 0.5 + eps
    p64 = p.double() * (1 - lr * wd) - lr / (1 - b1 ** step) * m64 / denom
    r = random_bits(seed, step, p.numel())
    return p64, m64, v64, round_sr(m64.float(), r & 0xFFFF), round_sr(v64.float(), r >> 16)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [1, 17, 1000, 65_537])
def test_cpu_kernel_rounds_as_the_reference(path, n):
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    m = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    v = (torch.rand(n, generator=gen) * 1e-4).bfloat16()
    copy_ = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2, 7):
        g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
        g64 = g.double() * 0.5
        # What fp32 arithmetic may add to the exact value: a few roundings of the terms' size.
        slack = {"exp_avg": (m.double().abs() + g64.abs()) * 2.0 ** -21,
                 "exp_avg_sq": (v.double() + g64 * g64) * 2.0 ** -21}
        p64, m64, v64, m_want, v_want = reference_step(p, m, v, g, step=step, lr=1e-3, wd=0.05, scale=0.5,
                                                       seed=1234)
        hytrain.adamw_step(p, g, m, v, step=step, lr=1e-3, weight_decay=0.05, grad_scale=0.5, param_copy=copy_,
                           simd=path, num_threads=2, seed=1234)
        torch.testing.assert_close(p.double(), p64, rtol=2e-6, atol=1e-9)
        assert torch.equal(copy_, p.bfloat16())
        for name, got, want, exact in (("exp_avg", m, m_want, m64), ("exp_avg_sq", v, v_want, v64)):
            # One of the two bf16 neighbours of the exact value ...
            assert ((got.double() - exact).abs() <= exact.abs() / 128 + slack[name]).all(), name
            # ... the one the element's random bits pick (bar a float rounding near the threshold).
            other_way = int((got.view(torch.int16) != want.view(torch.int16)).sum())
            assert other_way <= 1 + n // 500, f"{name}: {other_way} of {n} rounded the other way"


def test_rounding_is_unbiased_where_nearest_would_stall():
    # No gradient: v decays by beta2 = 0.999 a step, under half a bf16 ulp; nearest rounding would
    # keep it at 1.0 for ever, stochastic rounding follows the decay on average.
    n = 1 << 15
    p, m, g = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    v = torch.ones(n, dtype=torch.bfloat16)
    for step in range(1, 201):
        hytrain.adamw_step(p, g, m, v, step=step, lr=0.0, weight_decay=0.0, seed=5)
    assert abs(v.double().mean().item() / 0.999 ** 200 - 1) < 3e-3


def test_cpu_kernel_refuses_mixed_or_amsgrad_compact_states():
    p, g = torch.zeros(64), torch.zeros(64)
    m16, v16, v32 = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64)
    with pytest.raises(TypeError, match="one dtype"):
        hytrain.adamw_step(p, g, m16, v32, step=1)
    with pytest.raises(ValueError, match="amsgrad needs float32"):
        hytrain.adamw_step(p, g, m16, v16, step=1, amsgrad=True, max_exp_avg_sq=torch.zeros(64))
    with pytest.raises(ValueError, match="seed"):
        hytrain.adamw_step(p, g, m16, v16, step=1, seed=-1)
    with pytest.raises(TypeError, match="exp_avg must have dtype"):
        hytrain.adamw_step(p, g, m16.half(), v16.half(), step=1)


# ---- HybridAdamW ----------------------------------------------------------------------------------

def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return LlamaModel(CFG).to(dtype)


def test_hybrid_bf16_states_train_like_fp32_states():
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = hytrain.HybridAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model, state_format="bf16")
    ref = Reference(ref_model, lr=3e-3, weight_decay=0.1)
    data = batches(30)
    losses, ref_losses = train(model, opt, data), train(ref_model, ref, data)
    assert opt.state_format == "bf16"
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16
    # The same trajectory within bf16's resolution of the moments (a few per cent of each update).
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=1e-2)
    assert losses[-1] < losses[0] - 0.5
    # 8 bytes of state per parameter: m and v of 2 bytes each (the fp32 weights are their own masters).
    n = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items() if k != "step")
    assert state == 4 * n


def test_state_dicts_convert_between_formats_both_ways():
    data = batches(12)
    model = _model()
    fp32 = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model)
    train(model, fp32, data[:6])
    sd = copy.deepcopy(fp32.state_dict())
    params = list(model.parameters())

    def bound(state_format):
        """An optimizer over a copy of the model, its state created by one step."""
        m = copy.deepcopy(model)
        opt = hytrain.HybridAdamW(m.parameters(), lr=1e-3, model=m, state_format=state_format)
        train(m, opt, data[6:7])
        return m, opt

    # fp32 -> bf16: m and v rounded to nearest into the compact buffers; training goes on from them.
    model_b, bf16 = bound("bf16")
    bf16.load_state_dict(sd)
    for i, q in enumerate(model_b.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(bf16.state[q][key], sd["state"][i][key].bfloat16()), (i, key)
        assert int(bf16.state[q]["step"]) == 6
    train(model_b, bf16, data[7:8])
    assert all(int(bf16.state[q]["step"]) == 7 for q in model_b.parameters())
    sd_b = copy.deepcopy(bf16.state_dict())
    assert all(e["exp_avg"].dtype == torch.bfloat16 for e in sd_b["state"].values())

    # bf16 -> fp32: exact (bf16 values widen without rounding).
    model_c, back = bound("fp32")
    back.load_state_dict(sd_b)
    for i, q in enumerate(model_c.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            got = back.state[q][key]
            assert got.dtype == torch.float32 and torch.equal(got, sd_b["state"][i][key].float()), (i, key)
    train(model_c, back, data[8:9])
    assert len(params) == len(sd_b["state"])


def test_bad_state_formats_are_refused_by_name():
    model = _model()
    with pytest.raises(ValueError, match="state_format must be one of 'fp32', 'bf16'"):
        hytrain.HybridAdamW(model.parameters(), state_format="fp16")
    with pytest.raises(ValueError, match="amsgrad needs state_format='fp32'"):
        hytrain.HybridAdamW(model.parameters(), amsgrad=True, state_format="bf16")
    opt = hytrain.HybridAdamW(model.parameters(), model=model, state_format="bf16")
    opt.param_groups[0]["amsgrad"] = True  # switched on by a loop
    x = batches(1)[0][0]
    model(x, x).backward()
    with pytest.raises(ValueError, match="amsgrad needs state_format='fp32'"):
        opt.step()


def test_checkpoint_records_the_state_format(tmp_path):
    from hytrain import checkpoint

    model = _model()
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, state_format="bf16")
    train(model, opt, batches(2))
    path = checkpoint.save(tmp_path, 2, model, opt, None, {"preset": "test"})
    assert checkpoint.read_meta(path)["state_format"] == "bf16"
    saved = torch.load(path / "optimizer.pt", weights_only=True)
    assert all(e["exp_avg"].dtype == torch.bfloat16 for e in saved["state"].values())


# ---- GPU --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1])
def test_cuda_kernel_matches_the_cpu_kernel_bit_for_bit(offset):
    sizes = [1, 5, 4097, 1_000_003]
    gen = torch.Generator().manual_seed(offset)

    def dev(t):
        base = torch.empty(t.numel() + offset, dtype=t.dtype, device="cuda")
        out = base[offset:]
        out.copy_(t)
        return out

    cpu = []
    for n in sizes:
        cpu.append([torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 1e-2).bfloat16(),
                    (torch.rand(n, generator=gen) * 1e-4).bfloat16(), torch.empty(n, dtype=torch.bfloat16)])
    gpu = [[dev(t) for t in ts[:3]] for ts in cpu]
    gpu_g = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    gpu_w = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    seeds = [3, 4, 5, 6]
    fused = hytrain.CudaAdamW([t[0] for t in gpu], [t[1] for t in gpu], [t[2] for t in gpu], gpu_g,
                              weights=gpu_w, seeds=seeds)
    for step in (1, 2, 3):
        grads = [(torch.randn(n, generator=gen) * 1e-2).bfloat16() for n in sizes]
        for g, gg in zip(grads, gpu_g):
            gg.copy_(g)
        fused.step(step=step, lr=1e-3, weight_decay=0.05)
        for (p, m, v, w), g, seed in zip(cpu, grads, seeds):
            hytrain.adamw_step(p, g, m, v, step=step, lr=1e-3, weight_decay=0.05, param_copy=w, seed=seed)
    torch.cuda.synchronize()
    for (p, m, v, w), (gp, gm, gv), gw in zip(cpu, gpu, gpu_w):
        assert torch.equal(gp.cpu(), p) and torch.equal(gw.cpu(), w)
        assert torch.equal(gm.cpu().view(torch.int16), m.view(torch.int16))
        assert torch.equal(gv.cpu().view(torch.int16), v.view(torch.int16))


def held(t: torch.Tensor, n: int) -> torch.Tensor:
    """What a state tensor holds: itself, or an 8-bit buffer's codes and scales (not its padding)."""
    if t.dtype != torch.uint8:
        return t
    t = t.cpu()
    return torch.cat([t[:n], t[quant8.codes_bytes(n):]])


@pytest.mark.gpu
@pytest.mark.parametrize("state_format", ["bf16", "8bit"])
@pytest.mark.parametrize("max_grad_norm", [None, 0.3])
def test_cuda_compact_states_are_exact_whatever_the_placement(max_grad_norm, state_format):
    # k changes every few steps (states move both ways, in their format as they are) and with
    # clipping the CPU blocks speculate: every weight and state ends bit-identical to the run that
    # keeps k = 0.
    data = [[x.cuda() for x in m] for m in batches(16)]
    runs = []
    for schedule in (None, [0, 3, 1, 2, 0, 3]):
        torch.manual_seed(0)
        model = LlamaModel(CFG).to(torch.bfloat16).cuda()
        opt = hytrain.HybridAdamW(model.parameters(), lr=2e-3, weight_decay=0.1, model=model, gpu_blocks=0,
                                  max_grad_norm=max_grad_norm, state_format=state_format)

        def step_fn(i, opt=opt, schedule=schedule):
            opt.step()
            if schedule is not None:
                opt.set_gpu_blocks(schedule[(i // 2) % len(schedule)], wait=False)

        losses = train(model, opt, data, step_fn=step_fn)
        opt.synchronize()
        runs.append((losses, model, opt))
    (l0, m0, o0), (l1, m1, o1) = runs
    assert l0 == l1
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "master"):
            assert torch.equal(held(o0.state[p][key], p.numel()).cpu(), held(o1.state[q][key], q.numel()).cpu()), key
        assert o1.state[q]["exp_avg"].dtype == FORMATS[state_format].dtype
