"""reads.py: a safetensors file's tensors read straight into tensors that already exist, checked
element by element against safetensors' own reader on fresh random tensors -- the same dtype (read by
the kernel into the destination), cast (fp32 in the file, bf16 wanted), in pieces smaller than a
tensor, on several threads -- and the damaged files and wrong destinations refused in one line."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from hytrain.job import reads
from hytrain.job.options import ConfigError


@pytest.fixture
def saved(tmp_path):
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    tensors = {
        "a": torch.randn(37, 19, generator=g).to(torch.bfloat16),
        "b": torch.randn(1000, generator=g),
        "c": torch.randint(-100, 100, (5, 3), generator=g, dtype=torch.int64),
        "d": torch.randn((), generator=g).to(torch.float16),
        "e": torch.empty(0, 4),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"step": "3"})
    return path, load_file(str(path))


@pytest.mark.parametrize("piece", [reads.PIECE_BYTES, 7, 256])
@pytest.mark.parametrize("threads", [1, 3])
def test_read_into_equals_safetensors(saved, monkeypatch, piece, threads):
    monkeypatch.setattr(reads, "PIECE_BYTES", piece)
    path, want = saved
    dests = {n: torch.full_like(t, 7) for n, t in want.items()}
    got = reads.read_into(path, dests, threads=threads)
    assert got == sum(t.numel() * t.element_size() for t in want.values())
    for n, t in want.items():
        assert dests[n].dtype == t.dtype and torch.equal(dests[n], t), n


def test_a_floating_tensor_is_cast_into_its_destination(saved, monkeypatch):
    monkeypatch.setattr(reads, "PIECE_BYTES", 64)  # cast piece by piece through a small buffer
    path, want = saved
    dests = {"b": torch.zeros(1000, dtype=torch.bfloat16), "a": torch.zeros(37, 19, dtype=torch.float32)}
    reads.read_into(path, dests, threads=2)
    assert torch.equal(dests["b"], want["b"].to(torch.bfloat16))
    assert torch.equal(dests["a"], want["a"].float())


def test_the_header_describes_every_tensor(saved):
    path, want = saved
    start, entries = reads.header(path)
    assert set(entries) == set(want) and start > 8
    for n, (dtype, shape, begin, end) in entries.items():
        assert dtype == want[n].dtype and shape == list(want[n].shape)
        assert end - begin == want[n].numel() * want[n].element_size()


def test_wrong_destinations_are_refused_before_anything_is_read(saved):
    path, want = saved
    keep = torch.full((37, 19), 5, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"tensor b has shape \[1000\], the model needs \[999\]"):
        reads.read_into(path, {"a": keep, "b": torch.zeros(999)})
    assert torch.all(keep == 5)
    with pytest.raises(ConfigError, match="has no tensor zz"):
        reads.read_into(path, {"zz": torch.zeros(1)})
    with pytest.raises(ConfigError, match="tensor c is torch.int64, the model's is torch.float32"):
        reads.read_into(path, {"c": torch.zeros(5, 3)})
    with pytest.raises(ValueError, match="destination of a is not contiguous"):
        reads.read_into(path, {"a": torch.zeros(19, 37, dtype=torch.bfloat16).t()})


@pytest.mark.parametrize("damage", ["truncated", "header", "short"])
def test_damaged_files_are_one_line(saved, tmp_path, damage):
    path, _ = saved
    raw = path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    if damage == "truncated":  # the data section cut short: the header's offsets run past the end
        bad.write_bytes(raw[:-100])
    elif damage == "header":
        bad.write_bytes(raw[:8] + b"!" + raw[9:])  # not JSON
    else:
        bad.write_bytes(raw[:5])
    with pytest.raises(ConfigError, match=r"bad.safetensors cannot be read \(truncated or damaged\?\)"):
        reads.read_into(bad, {"b": torch.zeros(1000)})


def test_read_placed_reads_a_tied_tensor_once(tmp_path):
    w = torch.randn(6, 4)
    save_file({"x.weight": w, "y.weight": w.clone()}, str(tmp_path / "m.safetensors"))
    p = torch.nn.Parameter(torch.zeros(6, 4))
    asked = []
    n = reads.read_placed({"x.weight": tmp_path / "m.safetensors", "y.weight": tmp_path / "m.safetensors"},
                          {"x.weight": p, "y.weight": p}, lambda t: asked.append(t) or t.data)
    assert len(asked) == 1 and n == w.numel() * 4 and torch.equal(p.data, w)
