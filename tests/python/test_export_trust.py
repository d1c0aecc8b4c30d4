"""Exports that fail or race: a full disk or an I/O error under `hytrain export` is one line, exit 2,
with nothing half-written left and a pre-existing target untouched; the job's own export failing
still writes summary.json and says where the last good checkpoint is and how to export it; and an
export of a run that is still training never reads a checkpoint the run prunes meanwhile."""

import errno
import json
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import safetensors.torch
import torch
import transformers.modeling_utils  # noqa: F401 -- binds safetensors' functions before a test replaces one
from safetensors import SafetensorError

from hytrain import checkpoint as ckpt
from hytrain.__main__ import main as hytrain_main
from hytrain.job import hf
from hytrain.job import main as train

FAST = ["--batch-size", "4", "--seq-len", "64", "--no-progress", "--device", "cpu", "--workers", "1",
        "--eval-every", "0"]
# safetensors' own error on a full disk (not an OSError: what escaped before as a traceback)
FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A finished run of the tiny preset: step_00000001 and step_00000002."""
    out = tmp_path_factory.mktemp("runs") / "run"
    assert train(["--model", "tiny", "--data", corpus, "--steps", "2", "--save-every", "1", "--no-export",
                  "--out", str(out), *FAST]) == 0
    return out


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the finished run, this test's to change."""
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _export(capsys, *args):
    capsys.readouterr()
    code = hytrain_main(["export", *args])
    said = capsys.readouterr()
    return code, said.out, said.err


def _leftovers(where):
    return sorted(p.name for p in where.iterdir() if p.name.startswith("."))


def _full_disk(monkeypatch, error, where=lambda path: True):
    """Every safetensors write ``where`` says fails as on a full disk, after creating its file (the
    writer ``save_file`` calls: whoever imported ``save_file`` by name is covered too)."""
    real = safetensors.torch.serialize_file

    def serialize_file(tensors, filename, *a, **k):
        if where(str(filename)):
            open(filename, "wb").close()
            raise error
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(safetensors.torch, "serialize_file", serialize_file)


# ---------------------------------------------------------------------------------------------------
# hytrain export on a full disk


@pytest.mark.parametrize("error", [SafetensorError(FULL), OSError(errno.ENOSPC, "No space left on device")])
def test_export_on_a_full_disk_is_one_line_and_leaves_the_target_as_it_was(run, tmp_path, capsys, monkeypatch,
                                                                          error):
    _full_disk(monkeypatch, error)
    (tmp_path / "empty").mkdir()
    code, out, err = _export(capsys, str(run), "--to", str(tmp_path / "empty"))
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"hytrain export: error: exporting into {tmp_path / 'empty'} "
                                                   "failed: No space left on device"), err
    assert "GB needed" in err and f"{tmp_path / 'empty'} is as it was" in err, err
    assert list((tmp_path / "empty").iterdir()) == [] and _leftovers(tmp_path) == []
    code, out, err = _export(capsys, str(run), "--to", str(tmp_path / "new" / "deeper" / "model"))
    assert code == 2 and err.count("\n") == 1 and "nothing was left in its place" in err, err
    assert not (tmp_path / "new").exists() and _leftovers(tmp_path) == []


def test_export_of_a_path_that_is_no_run_directory_says_what_it_is(run, tmp_path, capsys):
    for where, says in ((tmp_path / "no-such-run", "does not exist"), (run / "metrics.jsonl", "is a file, not a "
                        "run directory"), (run / "checkpoints", "is not a run directory (no config.json)")):
        code, out, err = _export(capsys, str(where), "--to", str(tmp_path / "model"))
        assert (code, out) == (2, "") and err == f"hytrain export: error: {where} {says}\n", err
        assert not (tmp_path / "model").exists()


def test_export_under_a_file_size_limit_is_one_line_exit_2(run, tmp_path):
    """A real failed write: the export's process may write no file over 1 MB (ulimit -f, with SIGXFSZ
    ignored so that the write fails with EFBIG instead of killing it); the model is 3 MB."""
    code = textwrap.dedent("""
        import resource, signal, sys
        from hytrain.__main__ import main
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        sys.exit(main(sys.argv[1:]))
    """)
    to = tmp_path / "model"
    r = subprocess.run([sys.executable, "-c", code, "export", str(run), "--to", str(to)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and "File too large" in r.stderr and "nothing was left" in r.stderr, r.stderr
    assert not to.exists() and _leftovers(tmp_path) == []


def test_a_write_failing_on_a_later_shard_leaves_nothing(run, tmp_path, monkeypatch):
    """Three shards, the second fails: the first is not left behind, in the target or beside it."""
    model, _ = hf.load_causal_lm(str(hf.export_run(run, tmp_path / "whole")), device=torch.device("cpu"),
                                 dtype=torch.float32)
    _full_disk(monkeypatch, SafetensorError(FULL), where=lambda path: "-00002-of-" in path)
    with pytest.raises(hf.ExportError) as e:
        hf.export_model(model, tmp_path / "sharded", max_shard_bytes=1 << 20)
    assert e.value.why.startswith("No space left on device") and len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "sharded").exists() and _leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------------
# The job's own export


def test_the_jobs_failed_export_is_one_line_and_summary_json_is_written(corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _full_disk(monkeypatch, SafetensorError(FULL), where=lambda path: "/checkpoints/" not in path)
    capsys.readouterr()
    assert train(["--model", "tiny", "--data", corpus, "--steps", "2", "--out", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"hytrain train: error: training finished and its last good checkpoint is "
                          f"{out / 'checkpoints' / 'step_00000002'}, but exporting the model into {out / 'model'} "
                          "failed: No space left on device"), err
    assert err.rstrip().endswith(f"export it later with `hytrain export {out} --to DIR`"), err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and "model_dir" not in summary and summary["export_error"] in err
    assert not (out / "model").exists() and _leftovers(out) == [] and not (out / "hytrain.lock").exists()
    monkeypatch.undo()  # room again: the advice works
    code, said, err = _export(capsys, str(out), "--to", str(tmp_path / "later"))
    assert code == 0 and (tmp_path / "later" / "model.safetensors").is_file(), err


# ---------------------------------------------------------------------------------------------------
# Exporting a run that is still training


def _save_next(run, keep=1):
    """What the training run does next: a new checkpoint published, the older ones pruned to ``keep``."""
    root = run / "checkpoints"
    step = max(int(p.name[5:]) for p in root.glob("step_*")) + 1
    tmp = root / f".step_{step:08d}.tmp"
    shutil.copytree(ckpt.complete_checkpoints(run)[-1], tmp)
    return ckpt.publish(root, tmp, root / f"step_{step:08d}", keep=keep)


def test_a_checkpoint_being_exported_is_not_pruned_under_it(run, tmp_path, capsys, monkeypatch):
    """The run saves (and prunes to --keep 1) while the export reads step_00000002: the pruning passes
    over it, the export reads it whole, and the next save prunes it."""
    read, real = [], safetensors.torch.load_file

    def load_file(path, *a, **k):
        read.append(path)
        if len(read) == 1:
            _save_next(run)  # in the middle of the read
        return real(path, *a, **k)

    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    code, out, err = _export(capsys, str(run), "--to", str(tmp_path / "model"))
    assert code == 0, err
    assert read == [str(run / "checkpoints" / "step_00000002" / "model.safetensors")]
    assert err == "hytrain: step_00000002 is being read (hytrain export); kept until a later save prunes it\n"
    written = safetensors.torch.load_file(str(tmp_path / "model" / "model.safetensors"))
    saved = real(read[0])
    assert written["model.embed_tokens.weight"].equal(saved["embed.weight"])
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000003"]
    _save_next(run)  # the lease is gone: pruned as usual
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000004"]


def test_without_file_locks_a_checkpoint_pruned_mid_read_is_read_again(run, tmp_path, capsys, monkeypatch):
    """Where the file system has no flock, the lease is nothing: the pruning goes ahead, and the export
    reads the newest checkpoint again."""
    monkeypatch.setattr(ckpt, "fcntl", None)
    read, real = [], safetensors.torch.load_file

    def load_file(path, *a, **k):
        read.append(path)
        if len(read) == 1:
            _save_next(run)
        return real(path, *a, **k)

    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    code, out, err = _export(capsys, str(run), "--to", str(tmp_path / "model"))
    assert (code, err) == (0, ""), err
    assert [p.split("/")[-2] for p in read] == ["step_00000002", "step_00000003"]


def test_latest_pruned_before_it_is_read_is_resolved_again(run, tmp_path, capsys, monkeypatch):
    calls, real = [], ckpt.resolve

    def resolve(out, spec):
        found = real(out, spec)
        calls.append(found.name)
        if len(calls) == 1:
            _save_next(run)  # pruned after it was picked, before it is read
        return found

    monkeypatch.setattr(ckpt, "resolve", resolve)
    code, out, err = _export(capsys, str(run), "--to", str(tmp_path / "model"))
    assert (code, err) == (0, ""), err
    assert calls == ["step_00000002", "step_00000003"]
    # a checkpoint named on the command line is not replaced by another: one line
    named = run / "checkpoints" / "step_00000003"
    monkeypatch.setattr(ckpt, "resolve", lambda out, spec: (real(out, spec), _save_next(run))[0])
    code, out, err = _export(capsys, str(run), "--to", str(tmp_path / "named"), "--checkpoint", named.name)
    assert code == 2 and err == (f"hytrain export: error: {named} was removed before it could be read (pruned by "
                                 "the run saving checkpoints)\n"), err
    # a run saving faster than it can be read, every time: bounded, one line
    calls.clear()
    monkeypatch.setattr(ckpt, "resolve", lambda out, spec: (calls.append(1), real(out, spec), _save_next(run))[1])
    code, out, err = _export(capsys, str(run), "--to", str(tmp_path / "never"))
    assert code == 2 and len(calls) == 5 and err.count("\n") == 1, err
    assert "its newest checkpoint was pruned before it could be read, 5 times" in err, err
    assert not (tmp_path / "never").exists() and _leftovers(tmp_path) == []


def test_exports_of_a_live_run_saving_every_step_never_fail(corpus, tmp_path):
    """Exports in a loop while a run trains with --save-every 1 --keep 1 (bounded: about 20 s)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--model", "tiny", "--data", corpus,
                             "--steps", "8", "--save-every", "1", "--keep", "1", "--no-export", "--out", str(out),
                             *FAST], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not (out / "checkpoints" / "latest").exists() and proc.poll() is None and time.monotonic() - t0 < 60:
            time.sleep(0.02)
        done, failed = 0, []
        while proc.poll() is None and time.monotonic() - t0 < 90:
            try:
                hf.export_run(out, tmp_path / f"x{done}")
                shutil.rmtree(tmp_path / f"x{done}")
                done += 1
            except Exception as e:  # noqa: BLE001 -- what a race raised
                failed.append(f"{type(e).__name__}: {e}")
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert not failed and done > 0, failed


def test_config_and_summary_are_written_whole_or_not_at_all(run, tmp_path, monkeypatch):
    # A disk that fills while config.json is rewritten (every run's start) leaves the earlier file as
    # it was, not cut short: `hytrain export` and a resume read it. (summary.json is written the same way.)
    from pathlib import Path

    from hytrain.job import outputs

    before = (run / "config.json").read_text()
    real = Path.write_text

    def half(self, text, *args, **kwargs):
        if self.name.endswith(".tmp"):
            real(self, text[: len(text) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError, match="No space left"):
        outputs.write_whole(run / "config.json", json.dumps({"options": {}}))
    monkeypatch.undo()
    assert (run / "config.json").read_text() == before and _leftovers(run) == []
    outputs.write_whole(run / "summary.json", '{"steps": 2}')
    assert json.loads((run / "summary.json").read_text()) == {"steps": 2} and _leftovers(run) == []
