"""HybridAdamW on FSDP2-sharded models across processes (torchrun, gloo, on the CPU): each rank
updates its own shards, and training matches one process on the same global batch -- losses, grad
norms and weights, within reduction-order tolerance -- with the optimizer's clipping, with the loop's
clipping routed to the optimizer, and without clipping; on 2 and 4 processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "dist_train.py"

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _env():
    env = dict(os.environ)
    src = str(HERE.parent.parent / "python")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "") if (Path(src) / "hytrain").is_dir() else \
        env.get("PYTHONPATH", "")
    return env


def run(tmp_path, name, *args, nproc=None, timeout=240):
    out = tmp_path / f"{name}.json"
    if nproc is None:
        cmd = [sys.executable, str(SCRIPT), "--plain"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(SCRIPT)]
    proc = subprocess.run(cmd + ["--out", str(out), *args], capture_output=True, text=True, timeout=timeout,
                          env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def assert_same_training(a, b, tol=1e-4):
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=tol, atol=tol)
    assert len(a["norms"]) == len(b["norms"])
    torch.testing.assert_close(torch.tensor(a["norms"]), torch.tensor(b["norms"]), rtol=tol, atol=tol)
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        torch.testing.assert_close(torch.tensor(a["weights"][name]), torch.tensor(b["weights"][name]),
                                   rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("nproc", [2, 4])
def test_sharded_training_matches_one_process_with_clipping(tmp_path, nproc):
    ref = run(tmp_path, "plain", "--clip", "0.5")
    got = run(tmp_path, f"sharded{nproc}", "--clip", "0.5", nproc=nproc)
    assert got["world"] == nproc
    assert len(ref["norms"]) == 6 and max(ref["norms"]) > 0.5  # the global norm clipped, every step
    assert_same_training(ref, got)


def test_routed_clipping_across_ranks(tmp_path):
    ref = run(tmp_path, "plain", "--routed-clip", "0.5")
    got = run(tmp_path, "sharded", "--routed-clip", "0.5", nproc=2)
    assert_same_training(ref, got)


def test_without_clipping(tmp_path):
    ref = run(tmp_path, "plain")
    got = run(tmp_path, "sharded", nproc=2)
    assert got["norms"] == [] and ref["norms"] == []
    assert_same_training(ref, got)
