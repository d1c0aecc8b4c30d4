"""Checkpoint integrity on the CPU: every file of both kinds of checkpoint (single-process and sharded,
the latter through torch.distributed.checkpoint in one process) is covered by the sealed manifest, a
damaged or edited file is refused before anything is loaded, in one line naming it; ``latest`` finds
the newest complete checkpoint; ``hytrain verify`` checks a checkpoint offline."""

import json
import subprocess
import sys

import pytest
import torch

import hytrain
from hytrain import checkpoint as ckpt
from hytrain import dist_checkpoint
from hytrain.models import LlamaConfig, LlamaModel

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                  max_seq_len=32)


def trained(steps=2):
    torch.manual_seed(0)
    model = LlamaModel(CFG)
    opt = hytrain.HybridAdamW(model.parameters(), workers=1, model=model)
    x = torch.randint(0, 64, (2, 16))
    for _ in range(steps):
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save(kind, out, step):
    model, opt = trained()
    if kind == "sharded":
        return dist_checkpoint.save(out, step, model, opt, {"note": 1})
    return ckpt.save(out, step, model, opt, None, {})


def load(kind, path):
    model, opt = trained(0)
    if kind == "sharded":
        return dist_checkpoint.load(path, model, opt)
    return ckpt.load(path, model, opt, None)


def flip(path, offset=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i:i + 8] = bytes(255 - b for b in data[i:i + 8])
    path.write_bytes(bytes(data))


def files_of(path):
    return sorted(f.name for f in path.iterdir() if f.name != "meta.json")


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_every_file_is_covered(tmp_path, kind):
    path = save(kind, tmp_path / "run", 7)
    meta = ckpt.verify(path)
    assert meta["step"] == 7 and sorted(meta["files"]) == files_of(path)
    if kind == "sharded":
        assert any(f.endswith(".distcp") for f in meta["files"]) and ".metadata" in meta["files"]
    for name in files_of(path):
        for damage in ("flip", "truncate", "delete"):
            path = save(kind, tmp_path / f"{name}-{damage}", 7)
            f = path / name
            if damage == "flip":
                flip(f)
            elif damage == "truncate":
                f.write_bytes(f.read_bytes()[:-3])
            else:
                f.unlink()
            with pytest.raises(ckpt.CheckpointError, match=name.replace(".", r"\.")) as e:
                load(kind, path)
            assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_an_edited_manifest_is_refused(tmp_path, kind):
    path = save(kind, tmp_path / "run", 50)
    meta = json.loads((path / "meta.json").read_text())
    meta["step"] = 10
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="meta.json was altered"):
        load(kind, path)
    (path / "meta.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ckpt.CheckpointError, match="meta.json is corrupted"):
        load(kind, path)


def test_a_stray_file_in_a_sharded_checkpoint_is_refused(tmp_path):
    path = save("sharded", tmp_path / "run", 3)
    (path / "__9_0.distcp").write_bytes(b"from another run")
    with pytest.raises(ckpt.CheckpointError, match="not in the manifest"):
        ckpt.verify(path)


def test_the_round_trip_still_loads(tmp_path):
    for kind in ("single", "sharded"):
        path = save(kind, tmp_path / kind, 4)
        got = load(kind, path)
        assert (got if kind == "single" else got["step"]) == 4


def test_latest_is_the_newest_complete_checkpoint(tmp_path):
    out = tmp_path / "run"
    first = save("single", out, 10)
    second = save("single", out, 20)
    root = out / "checkpoints"
    assert ckpt.resolve(out, "latest") == second
    # A kill after the rename, before the pointer: the pointer still names step 10.
    (root / "latest").write_text(first.name + "\n")
    assert ckpt.resolve(out, "latest") == second
    # An incomplete newer directory is passed over.
    (second / "optimizer.pt").write_bytes(b"x")
    assert ckpt.resolve(out, "latest") == first
    # A damaged pointer: said once, and the scan decides.
    (root / "latest").write_bytes(b"\xff\x00" * 3000)
    assert ckpt.resolve(out, "latest") == first
    (root / "latest").write_text("../../etc\n")
    assert ckpt.resolve(out, "latest") == first


def test_resuming_a_run_whose_only_save_was_cut_says_so(tmp_path):
    # Killed during its first save: only the temporary directory is there (swept by the next run
    # that starts in that directory, which --resume latest cannot be).
    out = tmp_path / "run"
    first = save("single", out, 1)
    first.rename(first.parent / ".step_00000001.tmp")
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.resolve(out, "latest")
    assert str(e.value) == (f"--resume latest: no checkpoint under {out / 'checkpoints'} (.step_00000001.tmp is a "
                            "save that was interrupted: no step of this run was saved)")


def test_latest_falls_back_past_a_damaged_newest_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    first = save("single", out, 10)
    second = save("single", out, 20)
    # The pointer names step 20, whose optimizer file lost its end on disk: the newest complete
    # checkpoint before it is resumed from, and the user is told which and why.
    data = (second / "optimizer.pt").read_bytes()
    (second / "optimizer.pt").write_bytes(data[: len(data) // 2])
    assert ckpt.resolve(out, "latest") == first
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"step_00000020, which {out / 'checkpoints' / 'latest'} names, is damaged " \
        f"(optimizer.pt is {len(data) // 2} bytes, its manifest says {len(data)}); resuming from step_00000010" in err


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    # A run resumed from an older checkpoint saves a step that exists: the old directory leaves by a
    # rename (a kill never leaves it half-deleted under its name), the new one is complete.
    out = tmp_path / "run"
    save("single", out, 10)
    again = save("single", out, 10)
    root = out / "checkpoints"
    assert ckpt.resolve(out, "latest") == again and ckpt._complete(again)
    assert not list(root.glob(".step_*"))  # the old one swept
    assert load("single", again) == 10


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_a_resumed_runs_first_save_removes_the_replaced_runs_later_checkpoints(tmp_path, capsys, kind):
    # Checkpoints 10..50 of a run; another resumes from step 20 and saves 40 (since=20): 30 and 50 go
    # before 40 is put in place, so neither --resume latest nor the pruning (keep 2) sees them.
    out = tmp_path / "run"
    model, opt = trained()
    put = (lambda step, **kw: dist_checkpoint.save(out, step, model, opt, {}, **kw)) if kind == "sharded" else \
        (lambda step, **kw: ckpt.save(out, step, model, opt, None, {}, **kw))
    for step in (10, 20, 30, 50):
        put(step, keep=5)
    put(40, keep=2, since=20)
    assert "removing step_00000030, step_00000050: saved after step 20" in capsys.readouterr().err
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_00000020", "step_00000040"]
    assert ckpt.resolve(out, "latest").name == "step_00000040"
    assert not list((out / "checkpoints").glob(".step_*"))  # swept
    put(60, keep=2, since=40)  # its own next save: only the pruning
    assert "removing" not in capsys.readouterr().err
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_00000040", "step_00000060"]


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_a_save_the_disk_cannot_hold_names_the_checkpoint_kept(tmp_path, monkeypatch, kind):
    import collections
    import shutil

    out = tmp_path / "run"
    save(kind, out, 10)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1000))
    with pytest.raises(ckpt.CheckpointError, match="GB free; the last good checkpoint, step_00000010, is kept"):
        save(kind, out, 20)
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_00000010"]


def test_hytrain_verify(tmp_path):
    out = tmp_path / "run"
    path = save("sharded", out, 5)
    ok = subprocess.run([sys.executable, "-m", "hytrain", "verify", str(out)], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and "OK, sharded checkpoint of step 5" in ok.stdout, ok.stderr
    flip(path / ".metadata", 10)
    bad = subprocess.run([sys.executable, "-m", "hytrain", "verify", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and ".metadata" in bad.stderr
    # A run whose newest checkpoint is damaged fails, naming the one before it (not the older one's OK).
    older = save("sharded", out, 3)
    meta = path / "meta.json"
    raw = bytearray(meta.read_bytes())
    raw[raw.index(b'"step"') + 2] ^= 1
    meta.write_bytes(bytes(raw))
    bad = subprocess.run([sys.executable, "-m", "hytrain", "verify", str(out)], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "step_00000005/meta.json was altered" in bad.stderr and f"--resume {older}" in bad.stderr
    # Directories that hold no checkpoint: said as such, in one line.
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    for where, says in (("fresh", "fresh: no checkpoint under"), ("empty", "empty is empty: neither a checkpoint"),
                        ("gone", "gone does not exist")):
        got = subprocess.run([sys.executable, "-m", "hytrain", "verify", str(tmp_path / where)], capture_output=True,
                             text=True, timeout=120)
        assert got.returncode == 2 and got.stderr.count("\n") == 1 and says in got.stderr, got.stderr


def test_verify_of_a_directory_that_is_no_checkpoint_says_so_not_incomplete(tmp_path, capsys):
    from hytrain.__main__ import main

    other = tmp_path / "photos"  # (as `hytrain verify /tmp`: a directory of other things)
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8")
    assert main(["verify", str(other)]) == 2
    err = capsys.readouterr().err
    assert err == f"hytrain verify: {other} is neither a checkpoint (no meta.json) nor a run directory (no " \
                  "checkpoints/): pass a checkpoint directory (step_N) or a run's --out\n", err
    # A checkpoint whose save was cut before its meta.json is still one: incomplete.
    for cut, name in ((tmp_path / "step_00000007", "x.bin"), (tmp_path / "copied", "model.safetensors")):
        cut.mkdir()
        (cut / name).write_bytes(b"\0")
        assert main(["verify", str(cut)]) == 2
        err = capsys.readouterr().err
        assert f"{cut} is incomplete: meta.json is missing" in err and err.count("\n") == 1, err
