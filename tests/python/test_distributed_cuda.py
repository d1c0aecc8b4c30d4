"""HybridAdamW on an FSDP2-sharded model on GPUs (torchrun, NCCL): at world size 1 and, where the
machine has them, on 2 and 4 GPUs, through the whole GPU path -- bf16 weights, the offload pipeline,
k chosen by the scheduler and agreed by the ranks, speculation under clipping -- against the
unsharded optimizer on one GPU; sharded checkpoints whose state reads back bit for bit (fp32 and
8-bit states) and resume at another world size; fp16 with ShardedGradScaler; the job under
`hytrain train --nproc N`."""

import pytest
import torch

from test_distributed import run

# Each case's processes have limits of their own (240-300 s); this bounds a case as a whole.
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def ranks(*counts):
    """World sizes as parameters; those above the GPUs this machine has are skipped."""
    return [pytest.param(n, id=f"{n}gpu", marks=pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs"))
            for n in counts]


def _close(a, b, tol=2e-2):
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=tol, atol=tol)
    for name in a["weights"]:
        torch.testing.assert_close(torch.tensor(a["weights"][name]), torch.tensor(b["weights"][name]),
                                   rtol=tol, atol=tol, msg=name)


GPU = ["--device", "cuda", "--dtype", "bfloat16", "--steps", "8"]


@pytest.mark.parametrize("nproc", ranks(1, 2, 4))
@pytest.mark.parametrize("clip", [[], ["--clip", "0.5"], ["--routed-clip", "0.5"]], ids=["noclip", "clip", "routed"])
def test_fsdp2_on_gpus_matches_the_unsharded_optimizer(tmp_path, clip, nproc):
    ref = run(tmp_path, "plain", *GPU, *clip)
    got = run(tmp_path, "sharded", *GPU, *clip, nproc=nproc)
    assert got["world"] == nproc
    _close(ref, got)
    if clip:
        torch.testing.assert_close(torch.tensor(ref["norms"]), torch.tensor(got["norms"]), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("nproc", ranks(1, 2))
def test_fsdp2_cpu_offload_policy_with_hybrid_adamw(tmp_path, nproc):
    # FSDP2's own offload: fp32 shards and their fp32 gradients in pinned host memory, bf16 compute
    # (MixedPrecisionPolicy), HybridAdamW updating the shards in place at step() on a CUDA mesh whose
    # process group is NCCL alone (the norm is reduced through the GPU). Against the unsharded
    # optimizer on one GPU with bf16 weights and fp32 masters: the same training within bf16's rounding.
    ref = run(tmp_path, "plain", *GPU, "--clip", "0.5")
    got = run(tmp_path, "offloaded", "--device", "cuda", "--dtype", "float32", "--steps", "8", "--clip", "0.5",
              "--cpu-offload", nproc=nproc)
    assert got["world"] == nproc
    _close(ref, got)
    torch.testing.assert_close(torch.tensor(ref["norms"]), torch.tensor(got["norms"]), rtol=2e-2, atol=2e-2)


def _states(path, world):
    return [torch.load(path if world == 1 else f"{path}.{r}") for r in range(world)]


@pytest.mark.parametrize("nproc", ranks(1, 2))
@pytest.mark.parametrize("fmt", [[], ["--state-format", "8bit", "--hidden", "256"]], ids=["fp32", "8bit"])
def test_fsdp2_checkpoint_resume_on_gpus(tmp_path, fmt, nproc):
    # The optimizer's shards are host buffers while the mesh is a CUDA mesh: the load must fill the
    # buffers themselves (not a GPU copy of them), so the state read back equals the state saved, bit
    # for bit, on every rank, and the resumed run follows the uninterrupted one. With 8-bit states too
    # (codes and scales in place, in host buffers and in GPU-resident blocks' buffers).
    gpu = [*GPU, "--clip", "0.5", *fmt]
    whole = run(tmp_path, "whole", *gpu, nproc=nproc)
    ck = str(tmp_path / "ck")
    saved, loaded = tmp_path / "saved.pt", tmp_path / "loaded.pt"
    first = run(tmp_path, "first", *gpu, "--ckpt", ck, "--save-at", "4", "--dump-state", str(saved), nproc=nproc)
    second = run(tmp_path, "second", *gpu, "--ckpt", ck, "--resume", "--dump-state", str(loaded), nproc=nproc)
    assert second["start"] == 4
    assert first["losses"] == whole["losses"][:4]
    for a, b in zip(_states(saved, nproc), _states(loaded, nproc)):
        assert a["state"].keys() == b["state"].keys()
        for i in a["state"]:
            assert a["state"][i].keys() == b["state"][i].keys() and "master" in a["state"][i]
            for key in a["state"][i]:
                assert torch.equal(a["state"][i][key], b["state"][i][key]), (i, key)
        for name in a["weights"]:
            assert torch.equal(a["weights"][name], b["weights"][name]), name
    assert second["losses"][0] == whole["losses"][4]  # the first step after the resume: same weights
    _close({**whole, "losses": whole["losses"][4:]}, second, tol=1e-3)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("fmt", [[], ["--state-format", "8bit", "--hidden", "256"]], ids=["fp32", "8bit"])
def test_fsdp2_checkpoint_at_another_world_size_on_gpus(tmp_path, fmt):
    # 2 GPUs save at step 4; one GPU (world size 1) resumes; 2 GPUs resume a 1-GPU checkpoint.
    gpu = [*GPU, "--clip", "0.5", *fmt]
    whole = run(tmp_path, "whole", *gpu, nproc=2)
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    run(tmp_path, "a", *gpu, "--ckpt", two, "--save-at", "4", nproc=2)
    b = run(tmp_path, "b", *gpu, "--ckpt", two, "--resume", nproc=1)
    assert b["start"] == 4 and b["world"] == 1
    _close({**whole, "losses": whole["losses"][4:]}, b)
    run(tmp_path, "c", *gpu, "--ckpt", one, "--save-at", "4", nproc=1)
    d = run(tmp_path, "d", *gpu, "--ckpt", one, "--resume", nproc=2)
    assert d["start"] == 4 and d["world"] == 2
    _close({**whole, "losses": whole["losses"][4:]}, d)


@pytest.mark.parametrize("nproc", ranks(2))
def test_fp16_loss_scaling_on_gpus(tmp_path, nproc):
    # fp16 weights on the GPUs, ShardedGradScaler (unscale_ before step) against GradScaler handing
    # its scale to HybridAdamW in one process: without overflows the same training; with a scale far
    # too large, skipped steps and a scale that backs off.
    args = ["--device", "cuda", "--dtype", "float16", "--scaler", "256", "--steps", "6"]
    ref = run(tmp_path, "plain16", *args)
    got = run(tmp_path, "sharded16", *args, nproc=nproc)
    assert ref["scales"] == got["scales"] == [256.0] * 6
    _close(ref, got)
    hot = run(tmp_path, "hot16", "--device", "cuda", "--dtype", "float16", "--scaler", "1e6", "--steps", "6",
              nproc=nproc)
    assert hot["scales"][-1] < 1e6 and all(x == x for x in hot["losses"])


@pytest.mark.parametrize("nproc", ranks(1, 2))
def test_the_job_under_torchrun_on_gpus(tmp_path, nproc):
    # `hytrain train --nproc N`: torchrun, NCCL, FSDP2, the whole GPU path with k chosen by the
    # scheduler and agreed between the ranks; the same training as the plain job (bf16).
    from test_job_distributed import metrics, ok

    args = ["--steps", "30", "--eval-every", "0", "--batch-size", "8", "--seq-len", "64", "--no-progress",
            "--device", "cuda"]
    plain, ranked = tmp_path / "plain", tmp_path / "ranked"
    ok(*args, "--out", str(plain))
    ok(*args, "--out", str(ranked), "--nproc", str(nproc), "--save-every", "15")
    a, b = metrics(plain), metrics(ranked)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]),
                               rtol=2e-2, atol=2e-2)
    assert all(len(r["k_ranks"]) == nproc and len(set(r["k_ranks"])) == 1 and r["k_ranks"][0] == r["k"] for r in b)
    assert any(r["gpu_wait_frac_ranks"][0] is not None for r in b)  # measured once the warm-up is over
    again = tmp_path / "again"
    ok(*args, "--out", str(again), "--nproc", str(nproc), "--resume", str(ranked / "checkpoints" / "step_00000015"))
    c = metrics(again)
    assert [r["step"] for r in c] == list(range(16, 31))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in c]), torch.tensor([r["loss"] for r in b[15:]]),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(300)
def test_two_agents_on_two_gpus_restart_a_killed_worker(tmp_path):
    # Two torchrun agents as two nodes of one GPU each (CUDA_VISIBLE_DEVICES: their workers are both
    # local rank 0), NCCL across them; a worker killed mid-run: the restart resumes from the last checkpoint.
    # The other worker waits in its NCCL collective until its agent stops it for the membership change,
    # so only one agent counts a restart: the group must meet again anyway, at the first try.
    from test_job_distributed import two_agents_one_worker_killed

    args = ["--batch-size", "8", "--seq-len", "64", "--no-progress", "--device", "cuda"]
    gpus = ({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"})
    two_agents_one_worker_killed(tmp_path, args, steps=300, save_every=25, envs=gpus)
