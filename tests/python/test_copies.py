"""Copy streams: ordering against the compute stream with poisoned outputs, many copies in both
directions while the compute stream is busy, host completion (query, wait, timeout), event times,
and errors that name the problem."""

import subprocess
import sys
import textwrap

import pytest
import torch

import hytrain

SPIN = 20_000_000  # torch.cuda._sleep cycles: several ms of compute-stream work ahead of the copy


@pytest.fixture(scope="module")
def pool():
    return hytrain.PinnedPool("2GiB")


@pytest.mark.gpu
def test_d2h_waits_for_the_producer(pool):
    compute = torch.cuda.current_stream()
    d2h = hytrain.CopyStream("d2h")
    n = 3_000_001
    src = torch.zeros(n, device="cuda")
    payload = torch.randn(n, device="cuda")
    dst = pool.empty(n, torch.float32).fill_(float("nan"))  # poisoned
    torch.cuda._sleep(SPIN)
    src.copy_(payload)  # the producer, still queued behind the sleep
    ticket = d2h.copy_(dst, src, after=compute)
    d2h.wait(ticket)
    assert d2h.completed == ticket == 1
    assert torch.equal(dst, payload.cpu())


@pytest.mark.gpu
def test_h2d_then_compute_waits_for_it(pool):
    compute = torch.cuda.current_stream()
    h2d = hytrain.CopyStream("h2d")
    n = 2_000_003
    src = pool.empty(n, torch.bfloat16).copy_(torch.randn(n).bfloat16())
    dst = torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned on compute
    ticket = h2d.copy_(dst, src, after=compute)  # must not overtake the poisoning
    h2d.make_wait(compute, ticket)
    out = dst.float() * 2  # on compute, after the copy
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), src.float() * 2)


@pytest.mark.gpu
def test_many_blocks_both_ways_while_compute_is_busy(pool):
    """A miniature pipeline: gradients out, weights back, matmuls on the compute stream throughout."""
    compute = torch.cuda.current_stream()
    d2h, h2d = hytrain.CopyStream("d2h"), hytrain.CopyStream("h2d", priority=-1)
    gen = torch.Generator().manual_seed(5)
    sizes = [0, 1, 17, 4096, 65_537, 1_000_000, 3_333_333] * 4
    grads = [torch.randn(n, generator=gen).bfloat16().cuda() for n in sizes]
    staged = [pool.empty(n, torch.bfloat16).fill_(float("nan")) for n in sizes]
    weights_host = [pool.empty(n, torch.bfloat16).copy_(torch.randn(n, generator=gen).bfloat16())
                    for n in sizes]
    weights = [torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda") for n in sizes]
    a = torch.randn(2048, 2048, device="cuda")
    tickets_out, tickets_in = [], []
    for i in range(len(sizes)):
        a = torch.tanh(a @ a)  # compute keeps running
        tickets_out.append(d2h.copy_(staged[i], grads[i], after=compute))
        tickets_in.append(h2d.copy_(weights[i], weights_host[i], after=compute))
    h2d.make_wait(compute)
    checks = [w.float() * 3 for w in weights]  # on compute, after every H2D
    for i, t in enumerate(tickets_out):
        d2h.wait(t)
        assert torch.equal(staged[i], grads[i].cpu()), f"block {i} D2H"
    torch.cuda.synchronize()
    for i, w in enumerate(weights):
        assert torch.equal(w.cpu(), weights_host[i]), f"block {i} H2D"
        assert torch.equal(checks[i].cpu(), weights_host[i].float() * 3), f"block {i} compute"
    assert d2h.completed == d2h.issued == len(sizes)
    assert tickets_out == list(range(1, len(sizes) + 1))


@pytest.mark.gpu
def test_host_learns_of_completion_and_times_out(pool):
    compute = torch.cuda.current_stream()
    d2h = hytrain.CopyStream("d2h")
    src = torch.randn(1 << 20, device="cuda")
    dst = pool.empty(1 << 20, torch.float32)
    torch.cuda._sleep(SPIN * 50)  # long enough that the copy cannot have landed yet
    t = d2h.copy_(dst, src, after=compute)
    assert not d2h.query(t)
    with pytest.raises(TimeoutError, match="had not landed"):
        d2h.wait(t, timeout=0.001)
    d2h.wait(t)
    assert d2h.query(t) and d2h.completed == 1
    start, end = d2h.times_ms(t)
    assert 0.0 <= start <= end
    assert torch.equal(dst, src.cpu())


@pytest.mark.gpu
def test_event_ring_wraps_without_losing_order(pool):
    d2h = hytrain.CopyStream("d2h")
    src = torch.arange(256, dtype=torch.float32, device="cuda")
    dsts = [pool.empty(256, torch.float32).fill_(-1) for _ in range(3000)]  # > the 1024-slot ring
    for i, d in enumerate(dsts):
        d2h.copy_(d, src)
    d2h.wait()
    assert d2h.completed == 3000
    assert all(torch.equal(d, src.cpu()) for d in dsts)
    with pytest.raises(RuntimeError, match="older than the event ring"):
        d2h.times_ms(1)


@pytest.mark.gpu
def test_bad_arguments(pool):
    d2h = hytrain.CopyStream("d2h")
    src = torch.randn(100, device="cuda")
    with pytest.raises(ValueError, match="pageable host memory"):
        d2h.copy_(torch.empty(100), src)
    with pytest.raises(ValueError, match="dst has 99 elements"):
        d2h.copy_(pool.empty(99, torch.float32), src)
    with pytest.raises(TypeError, match="does not convert"):
        d2h.copy_(pool.empty(100, torch.bfloat16), src)
    with pytest.raises(ValueError, match="src must be on the cuda device"):
        d2h.copy_(pool.empty(100, torch.float32), torch.randn(100))
    with pytest.raises(ValueError, match="contiguous"):
        d2h.copy_(pool.empty(100, torch.float32), torch.randn(200, device="cuda")[::2])
    with pytest.raises(ValueError, match="never issued"):
        d2h.wait(5)
    with pytest.raises(RuntimeError, match="does not exist"):
        hytrain.native().CudaCopyStream(1000, "d2h")


@pytest.mark.gpu
def test_cuda_errors_name_the_call():
    # In a child process: a bad device address must surface as an exception naming the CUDA call,
    # file and line, never a crash (and any sticky error stays out of this test process).
    code = textwrap.dedent("""
        import torch, hytrain
        pool = hytrain.PinnedPool("64MiB")
        host = pool.empty(1024, torch.uint8)
        cs = hytrain.native().CudaCopyStream(0, "h2d")
        try:
            cs.copy(0x10, host.data_ptr(), 1024, None)
            cs.wait(cs.issued, 10.0)
            print("NO ERROR")
        except RuntimeError as e:
            print("ERROR", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "copy_stream.cu" in out.stdout, out.stdout
    assert "cudaMemcpyAsync" in out.stdout or "copy stream" in out.stdout, out.stdout


def test_refused_without_gpu_or_with_bad_direction():
    with pytest.raises(ValueError, match="direction must be"):
        hytrain.CopyStream("sideways")
    if not hytrain.cuda_available():
        with pytest.raises(RuntimeError, match="needs hytrain built with CUDA"):
            hytrain.CopyStream("d2h")
