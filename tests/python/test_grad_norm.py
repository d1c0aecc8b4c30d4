"""Gradient norm and non-finite detection: against a float64 sum, bitwise reproducible, the found_inf
flag for every position and dtype, and the clip multiplier against torch's clip_grad_norm_."""

import math

import pytest
import torch

import hytrain

SIZES = [0, 1, 7, 8, 4097, 32768, 32769, 100_003, 1_000_000]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def mixed(gen, offset=0, scale=1.0):
    """Mixed-dtype CUDA tensors of awkward sizes; offset > 0 makes them start unaligned."""
    out = []
    for i, n in enumerate(SIZES):
        dtype = DTYPES[i % 3]
        base = torch.empty(n + offset, dtype=dtype, device="cuda")
        t = base[offset:]
        t.copy_((torch.randn(n, generator=gen) * scale).to(dtype))
        out.append(t)
    return out


def sumsq64(ts):
    return sum(float(t.double().pow(2).sum()) for t in ts)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_sum_of_squares_matches_float64_and_accumulates(offset):
    gen = torch.Generator().manual_seed(offset)
    ts = mixed(gen, offset)
    norm = hytrain.CudaGradNorm(ts)
    assert norm.numel == sum(SIZES)
    sumsq = torch.tensor([2.5], device="cuda")  # accumulates on top of what is there
    found = torch.zeros(1, device="cuda")
    norm.accumulate(sumsq, found)
    ref = 2.5 + sumsq64(ts)
    assert math.isclose(sumsq.item(), ref, rel_tol=2e-6), (sumsq.item(), ref)
    assert found.item() == 0.0
    # Per-block use: two groups into one buffer give the same total.
    halves = [hytrain.CudaGradNorm(ts[:4]), hytrain.CudaGradNorm(ts[4:])]
    split = torch.zeros(1, device="cuda")
    for h in halves:
        h.accumulate(split)
    assert math.isclose(split.item(), ref - 2.5, rel_tol=2e-6)


@pytest.mark.gpu
def test_bitwise_reproducible():
    gen = torch.Generator().manual_seed(7)
    ts = mixed(gen, scale=3.0) + [torch.randn(5_000_000, generator=gen).cuda()]
    norm = hytrain.CudaGradNorm(ts)
    results = set()
    for _ in range(5):
        s = torch.zeros(1, device="cuda")
        norm.accumulate(s, stream=torch.cuda.Stream())
        torch.cuda.synchronize()
        results.add(s.view(torch.int32).item())
    assert len(results) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 8, 4096, 32767, 32768, 99_999])  # vector body and tails
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_detected_everywhere(bad, where, dtype):
    gen = torch.Generator().manual_seed(where)
    clean = torch.randn(100_003, generator=gen).to(dtype).cuda()
    dirty = clean.clone()
    dirty[where] = bad
    small = torch.randn(5, generator=gen).cuda()
    found = torch.zeros(1, device="cuda")
    sumsq = torch.zeros(1, device="cuda")
    hytrain.CudaGradNorm([small, clean]).accumulate(sumsq, found)
    assert found.item() == 0.0 and math.isfinite(sumsq.item())
    hytrain.CudaGradNorm([small, dirty]).accumulate(sumsq, found)
    assert found.item() == 1.0


@pytest.mark.gpu
def test_large_finite_values_are_not_flagged():
    # Squares overflow fp32 (sumsq becomes inf) but no element is non-finite: found_inf stays 0.
    t = torch.full((1000,), 3e38, device="cuda")
    found = torch.zeros(1, device="cuda")
    sumsq = torch.zeros(1, device="cuda")
    hytrain.CudaGradNorm([t]).accumulate(sumsq, found)
    assert found.item() == 0.0 and math.isinf(sumsq.item())


@pytest.mark.gpu
@pytest.mark.parametrize("max_norm,scale", [(1.0, 1.0), (1e6, 1.0), (0.5, 1024.0), (None, 256.0)])
def test_clip_multiplier_matches_clip_grad_norm(max_norm, scale):
    gen = torch.Generator().manual_seed(11)
    grads = [(torch.randn(n, generator=gen) * scale).cuda() for n in (1000, 33_000, 7)]
    norm = hytrain.CudaGradNorm(grads)
    sumsq = torch.zeros(1, device="cuda")
    norm.accumulate(sumsq)
    inv = torch.tensor([1.0 / scale], device="cuda")
    mult = torch.full((1,), float("nan"), device="cuda")
    hytrain.clip_multiplier(sumsq, mult, max_norm=max_norm, inv_scale=inv)
    # Reference: torch's unscale-then-clip on float64 copies.
    ref = [torch.nn.Parameter(g.double() / scale) for g in grads]
    for r in ref:
        r.grad = r.detach().clone()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(ref, max_norm)
    for g, r in zip(grads, ref):
        torch.testing.assert_close((g * mult).double(), r.grad, rtol=2e-6, atol=0)


@pytest.mark.gpu
def test_bad_arguments():
    t = torch.randn(10, device="cuda")
    norm = hytrain.CudaGradNorm([t])
    with pytest.raises(TypeError, match="sumsq must have dtype float32"):
        norm.accumulate(torch.zeros(1, device="cuda", dtype=torch.float64))
    with pytest.raises(ValueError, match="sumsq has 2 elements"):
        norm.accumulate(torch.zeros(2, device="cuda"))
    s = torch.zeros(1, device="cuda")
    with pytest.raises(ValueError, match="separate"):
        norm.accumulate(s, s)
    with pytest.raises(TypeError, match=r"tensors\[1\] must have dtype"):
        hytrain.CudaGradNorm([t, torch.zeros(3, device="cuda", dtype=torch.int32)])
    with pytest.raises(ValueError, match="max_norm must be >"):
        hytrain.clip_multiplier(s, torch.zeros(1, device="cuda"), max_norm=0.0)


def test_cpu_tensors_are_refused_before_native_code():
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        hytrain.CudaGradNorm([torch.zeros(3)])
    with pytest.raises(ValueError, match="non-empty list"):
        hytrain.CudaGradNorm([])
    with pytest.raises(ValueError, match="sumsq must be on the cuda device"):
        hytrain.clip_multiplier(torch.zeros(1), torch.zeros(1), max_norm=1.0)
