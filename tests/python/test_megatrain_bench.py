"""bench/megatrain_bench.py without a GPU or MegaTrain: every way a run can end short of training is one
RESULT line saying why (not installed, another `infinity` module, no CUDA, a timeout, a killed child),
bad arguments are refused before anything runs, the model is capacity_bench's shape as MegaTrain needs
it, and the installed archive is named in the record."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SCRIPT = ROOT / "bench" / "megatrain_bench.py"
sys.path.insert(0, str(ROOT / "bench"))

import megatrain_bench  # noqa: E402


def stub(tmp_path, body):
    """A package named `infinity` (MegaTrain's) holding `body`, to stand in for an installation."""
    pkg = tmp_path / "stub" / "infinity"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    return str(tmp_path / "stub")


def bench(*args, path=None, timeout=120):
    env = dict(os.environ)
    parts = [p for p in (path, str(ROOT / "python"), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return proc, [json.loads(ln[len("RESULT "):]) for ln in results]


def only_record(proc, records):
    assert len(records) == 1 and proc.stdout.strip().splitlines()[-1].startswith("RESULT "), \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = records
    assert rec["system"] == "megatrain" and rec["trains"] is False and rec["params"] is None, rec
    assert proc.returncode == 1, rec
    return rec


@pytest.mark.skipif(importlib.util.find_spec("infinity") is not None, reason="an `infinity` module is installed")
def test_not_installed():
    proc, records = bench("--size", "7b", "--batch", "16")
    rec = only_record(proc, records)
    assert rec["failure"] == "not_installed" and rec["stage"] == "setup", rec
    assert rec["reason"] == "megatrain not installed (no module named 'infinity')", rec
    assert rec["size"] == "7b" and rec["batch"] == 16 and rec["seq"] == 1024 and rec["tokens"] == 16 * 1024, rec
    assert rec["expected_params"] == 6738415616, rec  # the Llama-2-7B shape
    assert "Traceback" not in proc.stderr, proc.stderr  # an expected absence is no crash


def test_another_infinity_module_is_not_megatrain(tmp_path):
    proc, records = bench("--size", "tiny", path=stub(tmp_path, "x = 1\n"))
    rec = only_record(proc, records)
    assert rec["failure"] == "not_installed", rec
    assert "without CPUMasterModel" in rec["reason"] and "stub" in rec["reason"], rec


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_no_cuda(tmp_path):
    path = stub(tmp_path, "__version__ = '0.0-stub'\nclass CPUMasterModel: pass\nclass CPUMasterConfig: pass\n")
    proc, records = bench("--size", "tiny", "--batch", "2", "--seq", "64", path=path)
    rec = only_record(proc, records)
    assert rec["failure"] == "no_cuda" and rec["stage"] == "setup", rec
    assert rec["reason"].startswith("CUDA not available"), rec
    assert rec["infinity_version"] == "0.0-stub" and rec["cuda_pipeline"] is False, rec
    assert rec["peak_gpu_reserved_gb"] is None and rec["peak_host_gb"] > 0, rec


def test_a_timeout_is_a_record(tmp_path):
    path = stub(tmp_path, "import time\ntime.sleep(60)\n")
    proc, records = bench("--size", "tiny", "--timeout", "2", path=path)
    rec = only_record(proc, records)
    assert rec["failure"] == "timeout" and rec["reason"] == "timed out after 2 s", rec
    assert rec["wall_s"] < 30, rec


def test_a_killed_child_is_a_record(tmp_path):
    path = stub(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    proc, records = bench("--size", "tiny", path=path)
    rec = only_record(proc, records)
    assert rec["failure"] == "killed" and "SIGKILL" in rec["reason"], rec


@pytest.mark.parametrize("args, message", [
    (["--size", "7b", "--batch", "0"], "--batch must be >= 1"),
    (["--size", "7b", "--seq", "1"], "--seq must be >= 2"),
    (["--size", "7b", "--iters", "0"], "--iters must be >= 1"),
    (["--size", "7b", "--warmup", "-1"], "--warmup must be >= 0"),
    (["--size", "7b", "--checkpoint-interval", "0"], "--checkpoint-interval must be >= 1"),
    (["--size", "9b"], "invalid choice: '9b'"),
    (["--size", "7b", "--mask", "2d"], "invalid choice: '2d'"),
    (["--batch", "4"], "the following arguments are required: --size"),
])
def test_bad_arguments_are_refused(args, message):
    proc, records = bench(*args)
    assert proc.returncode == 2 and not records, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr


def test_the_model_is_capacity_benchs_shape_as_megatrain_takes_it():
    model = megatrain_bench.build_llama("tiny", 64)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == megatrain_bench.capacity_bench.expected_params("tiny")
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in params)
    assert model.config._attn_implementation == "sdpa" and model.config.use_cache is False
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5
    assert not (model.is_gradient_checkpointing if checkpointing is None else checkpointing)  # MegaTrain's own
    assert torch.isfinite(torch.stack([p.float().std() for p in params if p.dim() == 2])).all()
    assert megatrain_bench.NoMask().to("cuda") is None  # what every layer sees: sdpa then runs causal


def test_the_installed_archive_is_named(tmp_path, monkeypatch):
    info = tmp_path / "megatrain-0.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatrain\nVersion: 0.2.0\n")
    (info / "direct_url.json").write_text(json.dumps(
        {"url": "file:///x/.whl/megatrain-919520f.tar.gz", "archive_info": {"hashes": {"sha256": "ab12"}}}))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert megatrain_bench.megatrain_provenance() == {
        "megatrain_version": "0.2.0", "megatrain_source": "megatrain-919520f.tar.gz", "megatrain_commit": "919520f",
        "megatrain_sha256": "ab12"}
