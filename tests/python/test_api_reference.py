"""The API reference is generated from the docstrings (pdoc) of the public modules -- `hytrain`
(HybridAdamW, the pool, the kernels, the errors), `hytrain.integrations` (Trainer, accelerate,
Lightning) and `hytrain.models` -- and `hytrain_native` (whose first lines say where the optimizer is),
and must build: `python -m pdoc hytrain hytrain.integrations hytrain.models hytrain_native -o DIR`.
Every public name has an entry with its own docstring: the errors, HybridTrainer (made when first
asked for), and HybridAdamW's step and zero_grad (not torch's generic text)."""

import html
import inspect
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("pdoc")

MODULES = ("hytrain", "hytrain.integrations", "hytrain.models", "hytrain_native")


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    proc = subprocess.run([sys.executable, "-m", "pdoc", *MODULES, "-o", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "does not resolve" not in proc.stderr, proc.stderr[-4000:]  # a name of __all__ without an entry
    return out


def _squash(text: str) -> str:
    """Text without reST markup or whitespace, to compare a docstring with its rendering."""
    return re.sub(r"\s+", "", re.sub(r":[a-z]+:`~?([^`]*)`", r"\1", text).replace("`", ""))


def _first_line(doc: str) -> str:
    return _squash(inspect.cleandoc(doc).splitlines()[0])


def _rendered(page: str, ident: str) -> str:
    """The rendered docstring of the entry ``ident`` of a pdoc page ('' where it has none)."""
    start = page.index(f' id="{ident}"')
    ends = [k for k in (page.find('<section id="', start + 1), page.find('<div id="', start + 1)) if k > 0]
    entry = page[start:min(ends) if ends else None]
    at = entry.find('<div class="docstring">')
    if at < 0:
        return ""
    body = entry[at:entry.index("</div>", at)]
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def test_the_api_reference_builds_from_the_docstrings(pages):
    page = (pages / "hytrain.html").read_text()
    for name in ("HybridAdamW", "PinnedPool", "CapacityError", "state_dict", "set_gpu_blocks"):
        assert name in page, name
    import hytrain

    assert hytrain.HybridAdamW.__doc__.split("\n")[0].strip()[:40] in page  # the docstring itself, not a stub
    assert (pages / "hytrain" / "integrations.html").is_file() and (pages / "hytrain" / "models.html").is_file()
    native = (pages / "hytrain_native.html").read_text()
    assert "hytrain_native.HybridAdamW" in native and "torch.optim.AdamW" in native


def test_the_errors_have_entries_with_their_docstrings(pages):
    import hytrain
    import hytrain_native
    from hytrain.checkpoint import CheckpointError

    assert hytrain.CheckpointError is CheckpointError and hytrain_native.CheckpointError is CheckpointError
    page = (pages / "hytrain.html").read_text()
    native = (pages / "hytrain_native.html").read_text()
    for name in ("CapacityError", "CheckpointError", "PoolExhaustedError", "DeviceTimeoutError"):
        assert name in hytrain.__all__, name
        doc = getattr(hytrain, name).__doc__
        assert doc and len(doc) > 200, name  # written for it, not a one-liner or pybind11's nothing
        assert _squash(_rendered(page, name)).startswith(_first_line(doc)), name
    for name in ("PoolExhaustedError", "DeviceTimeoutError"):  # the native classes: the same text on both pages
        assert _squash(_rendered(native, name)) == _squash(_rendered(page, name)) == _squash(getattr(hytrain, name).__doc__)


def test_step_zero_grad_and_fence_are_documented(pages):
    from hytrain import HybridAdamW

    page = (pages / "hytrain.html").read_text()
    for method in ("step", "zero_grad"):
        own, torchs = getattr(HybridAdamW, method).__doc__, getattr(torch.optim.Optimizer, method).__doc__
        assert own and own != torchs, method
        rendered = _squash(_rendered(page, f"HybridAdamW.{method}"))
        assert rendered.startswith(_first_line(own)), method
        assert _first_line(torchs) not in rendered, method
    cls = _squash(_rendered(page, "HybridAdamW"))
    fence = HybridAdamW.__doc__[HybridAdamW.__doc__.index("fence:"):]
    assert _first_line(fence) in cls and _squash("TorchFunctionMode") in cls
    assert "fence" in inspect.signature(HybridAdamW).parameters


def test_hybrid_trainer_has_an_entry(pages):
    """HybridTrainer is made at first use (it subclasses transformers' Trainer): the reference, which
    imports transformers, lists it under its own name, its members' anchors under it."""
    pytest.importorskip("transformers")
    import hytrain.integrations as integrations

    page = (pages / "hytrain" / "integrations.html").read_text()
    assert "HybridTrainer" in integrations.__all__
    assert integrations.HybridTrainer.__qualname__ == "HybridTrainer"
    assert _squash(_rendered(page, "HybridTrainer")).startswith(_first_line(integrations.HybridTrainer.__doc__))
    assert 'href="#HybridTrainer"' in page and 'id="HybridTrainer.create_optimizer"' in page
    assert "&lt;locals&gt;" not in page and "<locals>" not in page  # (anchors that led nowhere)
