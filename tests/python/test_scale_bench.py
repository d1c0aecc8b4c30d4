"""bench/scale_bench.py's harness on CPU ranks (gloo, no DeepSpeed): the tiny shape trains under hytrain
(fp32 and 8-bit states) and FSDP2 + CPUOffloadPolicy at 1 and 2 processes, one record each with every
rank's k and, for hytrain, the node-level floor from the host update rate measured in the same run
with 1 and 2 ranks at once; the summary's ratios are those of the records; a worker that fails is
reported with its exception; a worker's own flags given to the parent are refused."""

import json
import subprocess
import sys

import pytest
import torch

from test_capacity_bench import ROOT, _env

SCRIPT = ROOT / "bench" / "scale_bench.py"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def bench(*args):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--seq", "32", "--batch", "2",
                           "--warmup", "1", "--iters", "2", "--timeout", "200", *args],
                          capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]


def test_the_harness_on_cpu_ranks():
    lines = bench("--model", "tiny", "--nprocs", "1,2", "--modes",
                  "hytrain,hytrain_8bit,fsdp2_cpu_offload,fsdp2_cpu_offload_hybrid",
                  "--floor-params", "2000000", "--floor-passes", "2")
    rates = {r["host_update_rate"]["ranks"]: r["host_update_rate"] for r in lines if "host_update_rate" in r}
    assert set(rates) == {1, 2} and all(r["gparams_per_s"] > 0 for r in rates.values()), lines
    assert rates[1]["fp32_update_gbps"] == pytest.approx(28 * rates[1]["gparams_per_s"], rel=0.01)
    runs = {(r["mode"], r["nproc"]): r for r in lines if "mode" in r}
    modes = ("hytrain", "hytrain_8bit", "fsdp2_cpu_offload", "fsdp2_cpu_offload_hybrid")
    assert set(runs) == {(m, n) for m in modes for n in (1, 2)}, lines
    for (mode, n), r in runs.items():
        assert "error" not in r, r
        assert r["params"] == 791680 and r["iter_s"] > 0 and r["first_step_s"] > 0 and len(r["iter_times_s"]) == 2
        assert r["tokens_per_s_per_gpu"] == pytest.approx(2 * 32 / r["iter_s"])
        # what the job gets: the slowest rank's window, tokens over its whole time
        assert r["wall_tokens_per_s"] == pytest.approx(2 * 32 * 2 / r["window_s"])
        assert r["iter_s_max"] >= r["iter_s_p90"] >= r["iter_s_median"] > 0 and r["window_iterations"] == 2
        assert len(r["k"]) == n and r["peak_host_gb_per_rank"] > 0 and r["peak_gpu_gb"] is None
    assert runs[("hytrain", 2)]["k"] == [0, 0]  # CPU parameters: every block updated by the CPU workers
    for rank in runs[("hytrain", 2)]["per_rank_iterations"]:  # each rank's iterations from the first
        assert len(rank["iter_s"]) == len(rank["step_call_s"]) == len(rank["k"]) == len(rank["grad_norm"]) == 3
        assert rank["k"] == [0] * 3 and all(n > 0 for n in rank["grad_norm"])
        assert 0 < max(rank["step_call_s"]) <= max(rank["iter_s"]) and rank["iter_s"][1:] != [0, 0]
    assert "per_rank_iterations" not in runs[("fsdp2_cpu_offload", 2)]
    for fmt, mode in ((28, "hytrain"), (16, "hytrain_8bit")):
        for n in (1, 2):
            r = runs[(mode, n)]
            assert r["cpu_params"] == 791680  # every parameter, the ranks' shards together
            want = fmt * r["cpu_params"] / (rates[n]["fp32_update_gbps"] * 1e9)
            assert r["host_floor_s"] == pytest.approx(want, rel=1e-3, abs=1e-4)
            assert r["iter_over_host_floor"] == pytest.approx(r["iter_s"] / r["host_floor_s"], rel=1e-2)
    assert "host_floor_s" not in runs[("fsdp2_cpu_offload", 2)]
    summary = lines[-1]
    assert summary["summary"] and summary["model"] == "tiny"
    h1, h2, f2 = runs[("hytrain", 1)], runs[("hytrain", 2)], runs[("fsdp2_cpu_offload", 2)]
    assert summary["n2_hytrain_speedup_vs_fsdp2_cpu_offload"] == round(f2["iter_s"] / h2["iter_s"], 3)
    fh2 = runs[("fsdp2_cpu_offload_hybrid", 2)]
    assert summary["n2_hytrain_speedup_vs_fsdp2_cpu_offload_hybrid"] == round(fh2["iter_s"] / h2["iter_s"], 3)
    assert summary["n2_hytrain_scaling_efficiency"] == round(h2["tokens_per_s_per_gpu"] / h1["tokens_per_s_per_gpu"], 3)
    assert summary["n2_hytrain_8bit_iter_over_host_floor"] == runs[("hytrain_8bit", 2)]["iter_over_host_floor"]


def test_a_failing_worker_is_reported_with_its_exception():
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("scale_bench", SCRIPT)
    scale_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale_bench)
    torchrun = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File ...\n"
                "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
                "E1124 failed (exitcode: 1) local_rank: 0\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n  rank: 0 (local_rank: 0)\n")
    got = scale_bench.failure(types.SimpleNamespace(stderr=torchrun, stdout=""))
    assert got == "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert scale_bench.failure(types.SimpleNamespace(stderr="", stdout="killed")) == "killed"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "l7B"], capture_output=True, text=True, env=_env())
    assert proc.returncode == 2 and "--model 'l7B': one of" in proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPT), "--modes", "hytrain,fsdp"], capture_output=True, text=True,
                          env=_env())
    assert proc.returncode == 2 and "--modes: fsdp unknown; the modes are deepspeed_offload," in proc.stderr
    # A worker's flag given to the parent: refused (it used to be accepted and the run went uncapped).
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cap-gb", "19.6"], capture_output=True, text=True, env=_env())
    assert proc.returncode == 2 and "--cap-gb: a worker's own flag(s), not this command's" in proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cap", "-3"], capture_output=True, text=True, env=_env())
    assert proc.returncode == 2 and "--cap '-3': a number of GB must be positive" in proc.stderr


def test_meta_init_shards_before_anything_is_allocated():
    # --meta-init (the 32b and 50b shapes: a whole model that does not fit one GPU): built on the meta
    # device, sharded, each rank's shards allocated and initialised in place; it trains as before.
    lines = bench("--model", "tiny", "--nprocs", "2", "--modes", "hytrain_8bit", "--meta-init",
                  "--floor-params", "2000000", "--floor-passes", "1")
    runs = [r for r in lines if r.get("mode") == "hytrain_8bit"]
    assert len(runs) == 1 and "error" not in runs[0], lines
    assert runs[0]["params"] == 791680 and runs[0]["iter_s"] > 0 and runs[0]["k"] == [0, 0]
