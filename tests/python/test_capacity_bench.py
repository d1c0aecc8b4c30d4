"""bench/capacity_bench.py on the CPU: the tiny shape trains under hytrain and FSDP2 (CPU offload, gloo,
world size 1, meta-device build materialised on the CPU), the SUMMARY line names the largest sizes, and
a child that fails is reported as not training, with a reason, and the larger sizes are not tried."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SCRIPT = ROOT / "bench" / "capacity_bench.py"

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _env():
    env = dict(os.environ)
    src = str(ROOT / "python")
    if (Path(src) / "hytrain").is_dir():
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def bench(*args, timeout=300):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], capture_output=True,
                          text=True, timeout=timeout, env=_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    lines = proc.stdout.splitlines()
    records = [json.loads(ln) for ln in lines if ln.startswith("{") and "system" in json.loads(ln)]
    summaries = [ln for ln in lines if ln.startswith("SUMMARY ")]
    assert len(summaries) == 1 and lines[-1] == summaries[0], proc.stdout[-4000:]
    return records, json.loads(summaries[0][len("SUMMARY "):]), proc.stdout


def test_tiny_trains_under_hytrain_and_fsdp2():
    records, summary, out = bench("--sizes", "tiny", "--systems", "hytrain,fsdp2_offload", "--warmup", "1",
                                  "--iters", "1", "--timeout", "120")
    by_system = {r["system"]: r for r in records}
    assert set(by_system) == {"hytrain", "fsdp2_offload"}, out
    for system, r in by_system.items():
        assert r["trains"] is True, r
        assert r["size"] == "tiny" and r["params"] == r["expected_params"] > 0, r
        assert math.isfinite(r["iter_s"]) and r["iter_s"] > 0, r
        assert r["iter_s_median"] == r["iter_s"] and r["window_iterations"] == 1, r
        assert r["wall_tokens_per_s"] == pytest.approx(4 * 1024 / r["window_s"]), r
        assert r["first_step_s"] > 0 and r["build_s"] >= 0 and r["peak_host_gb"] > 0, r
        assert r["finite_loss"] and math.isfinite(r["loss_last"]), r  # FSDP2's CPU initialisation is sane
        assert r["peak_gpu_reserved_gb"] is None and r["peak_gpu_allocated_gb"] is None, r
    assert by_system["hytrain"]["k"] == 0  # CPU parameters: every block updated by the CPU workers
    assert summary["largest"]["hytrain"] == "tiny" and summary["largest"]["fsdp2_offload"] == "tiny"
    assert summary["largest_params"]["hytrain"] == by_system["hytrain"]["params"]
    assert summary["hytrain_params_vs"] == {"fsdp2_offload": 1.0}
    assert summary["machine"]["cpu_count"] >= 1 and summary["machine"]["host_memory_gb"] > 0
    assert summary["systems"]["hytrain"]["ceiling_found"] is False


@pytest.mark.parametrize("kind, failure, reason", [("memory", "host_memory", "MemoryError: injected"),
                                                   ("kill", "killed", "SIGKILL")])
def test_a_failing_child_is_reported_and_larger_sizes_not_tried(kind, failure, reason):
    records, summary, out = bench("--sizes", "3b,tiny", "--systems", "hytrain", "--own-model",
                                  "--inject-failure", kind, "--timeout", "120")
    assert [r["size"] for r in records] == ["tiny", "3b"], out  # in increasing order
    tiny, big = records
    assert tiny["trains"] is False and tiny["failure"] == failure and reason in tiny["reason"], tiny
    assert tiny["stage"] == "optimizer" and tiny["params"] == tiny["expected_params"], tiny
    assert big["trains"] is None and big["skipped"] == "not tried: failed at tiny", big
    assert summary["largest"]["hytrain"] is None
    assert summary["systems"]["hytrain"]["first_failure"]["size"] == "tiny"


def test_tiny_trains_streamed():
    records, summary, out = bench("--sizes", "tiny", "--systems", "hytrain_stream", "--stream", "all",
                                  "--warmup", "1", "--iters", "1", "--timeout", "120")
    (r,) = records
    assert r["trains"] is True and r["finite_loss"], r
    assert r["streamed_layers"] == 2 and r["window_host_gb"] > 0, r
    assert r["window_stats"]["loads"] > 0, r
    assert summary["largest"]["hytrain_stream"] == "tiny"


def test_deepspeed_systems_are_skipped_on_the_cpu():
    records, summary, out = bench("--sizes", "tiny", "--systems", "deepspeed_offload,deepspeed_zero3_offload")
    assert [(r["system"], r["size"], r["trains"], r["skipped"]) for r in records] == [
        ("deepspeed_offload", None, None, "needs CUDA"), ("deepspeed_zero3_offload", None, None, "needs CUDA")], out
    assert summary["largest"] == {"deepspeed_offload": None, "deepspeed_zero3_offload": None}
    assert summary["systems"]["deepspeed_zero3_offload"]["skipped"] == "needs CUDA"


def test_zero3_configuration_offloads_parameters_and_optimizer():
    sys.path.insert(0, str(ROOT / "bench"))
    import capacity_bench
    import train_bench

    cfg = capacity_bench.zero3_offload_config(16)
    zero = cfg.pop("zero_optimization")
    assert zero["stage"] == 3
    assert zero["offload_param"] == zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    base = train_bench.deepspeed_config(16)
    base.pop("zero_optimization")
    assert cfg == base  # bf16, clipping, AdamW and the micro-batch as train_bench's ZeRO-Offload run


def test_micro_batches_accumulate_to_the_whole_batch():
    # --micro-batch 2 of --batch 4: two forwards and backwards a step, the mean loss of the halves
    # (the whole batch's), the same tokens a step.
    common = ("--sizes", "tiny", "--systems", "hytrain", "--warmup", "0", "--iters", "1", "--timeout", "120",
              "--batch", "4", "--seq", "64")
    whole, _, _ = bench(*common)
    split, _, _ = bench(*common, "--micro-batch", "2")
    assert (whole[0]["micro_batch"], split[0]["micro_batch"]) == (4, 2)
    assert split[0]["tokens"] == whole[0]["tokens"] == 4 * 64
    assert split[0]["loss_first"] == pytest.approx(whole[0]["loss_first"], rel=1e-5)
    assert split[0]["loss_last"] == pytest.approx(whole[0]["loss_last"], rel=1e-3)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *common, "--micro-batch", "3"],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2 and "--micro-batch must divide --batch (4), got 3" in proc.stderr
