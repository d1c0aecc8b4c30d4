"""HybridAdamW on an FSDP2-sharded model on one GPU (torchrun, NCCL, world size 1), through the whole
GPU path -- bf16 weights, the offload pipeline, k chosen by the scheduler, speculation under
clipping -- against the unsharded optimizer on the same GPU, and a sharded checkpoint resumed bit for
bit."""

import pytest
import torch

from test_distributed import run

pytestmark = pytest.mark.gpu


def _close(a, b, tol=2e-2):
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=tol, atol=tol)
    for name in a["weights"]:
        torch.testing.assert_close(torch.tensor(a["weights"][name]), torch.tensor(b["weights"][name]),
                                   rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("clip", [[], ["--clip", "0.5"], ["--routed-clip", "0.5"]], ids=["noclip", "clip", "routed"])
def test_fsdp2_world_size_one_matches_the_unsharded_optimizer(tmp_path, clip):
    gpu = ["--device", "cuda", "--dtype", "bfloat16", "--steps", "8"]
    ref = run(tmp_path, "plain", *gpu, *clip)
    got = run(tmp_path, "sharded", *gpu, *clip, nproc=1)
    assert got["world"] == 1
    _close(ref, got)
    if clip:
        torch.testing.assert_close(torch.tensor(ref["norms"]), torch.tensor(got["norms"]), rtol=2e-2, atol=2e-2)


def test_fsdp2_checkpoint_resume_on_the_gpu(tmp_path):
    # Within bf16 tolerance of the uninterrupted run. The CPU test (test_distributed.py) is bit for
    # bit; on the GPU this fails today -- the losses drift apart after the first resumed step (a known
    # bug, see docs/architecture.md).
    gpu = ["--device", "cuda", "--dtype", "bfloat16", "--steps", "8", "--clip", "0.5"]
    whole = run(tmp_path, "whole", *gpu, nproc=1)
    ck = str(tmp_path / "ck")
    first = run(tmp_path, "first", *gpu, "--ckpt", ck, "--save-at", "4", nproc=1)
    second = run(tmp_path, "second", *gpu, "--ckpt", ck, "--resume", nproc=1)
    assert second["start"] == 4
    assert first["losses"] == whole["losses"][:4]
    assert second["losses"][0] == whole["losses"][4]  # the first step after the resume: same weights
    _close({**whole, "losses": whole["losses"][4:]}, second)
