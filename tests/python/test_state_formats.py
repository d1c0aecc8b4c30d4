"""The optimizer-state formats are described once (hytrain.state_formats) and everything reads that
table: the buffers HybridAdamW makes, the job's --state-format, `hytrain info`, the checks, and the
table in docs/architecture.md."""

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hytrain
from hytrain import _checks, state_formats
from hytrain.state_formats import FORMATS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_buffers_are_what_the_format_says(name):
    fmt = state_formats.get(name)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 700)), nn.Parameter(torch.randn(5))]
    opt = hytrain.HybridAdamW(params, lr=1e-3, state_format=name, workers=1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            buf = opt.state[p][key]
            assert buf.dtype == fmt.dtype and tuple(buf.shape) == fmt.moment_shape(p.shape), (name, key)
            assert buf.numel() * buf.element_size() == fmt.moment_bytes(p.numel())
            assert buf.numel() == _checks.state_numel(fmt.dtype, p.numel())
    assert opt._settings.format is fmt and opt.state_format == name
    assert _checks.STATE_CODES[fmt.dtype] == fmt.code and state_formats.of_dtype(fmt.dtype) is fmt
    with pytest.raises(ValueError, match="amsgrad") if not fmt.amsgrad else contextlib.nullcontext():
        hytrain.HybridAdamW([nn.Parameter(torch.zeros(4))], amsgrad=True, state_format=name)


def test_an_unknown_format_names_the_known_ones():
    with pytest.raises(ValueError, match="state_format must be one of 'fp32', 'bf16', '8bit'; got 'fp8'"):
        hytrain.HybridAdamW([nn.Parameter(torch.zeros(4))], state_format="fp8")
    assert state_formats.of_dtype(torch.float16) is None


def test_the_job_and_info_read_the_table():
    import argparse

    from hytrain.job.options import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    train = next(a for a in parser._actions if "--state-format" in a.option_strings)
    assert tuple(train.choices) == state_formats.NAMES
    for f in FORMATS.values():
        assert f"{f.name}: {f.summary}" in train.help
    out = subprocess.run([sys.executable, "-m", "hytrain", "info", "--no-measure", "--json"], capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(ROOT / "python"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)["state_formats"]
    assert info == {f.name: round(4 + f.bytes_per_parameter(), 2) for f in FORMATS.values()}


def test_the_architecture_table_is_the_registry():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("### State formats (python/hytrain/state_formats.py)"):]
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([0-9.]+) \| (yes|no) \| ([^|]+) \|$", section, re.M)
    assert [r[0] for r in rows] == list(FORMATS)
    for name, nbytes, amsgrad, spec in rows:
        f = FORMATS[name]
        assert float(nbytes) == pytest.approx(4 + f.bytes_per_parameter(), abs=0.005), name
        assert (amsgrad == "yes") == f.amsgrad
        assert ("undo records" in spec) == f.undo_records
