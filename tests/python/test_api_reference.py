"""The API reference is generated from the docstrings (pdoc) of the public modules -- `hytrain`
(HybridAdamW, the pool, the kernels), `hytrain.integrations` (Trainer, accelerate, Lightning) and
`hytrain.models` -- and `hytrain_native` (whose first lines say where the optimizer is), and must build:
`python -m pdoc hytrain hytrain.integrations hytrain.models hytrain_native -o DIR`."""

import subprocess
import sys

import pytest

pytest.importorskip("pdoc")

MODULES = ("hytrain", "hytrain.integrations", "hytrain.models", "hytrain_native")


def test_the_api_reference_builds_from_the_docstrings(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pdoc", *MODULES, "-o", str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    page = (tmp_path / "hytrain.html").read_text()
    for name in ("HybridAdamW", "PinnedPool", "CapacityError", "state_dict", "set_gpu_blocks"):
        assert name in page, name
    import hytrain

    assert hytrain.HybridAdamW.__doc__.split("\n")[0].strip()[:40] in page  # the docstring itself, not a stub
    assert (tmp_path / "hytrain" / "integrations.html").is_file() and (tmp_path / "hytrain" / "models.html").is_file()
    native = (tmp_path / "hytrain_native.html").read_text()
    assert "hytrain_native.HybridAdamW" in native and "torch.optim.AdamW" in native
