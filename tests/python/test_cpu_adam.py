"""hytrain.adamw_step against torch.optim.AdamW / Adam (foreach=False) and a float64 run of the same
torch formula, element by element, for every SIMD path this CPU runs, on fresh random inputs."""

import pytest
import torch

import hytrain

PATHS = hytrain.simd_paths()["supported"]
STEPS = 20


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|x - ref| / max(|ref|, rms(ref)), in float64."""
    x, ref = x.double(), ref.double()
    floor = ref.pow(2).mean().sqrt() if ref.numel() else torch.tensor(0.0, dtype=torch.float64)
    return (x - ref).abs() / torch.maximum(ref.abs(), floor)


def check_vs_float64(name, x, ref):
    """Every element within 2e-6 and all but 1e-5 of them within 1e-6 (see tests/cpp/test_adamw.cpp)."""
    if ref.numel() == 0:
        return
    e = rel_err(x, ref)
    assert not torch.isnan(e).any(), f"{name}: NaN"
    assert e.max() <= 2e-6, f"{name}: worst relative error {e.max():.3g}"
    over = int((e > 1e-6).sum())
    assert over <= 1e-5 * e.numel(), f"{name}: {over} of {e.numel()} elements over 1e-6"


def run(n, grad_dtype, copy_dtype, *, path, amsgrad=False, decoupled=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    opt_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref32 = p0.clone().requires_grad_(True)
    ref64 = p0.double().requires_grad_(True)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, amsgrad=amsgrad, foreach=False)
    opt32, opt64 = opt_cls([ref32], **kw), opt_cls([ref64], **kw)

    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    vmax = torch.zeros(n) if amsgrad else None
    copy = torch.empty(n, dtype=copy_dtype) if copy_dtype else None
    for step in range(1, STEPS + 1):
        lr = 1e-3 * (0.5 + torch.rand((), generator=gen).item())  # an LR schedule
        scale = 0.25 + torch.rand((), generator=gen).item()
        for o in (opt32, opt64):
            o.param_groups[0]["lr"] = lr
        g = (torch.randn(n, generator=gen) * 10 ** (2 * torch.rand((), generator=gen).item() - 1))
        g = g.to(grad_dtype)
        # torch's reference sees the gradient that hytrain computes in its first operation.
        g_scaled = g.float() * torch.tensor(scale, dtype=torch.float32)
        ref32.grad = g_scaled.clone()
        ref64.grad = g_scaled.double()
        opt32.step()
        opt64.step()
        if copy is not None:
            copy.fill_(float("nan"))  # poison
        bad = hytrain.adamw_step(p, g, m, v, step=step, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=0.05, decoupled=decoupled, amsgrad=amsgrad,
                                 max_exp_avg_sq=vmax, grad_scale=scale, param_copy=copy, simd=path)
        assert bad is False
    s32, s64 = opt32.state[ref32], opt64.state[ref64]
    return dict(p=p, m=m, v=v, vmax=vmax, copy=copy, ref32=ref32.detach(), ref64=ref64.detach(),
                s32=s32, s64=s64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("grad_dtype,copy_dtype", [
    (torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("n", [0, 1, 7, 17, 1000, 65537, 1_000_003])
def test_matches_torch_adamw(path, grad_dtype, copy_dtype, n):
    r = run(n, grad_dtype, copy_dtype, path=path, seed=n + 7)
    # Against the float64 run of torch's formula.
    check_vs_float64("param", r["p"], r["ref64"])
    if n:
        check_vs_float64("exp_avg", r["m"], r["s64"]["exp_avg"])
        check_vs_float64("exp_avg_sq", r["v"], r["s64"]["exp_avg_sq"])
        # Against torch's own fp32 AdamW: equal within float rounding.
        for name, x, ref in [("param", r["p"], r["ref32"]), ("exp_avg", r["m"], r["s32"]["exp_avg"]),
                             ("exp_avg_sq", r["v"], r["s32"]["exp_avg_sq"])]:
            e = rel_err(x, ref).max()
            assert e <= 4e-6, f"{name} vs torch fp32: {e:.3g}"
    # The low-precision copy is bit-identical to torch's conversion of the fp32 result.
    if copy_dtype is not None:
        assert torch.equal(r["copy"].view(torch.int16), r["p"].to(copy_dtype).view(torch.int16))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("amsgrad,decoupled", [(True, True), (False, False), (True, False)])
def test_amsgrad_and_l2_adam(path, amsgrad, decoupled):
    r = run(100_003, torch.bfloat16, torch.bfloat16, path=path, amsgrad=amsgrad,
            decoupled=decoupled, seed=3)
    check_vs_float64("param", r["p"], r["ref64"])
    check_vs_float64("exp_avg", r["m"], r["s64"]["exp_avg"])
    check_vs_float64("exp_avg_sq", r["v"], r["s64"]["exp_avg_sq"])
    if amsgrad:
        check_vs_float64("max_exp_avg_sq", r["vmax"], r["s64"]["max_exp_avg_sq"])


@pytest.mark.slow
def test_tens_of_millions_against_float64():
    r = run(12_000_001, torch.bfloat16, torch.bfloat16, path="auto", seed=11)
    check_vs_float64("param", r["p"], r["ref64"])
    check_vs_float64("exp_avg", r["m"], r["s64"]["exp_avg"])
    check_vs_float64("exp_avg_sq", r["v"], r["s64"]["exp_avg_sq"])
    assert torch.equal(r["copy"].view(torch.int16), r["p"].to(torch.bfloat16).view(torch.int16))


def test_torch_fp32_has_the_same_worst_case():
    """The float64 tolerance is fp32's own: torch's fp32 AdamW passes the same check."""
    r = run(1_000_003, torch.float32, None, path="auto", seed=5)
    check_vs_float64("torch param", r["ref32"], r["ref64"])
    check_vs_float64("torch exp_avg_sq", r["s32"]["exp_avg_sq"], r["s64"]["exp_avg_sq"])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_copy_rounding_special_values(path, copy_dtype):
    """Weights that are NaN, infinite, huge, tiny or exactly halfway round as torch's .to() does."""
    n = 4096
    bits = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int64).to(torch.int32)
    p = bits.view(torch.float32).clone()
    p[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 65519.99, 65520.0, 1e-8, -0.0, 3e38])
    p[p.isnan()] = float("nan")
    m, v, g = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    copy = torch.empty(n, dtype=copy_dtype)
    # lr = 0 and no decay: the weights pass through unchanged, so the copy is the rounding alone.
    hytrain.adamw_step(p, g, m, v, step=1, lr=0.0, weight_decay=0.0, param_copy=copy, simd=path)
    want = p.to(copy_dtype)
    nan = want.isnan()
    assert torch.equal(copy.isnan(), nan)
    assert torch.equal(copy[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_gradient_reported(path):
    for bad_value in (float("inf"), float("nan")):
        for at in (0, 500, 1020):
            p, m, v, g = torch.randn(1021), torch.zeros(1021), torch.zeros(1021), torch.randn(1021)
            g[at] = bad_value
            assert hytrain.adamw_step(p, g, m, v, step=1, simd=path) is True
    g = torch.full((33,), 60000.0, dtype=torch.float16)
    p, m, v = torch.zeros(33), torch.zeros(33), torch.zeros(33)
    assert hytrain.adamw_step(p, g, m, v, step=1, grad_scale=1e35, simd=path) is True


def test_thread_counts_agree():
    gen = torch.Generator().manual_seed(1)
    p0, g = torch.randn(300_001, generator=gen), torch.randn(300_001, generator=gen)
    outs = []
    for threads in (1, 2, 3):
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for step in (1, 2):
            hytrain.adamw_step(p, g, m, v, step=step, num_threads=threads)
        outs.append(p)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_set_simd_path_forces_and_validates(monkeypatch):
    before = hytrain.simd_paths()["selected"]
    try:
        hytrain.set_simd_path("scalar")
        assert hytrain.simd_paths()["selected"] == "scalar"
    finally:
        hytrain.set_simd_path("auto")
    assert hytrain.simd_paths()["selected"] == before
    with pytest.raises(ValueError, match="simd"):
        hytrain.set_simd_path("sse9")


def test_a_bad_hytrain_simd_is_refused_naming_the_variable(monkeypatch):
    """HYTRAIN_SIMD is checked where it is used: simd_paths(), adamw_step() and HybridAdamW's
    construction raise a ValueError naming the variable, nothing written; a good value is used, and
    set_simd_path() takes precedence over it."""
    monkeypatch.setattr(hytrain.cpu_adam, "_simd_path", None)  # no set_simd_path() choice
    monkeypatch.setenv("HYTRAIN_SIMD", "sse9")
    for call in (hytrain.simd_paths,
                 lambda: hytrain.HybridAdamW([torch.nn.Parameter(torch.ones(3))], lr=1e-3)):
        with pytest.raises(ValueError, match="HYTRAIN_SIMD='sse9'"):
            call()
    p, g, m, v = torch.ones(100), torch.full((100,), 0.1), torch.zeros(100), torch.zeros(100)
    with pytest.raises(ValueError, match="HYTRAIN_SIMD"):
        hytrain.adamw_step(p, g, m, v, step=1)
    assert bool((p == 1).all() and (m == 0).all())
    monkeypatch.setenv("HYTRAIN_SIMD", "scalar")
    assert hytrain.simd_paths()["selected"] == "scalar"
    hytrain.set_simd_path("auto")
    assert hytrain.simd_paths()["selected"] == hytrain.native().best_simd_path()


def test_hytrain_simd_naming_a_path_this_cpu_lacks_is_a_value_error(monkeypatch):
    """A real path the CPU or build lacks (here: every vector path, as on a CPU without AVX2) is
    refused with the variable and what the CPU runs named (it once recursed through simd_paths())."""
    nat = hytrain.native()
    monkeypatch.setattr(nat, "cpu_supports", lambda p: p == "scalar")
    monkeypatch.setattr(hytrain.cpu_adam, "_simd_path", None)
    monkeypatch.setattr(hytrain.cpu_adam, "_env_checked", {})
    monkeypatch.setenv("HYTRAIN_SIMD", "avx2")
    for call in (hytrain.simd_paths,
                 lambda: hytrain.HybridAdamW([torch.nn.Parameter(torch.ones(3))], lr=1e-3)):
        with pytest.raises(ValueError, match=r"HYTRAIN_SIMD='avx2'.*not available.*it runs scalar"):
            call()
    with pytest.raises(ValueError, match=r"'avx512' is not available.*it runs scalar"):
        hytrain.set_simd_path("avx512")
