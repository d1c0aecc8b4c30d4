"""On a GPU machine: pool memory is page-locked and usable for asynchronous copies."""

import pytest
import torch

import hytrain

pytestmark = pytest.mark.gpu


def test_pool_is_page_locked_and_copies_round_trip():
    pool = hytrain.PinnedPool("1GiB")
    assert pool.kind == "cuda-registered" and pool.page_locked
    host = pool.empty(1 << 24, torch.float32)
    # Asked of the driver directly: torch's is_pinned() only recognises its own host allocations.
    assert hytrain.native().is_page_locked(host.data_ptr())
    assert not hytrain.native().is_page_locked(torch.empty(1 << 20).data_ptr())
    host.copy_(torch.randn(1 << 24))
    dev = torch.full((1 << 24,), float("nan"), device="cuda")  # poisoned
    back = pool.empty(1 << 24, torch.float32).fill_(float("nan"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev.copy_(host, non_blocking=True)
        back.copy_(dev, non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, host)


def test_build_reports_the_gpu():
    info = hytrain.build_info()
    assert info["cuda"] and info["cuda_devices"]
    assert info["cuda_driver"]
