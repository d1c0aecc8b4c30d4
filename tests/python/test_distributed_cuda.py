"""HybridAdamW on an FSDP2-sharded model on one GPU (torchrun, NCCL, world size 1), through the whole
GPU path -- bf16 weights, the offload pipeline, k chosen by the scheduler, speculation under
clipping -- against the unsharded optimizer on the same GPU, and a sharded checkpoint whose state
reads back bit for bit (fp32 and 8-bit states)."""

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


@pytest.mark.parametrize("fmt", [[], ["--state-format", "8bit", "--hidden", "256"]], ids=["fp32", "8bit"])
def test_fsdp2_checkpoint_resume_on_the_gpu(tmp_path, fmt):
    # The optimizer's shards are host buffers while the mesh is a CUDA mesh: the load must fill the
    # buffers themselves (not a GPU copy of them), so the state read back equals the state saved, bit
    # for bit, and the resumed run follows the uninterrupted one. With 8-bit states too (codes and
    # scales in place, in host buffers and in GPU-resident blocks' buffers; the rest re-quantised).
    gpu = ["--device", "cuda", "--dtype", "bfloat16", "--steps", "8", "--clip", "0.5", *fmt]
    whole = run(tmp_path, "whole", *gpu, nproc=1)
    ck = str(tmp_path / "ck")
    saved, loaded = tmp_path / "saved.pt", tmp_path / "loaded.pt"
    first = run(tmp_path, "first", *gpu, "--ckpt", ck, "--save-at", "4", "--dump-state", str(saved), nproc=1)
    second = run(tmp_path, "second", *gpu, "--ckpt", ck, "--resume", "--dump-state", str(loaded), nproc=1)
    assert second["start"] == 4
    assert first["losses"] == whole["losses"][:4]
    a, b = torch.load(saved), torch.load(loaded)
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys() and "master" in a["state"][i]
        for key in a["state"][i]:
            assert torch.equal(a["state"][i][key], b["state"][i][key]), (i, key)
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name
    assert second["losses"][0] == whole["losses"][4]  # the first step after the resume: same weights
    _close({**whole, "losses": whole["losses"][4:]}, second, tol=1e-3)


def test_the_job_under_torchrun_on_one_gpu(tmp_path):
    # `hytrain train --nproc 1`: torchrun, NCCL, FSDP2 at world size 1, the whole GPU path with k
    # chosen by the scheduler and agreed between the ranks; the same training as the plain job (bf16).
    from test_job_distributed import metrics, ok

    args = ["--steps", "30", "--eval-every", "0", "--batch-size", "8", "--seq-len", "64", "--no-progress",
            "--device", "cuda"]
    plain, ranked = tmp_path / "plain", tmp_path / "ranked"
    ok(*args, "--out", str(plain))
    ok(*args, "--out", str(ranked), "--nproc", "1", "--save-every", "15")
    a, b = metrics(plain), metrics(ranked)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]),
                               rtol=2e-2, atol=2e-2)
    assert all(len(r["k_ranks"]) == 1 and r["k_ranks"][0] == r["k"] for r in b)
    assert any(r["gpu_wait_frac_ranks"][0] is not None for r in b)  # measured once the warm-up is over
    again = tmp_path / "again"
    ok(*args, "--out", str(again), "--nproc", "1", "--resume", str(ranked / "checkpoints" / "step_00000015"))
    c = metrics(again)
    assert [r["step"] for r in c] == list(range(16, 31))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in c]), torch.tensor([r["loss"] for r in b[15:]]),
                               rtol=1e-3, atol=1e-3)
