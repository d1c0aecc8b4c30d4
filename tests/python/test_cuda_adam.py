"""Fused multi-tensor CUDA AdamW: against a float64 run of torch's formula, bit-identical to the CPU
kernel, against torch's fused CUDA AdamW, the found_inf skip, and argument checks (CPU-runnable)."""

import pytest
import torch

import hytrain
from test_cpu_adam import check_vs_float64

SIZES = [1, 3, 4, 4097, 16384, 16385 * 3, 1_000_003]


def make(sizes, grad_dtype, weight_dtype, gen, offset=0):
    """Device tensors (views starting `offset` elements in, to exercise the unaligned path)."""
    def dev(n, dtype=torch.float32, fill=None):
        base = torch.empty(n + offset, dtype=dtype, device="cuda")
        t = base[offset:]
        if fill is not None:
            t.fill_(fill)
        return t
    ps = [dev(n) for n in sizes]
    for p in ps:
        p.copy_(torch.randn(p.numel(), generator=gen))
    ms = [dev(n, fill=0.0) for n in sizes]
    vs = [dev(n, fill=0.0) for n in sizes]
    gs = [dev(n, grad_dtype) for n in sizes]
    ws = [dev(n, weight_dtype, fill=float("nan")) for n in sizes] if weight_dtype else None
    return ps, ms, vs, gs, ws


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype,weight_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float32, None), (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("offset", [0, 1])
def test_matches_cpu_bitwise_and_float64(grad_dtype, weight_dtype, offset):
    gen = torch.Generator().manual_seed(offset + 3)
    ps, ms, vs, gs, ws = make(SIZES, grad_dtype, weight_dtype, gen, offset)
    opt = hytrain.CudaAdamW(ps, ms, vs, gs, weights=ws)
    cpu = [(p.cpu(), torch.zeros(p.numel()), torch.zeros(p.numel())) for p in ps]
    ref64 = [p.cpu().double().requires_grad_(True) for p in ps]
    topt = torch.optim.AdamW(ref64, lr=1e-3, weight_decay=0.05, foreach=False)
    for step in range(1, 21):
        lr = 1e-3 * (0.5 + torch.rand((), generator=gen).item())
        scale = 0.25 + torch.rand((), generator=gen).item()
        topt.param_groups[0]["lr"] = lr
        for i, g in enumerate(gs):
            gh = torch.randn(g.numel(), generator=gen).to(grad_dtype)
            g.copy_(gh)
            ref64[i].grad = (gh.float() * torch.tensor(scale)).double()
            hytrain.adamw_step(cpu[i][0], gh, cpu[i][1], cpu[i][2], step=step, lr=lr,
                               weight_decay=0.05, grad_scale=scale, simd="avx512"
                               if "avx512" in hytrain.simd_paths()["supported"] else "avx2")
        topt.step()
        opt.step(step=step, lr=lr, weight_decay=0.05, grad_scale=scale)
    torch.cuda.synchronize()
    for i in range(len(ps)):
        # Bit-identical to the CPU kernel: a block can move between CPU and GPU freely.
        assert torch.equal(ps[i].cpu(), cpu[i][0]), f"param {i}"
        assert torch.equal(ms[i].cpu(), cpu[i][1]), f"exp_avg {i}"
        assert torch.equal(vs[i].cpu(), cpu[i][2]), f"exp_avg_sq {i}"
        check_vs_float64(f"param {i}", ps[i].cpu(), ref64[i].detach())
        if ws is not None:
            assert torch.equal(ws[i].cpu().view(torch.int16),
                               ps[i].cpu().to(weight_dtype).view(torch.int16)), f"weight {i}"


@pytest.mark.gpu
def test_close_to_torch_fused_cuda_adamw():
    gen = torch.Generator().manual_seed(9)
    ps, ms, vs, gs, _ = make(SIZES, torch.float32, None, gen)
    ref = [p.clone().requires_grad_(True) for p in ps]
    topt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.05, fused=True)
    opt = hytrain.CudaAdamW(ps, ms, vs, gs)
    for step in range(1, 21):
        for g, r in zip(gs, ref):
            g.copy_(torch.randn(g.numel(), generator=gen))
            r.grad = g.clone()
        topt.step()
        opt.step(step=step, lr=1e-3, weight_decay=0.05)
    for p, r in zip(ps, ref):
        d = ((p - r.detach()).abs() / torch.maximum(r.detach().abs(), r.detach().pow(2).mean().sqrt()))
        assert d.max().item() <= 4e-6


@pytest.mark.gpu
def test_found_inf_skips_and_device_scale_applies():
    gen = torch.Generator().manual_seed(4)
    ps, ms, vs, gs, ws = make([5000, 17], torch.bfloat16, torch.bfloat16, gen)
    for g in gs:
        g.copy_(torch.randn(g.numel(), generator=gen))
    opt = hytrain.CudaAdamW(ps, ms, vs, gs, weights=ws)
    before = [t.clone() for t in ps + ms + vs + ws]
    found_inf = torch.ones(1, device="cuda")
    opt.step(step=1, found_inf=found_inf)
    torch.cuda.synchronize()
    after = ps + ms + vs + ws
    for b, a in zip(before, after):
        assert torch.equal(b.view(torch.uint8), a.view(torch.uint8))  # nothing written, NaN poison kept
    found_inf.zero_()
    scale = torch.full((1,), 0.5, device="cuda")
    cpu = [(p.cpu(), torch.zeros(p.numel()), torch.zeros(p.numel())) for p in ps]
    opt.step(step=1, grad_scale=0.25, grad_scale_tensor=scale, found_inf=found_inf)
    for (p, m, v), g in zip(cpu, gs):
        hytrain.adamw_step(p, g.cpu(), m, v, step=1, grad_scale=0.125)
    torch.cuda.synchronize()
    for (p, _, _), pd in zip(cpu, ps):
        assert torch.equal(p, pd.cpu())


def test_bad_arguments_are_named_before_native_code():
    cpu = [torch.zeros(4)]
    with pytest.raises(ValueError, match="params\\[0\\] must be a CUDA tensor"):
        hytrain.CudaAdamW(cpu, cpu, cpu, cpu)
    with pytest.raises(ValueError, match="exp_avgs has 2 tensors"):
        hytrain.CudaAdamW(cpu, cpu * 2, cpu, cpu)
    with pytest.raises(TypeError, match="grads must be a list"):
        hytrain.CudaAdamW(cpu, cpu, cpu, torch.zeros(4))
    with pytest.raises(ValueError, match="max_exp_avg_sqs is required"):
        hytrain.CudaAdamW(cpu, cpu, cpu, cpu, amsgrad=True)
    meta = [torch.empty(4, device="meta")]
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        hytrain.CudaAdamW(meta, meta, meta, meta)


@pytest.mark.gpu
def test_bad_arguments_on_gpu():
    p = [torch.zeros(8, device="cuda")]
    with pytest.raises(TypeError, match="grads\\[0\\] must have dtype"):
        hytrain.CudaAdamW(p, [torch.zeros(8, device="cuda")], [torch.zeros(8, device="cuda")],
                          [torch.zeros(8, dtype=torch.int32, device="cuda")])
    with pytest.raises(ValueError, match="exp_avgs\\[0\\] must be on the cuda device"):
        hytrain.CudaAdamW(p, [torch.zeros(8)], [torch.zeros(8, device="cuda")],
                          [torch.zeros(8, device="cuda")])
    with pytest.raises(ValueError, match="overlap"):
        hytrain.CudaAdamW(p, p, [torch.zeros(8, device="cuda")], [torch.zeros(8, device="cuda")])
    opt = hytrain.CudaAdamW(p, [torch.zeros(8, device="cuda")], [torch.zeros(8, device="cuda")],
                            [torch.zeros(8, device="cuda")])
    with pytest.raises(ValueError, match="step must be >= 1"):
        opt.step(step=0)
    with pytest.raises(ValueError, match="found_inf must be on the cuda device"):
        opt.step(step=1, found_inf=torch.zeros(1))
