"""`hytrain train`: the embedded default learns, checkpoints resume bit-identically on the CPU, damaged
checkpoints are refused, a kill in the middle of a save never harms the last good one, SIGTERM saves
and exits cleanly, and bad options fail before training with a clear message."""

import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

from hytrain import checkpoint as ckpt
from hytrain.job import main

FAST = ["--batch-size", "4", "--seq-len", "64", "--no-progress", "--device", "cpu", "--workers", "1"]


@pytest.fixture(scope="module")
def fast(corpus):
    """FAST on a small text file, for the runs whose checks do not depend on what they learn from: read
    at once, where the embedded default walks the standard library's sources at every start."""
    return [*FAST, "--data", corpus]


def metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_embedded_default_learns(tmp_path):
    out = str(tmp_path / "run")
    assert main(["--steps", "40", "--eval-every", "20", "--out", out, *FAST]) == 0
    vals = [r["val_loss"] for r in metrics(out) if "val_loss" in r]
    assert len(vals) == 2 and vals[1] < vals[0] < 4.5 and vals[1] < 3.5  # ln(256) = 5.55 at the start
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["steps"] == 40 and os.path.exists(summary["trace"])
    assert ckpt.resolve(out, "latest").name == "step_00000040"
    # Where the state lived: all of it on the host here (m and v of every parameter, 8 bytes each,
    # fp32 weights being their own master), and the process's peak.
    assert summary["k"] == 0 and summary["state_gpu_gb"] == 0 and summary["shadows_host_gb"] == 0
    assert 8 * summary["params"] <= summary["state_host_gb"] * 1e9 <= 8 * summary["params"] * 1.01 + 1e6
    assert summary["peak_host_gb"] > summary["state_host_gb"]
    # How long the start took, from the process's start (pytest's, here) to the end of each phase:
    # in order, and the first step's in its metrics record too.
    start = summary["startup_s"]
    assert list(start) == ["model", "optimizer", "first_step"]
    assert 0 < start["model"] <= start["optimizer"] <= start["first_step"]
    assert metrics(out)[0]["startup_s"] == start["first_step"] and "startup_s" not in metrics(out)[1]
    made = summary["state_made_s"]  # (within the first step: the optimizer's state, reserved and filled)
    assert set(made) == {"reserve", "fill"} and 0 <= made["reserve"] and 0 < made["fill"] < start["first_step"]


def test_a_model_the_host_cannot_hold_on_the_cpu_is_refused_before_it_is_built(tmp_path, fast, capsys,
                                                                                  monkeypatch):
    # l3b on a 24 GB machine grew to 17 GB before anything refused it: its weights, gradients and state
    # (16 bytes a parameter with fp32 states, 10.03 with 8-bit) are known from the shapes alone.
    from hytrain.job import models

    monkeypatch.setattr(models, "available_memory_bytes", lambda: 10 << 20)  # 10 MiB
    out = str(tmp_path / "run")
    assert main(["--steps", "1", "--model", "small", "--out", out, *fast]) == 2
    err = capsys.readouterr().err
    assert "small (" in err and "does not fit this host on the CPU" in err and "16.00 bytes a parameter" in err, err
    assert "--state-format 8bit" in err and len(err.strip().splitlines()) == 1, err
    assert main(["--steps", "1", "--model", "small", "--out", out, "--state-format", "8bit", *fast]) == 2
    err = capsys.readouterr().err
    assert "8bit optimizer state" in err and "--state-format 8bit" not in err, err
    monkeypatch.setattr(models, "available_memory_bytes", lambda: 64 << 30)
    assert main(["--steps", "1", "--model", "tiny", "--eval-every", "0", "--out", str(tmp_path / "ok"), *fast]) == 0


def test_a_step_whose_activations_the_host_cannot_hold_on_the_cpu_is_refused_before_it_is_built(tmp_path, fast,
                                                                                                 capsys, monkeypatch):
    # `--model tiny --seq-len 100000` grew to ~23 GB before anything said so: the check counted the
    # weights, gradients and optimizer state (12 MiB for tiny) but not a step's activations.
    from hytrain.job import models
    from hytrain.job.plan import ModelPlan

    plan = ModelPlan(model="tiny", init="random", tokenizer=None, precision=None, stream="off",
                     activation_checkpointing=False, seq_len=100000, seed=0)
    with pytest.raises(models.ConfigError) as e:  # (24 GiB: this machine's; the estimate is ~108 GiB)
        models.check_host_fit(plan, torch.float32, available=24 << 30, batch_size=16)
    msg = str(e.value)
    assert "--batch-size 16 x --seq-len 100000" in msg and "activations need about 108." in msg, msg
    assert "and 24.00 GiB is available: lower --seq-len or --batch-size" in msg and "\n" not in msg, msg
    assert "--activation-checkpointing" in msg, msg  # (not on: it is named, with what it would need)
    default = dataclasses.replace(plan, seq_len=128)  # the default job's: fits, as any test job does
    models.check_host_fit(default, torch.float32, available=1 << 30, batch_size=16)
    # The estimate: linear in the tokens of a step, smaller with checkpointing, larger in fp32.
    shape = models._shape(models.LlamaConfig(**models.PRESETS["tiny"]))
    one = models.activation_bytes(shape, 1, 128, torch.float32, False)
    assert models.activation_bytes(shape, 16, 128, torch.float32, False) == 16 * one
    assert models.activation_bytes(shape, 1, 128, torch.float32, True) < one
    assert models.activation_bytes(shape, 1, 128, torch.bfloat16, False) < one
    # A whole job: refused in one line (exit 2) before the model is built, where without the
    # activations (12 MiB of weights and state, 20 MiB available) it trained.
    monkeypatch.setattr(models, "available_memory_bytes", lambda: 20 << 20)
    out = str(tmp_path / "run")
    assert main(["--steps", "1", "--model", "tiny", "--eval-every", "0", "--out", out, *fast]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 4 x --seq-len 64" in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(out)


def test_resume_is_bit_identical_on_cpu(tmp_path, fast):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["--steps", "12", "--eval-every", "0", "--out", a, *fast]) == 0
    assert main(["--steps", "6", "--eval-every", "0", "--out", b, *fast]) == 0
    assert main(["--steps", "12", "--eval-every", "0", "--out", b, "--resume", "latest", *fast]) == 0
    la = [r["loss"] for r in metrics(a)]
    lb = [r["loss"] for r in metrics(b)]
    assert [r["step"] for r in metrics(b)] == list(range(1, 13))
    assert la == lb


def test_resume_in_another_state_format_converts_and_says_so(tmp_path, capsys, fast):
    out = str(tmp_path / "run")
    assert main(["--steps", "4", "--eval-every", "0", "--out", out, "--state-format", "bf16", *fast]) == 0
    capsys.readouterr()
    # Without --state-format a resumed run keeps the checkpoint's format, silently.
    assert main(["--steps", "5", "--eval-every", "0", "--out", out, "--resume", "latest", *fast]) == 0
    assert "they continue as" not in capsys.readouterr().out
    assert ckpt.read_meta(ckpt.resolve(out, "latest"))["state_format"] == "bf16"
    # Asked for another format, it converts and says so.
    assert main(["--steps", "6", "--eval-every", "0", "--out", out, "--resume", "latest", "--state-format", "fp32",
                 *fast]) == 0
    said = capsys.readouterr().out
    assert "optimizer states are bf16; they continue as fp32, as --state-format fp32 asks" in said
    assert json.load(open(os.path.join(out, "summary.json")))["state_format"] == "fp32"
    assert ckpt.read_meta(ckpt.resolve(out, "latest"))["state_format"] == "fp32"


def test_a_fresh_start_on_an_earlier_runs_out_is_refused(tmp_path, capsys, fast):
    # Its steps would go into the same metrics and checkpoints, and --resume latest would later pick
    # the earlier run's higher step: refused in one line, nothing of the earlier run touched.
    out = str(tmp_path / "run")
    assert main(["--steps", "3", "--eval-every", "0", "--out", out, *fast]) == 0
    before = sorted(os.listdir(os.path.join(out, "checkpoints"))), open(os.path.join(out, "metrics.jsonl")).read()
    capsys.readouterr()
    assert main(["--steps", "2", "--eval-every", "0", "--out", out, *fast]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run's checkpoints (the newest step_00000003)" in err and "--resume latest" in err
    assert (sorted(os.listdir(os.path.join(out, "checkpoints"))), open(os.path.join(out, "metrics.jsonl")).read()) == before
    assert main(["--steps", "4", "--eval-every", "0", "--out", out, "--resume", "latest", *fast]) == 0
    assert [r["step"] for r in metrics(out) if "loss" in r] == [1, 2, 3, 4]


def test_8bit_states_train_and_resume_on_cpu(tmp_path, fast):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    args = ["--eval-every", "0", "--state-format", "8bit", *fast]
    assert main(["--steps", "8", "--out", a, *args]) == 0
    assert main(["--steps", "4", "--out", b, *args]) == 0
    assert main(["--steps", "8", "--out", b, "--resume", "latest", *args]) == 0
    assert [r["loss"] for r in metrics(a) if "loss" in r] == [r["loss"] for r in metrics(b) if "loss" in r]
    summary = json.load(open(os.path.join(b, "summary.json")))
    assert summary["state_format"] == "8bit"


def test_resume_after_steps_past_the_last_save_records_each_step_once(tmp_path, fast):
    # Killed after step 8, saved at step 4: the steps the kill lost are taken again, and
    # metrics.jsonl ends with every step once, their losses those of an uninterrupted run.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["--steps", "8", "--eval-every", "0", "--out", a, *fast]) == 0
    assert main(["--steps", "8", "--eval-every", "0", "--save-every", "4", "--out", b, *fast]) == 0
    ckpt_dir = ckpt.resolve(b, "latest")
    assert ckpt_dir.name == "step_00000008"
    os.rename(ckpt_dir, ckpt_dir.parent / ".step_00000008.trash")  # as if the kill came before the save
    with open(os.path.join(b, "metrics.jsonl"), "a") as f:
        f.write('{"step": 9, "loss"')  # and cut a record short
    assert main(["--steps", "8", "--eval-every", "0", "--out", b, "--resume", "latest", *fast]) == 0
    assert [r["step"] for r in metrics(b)] == list(range(1, 9))
    assert [r["loss"] for r in metrics(b)] == [r["loss"] for r in metrics(a)]
    summary = json.load(open(os.path.join(b, "summary.json")))
    assert summary["from_step"] == 5 and summary["first_loss"] == metrics(a)[4]["loss"]


def test_the_loss_plot_after_a_resume_has_the_whole_run(tmp_path, monkeypatch, fast):
    from hytrain import plots

    drawn = []
    monkeypatch.setattr(plots, "write_all", lambda out, history, trace: drawn.append(history) or {})
    out = str(tmp_path / "run")
    assert main(["--steps", "4", "--eval-every", "0", "--save-every", "2", "--out", out, *fast]) == 0
    assert main(["--steps", "6", "--eval-every", "0", "--out", out, "--resume", "latest", *fast]) == 0
    assert [r["step"] for r in drawn[-1]] == list(range(1, 7))  # not only the resumed steps 5 and 6
    assert [r["loss"] for r in drawn[-1]] == [r["loss"] for r in metrics(out)]


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_blocks", ["2", "auto"])
def test_resume_on_the_gpu_continues_the_run(tmp_path, gpu_blocks):
    # The GPU path: pipeline, resident blocks (fixed k, or whatever the scheduler picks), states moved
    # out for the checkpoint and back in on resume. The AdamW kernels agree bit for bit wherever a
    # block is updated, but attention's backward need not be deterministic on a GPU: losses agree to
    # a tolerance.
    gpu = ["--batch-size", "4", "--seq-len", "64", "--no-progress", "--device", "cuda", "--workers", "2",
           "--eval-every", "0", "--gpu-blocks", gpu_blocks]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["--steps", "12", "--out", a, *gpu]) == 0
    assert main(["--steps", "6", "--out", b, *gpu]) == 0
    assert main(["--steps", "12", "--out", b, "--resume", "latest", *gpu]) == 0
    la = [r["loss"] for r in metrics(a)]
    lb = [r["loss"] for r in metrics(b)]
    assert [r["step"] for r in metrics(b)] == list(range(1, 13))
    assert max(abs(x - y) for x, y in zip(la, lb)) < 2e-2, (la, lb)
    assert all("gpu_wait_frac" in r for r in metrics(a)[3:])


@pytest.mark.gpu
def test_fp16_on_the_gpu_overlaps_backward_and_resumes_with_the_scale(tmp_path, monkeypatch):
    # --precision fp16 on the GPU: gradients leave during backward under the GradScaler, an overflow
    # (the first steps, at a scale of 2^30) is skipped there too, and a resume goes on with the scale.
    real = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device: real(device, init_scale=2.0 ** 30))
    gpu = ["--batch-size", "4", "--seq-len", "64", "--no-progress", "--device", "cuda", "--workers", "2",
           "--eval-every", "0", "--precision", "fp16", "--save-every", "6"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["--steps", "12", "--out", a, *gpu]) == 0
    assert main(["--steps", "6", "--out", b, *gpu]) == 0
    assert main(["--steps", "12", "--out", b, "--resume", "latest", *gpu]) == 0
    ra, rb = metrics(a), metrics(b)
    scales = [r["loss_scale"] for r in ra]
    assert scales[0] == 2.0 ** 29 and scales[-1] < 2.0 ** 29 and all(math.isfinite(r["loss"]) for r in ra), scales
    assert [r["loss_scale"] for r in rb] == scales
    assert max(abs(r["loss"] - q["loss"]) for r, q in zip(ra, rb)) < 2e-2


def test_damaged_checkpoints_are_refused(tmp_path, capsys, fast):
    out = str(tmp_path / "run")
    assert main(["--steps", "2", "--eval-every", "0", "--out", out, *fast]) == 0
    path = ckpt.resolve(out, "latest")
    opt_file = path / "optimizer.pt"
    data = bytearray(opt_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    opt_file.write_bytes(bytes(data))
    assert main(["--steps", "4", "--out", out, "--resume", "latest", *fast]) == 2
    assert "optimizer.pt is corrupted" in capsys.readouterr().err
    model_file = path / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match="truncated"):
        ckpt.verify(path)
    (path / "meta.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.verify(path)


def test_a_resume_from_an_older_checkpoint_replaces_the_later_ones(tmp_path, capsys, fast):
    # Checkpoints at 2, 4, 6; step 6 is damaged; the user resumes from step 4 and saves at 8 keeping 2.
    # The resumed run's first save removes step 6 (the replaced run's future): the directory then
    # holds this history, 4 and 8, and --resume latest takes 8. (Pruning by name alone kept the
    # damaged 6 and removed the good 4.)
    out = tmp_path / "run"
    args = ["--eval-every", "0", "--out", str(out), *fast]
    assert main(["--steps", "6", "--save-every", "2", "--keep", "5", *args]) == 0
    opt_file = out / "checkpoints" / "step_00000006" / "optimizer.pt"
    data = bytearray(opt_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    opt_file.write_bytes(bytes(data))
    capsys.readouterr()
    older = out / "checkpoints" / "step_00000004"
    # --resume latest is refused naming the damaged file, and the checkpoint before it.
    assert main(["--steps", "8", "--resume", "latest", *args]) == 2
    err = capsys.readouterr().err
    assert "optimizer.pt is corrupted" in err and f"resume from that one with --resume {older}" in err
    assert main(["--steps", "8", "--save-every", "4", "--keep", "2", "--resume", str(older), *args]) == 0
    assert "removing step_00000006: saved after step 4" in capsys.readouterr().err
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_00000004", "step_00000008"]
    assert ckpt.resolve(out, "latest").name == "step_00000008"
    assert [r["step"] for r in metrics(out)] == list(range(1, 9))
    # A resume from the newest checkpoint removes nothing of its own history.
    assert main(["--steps", "12", "--save-every", "2", "--keep", "3", "--resume", "latest", *args]) == 0
    assert "removing" not in capsys.readouterr().err
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_00000008", "step_00000010", "step_00000012"]


def test_kill_during_save_keeps_the_last_good_checkpoint(tmp_path, fast):
    out = str(tmp_path / "run")
    assert main(["--steps", "2", "--eval-every", "0", "--out", out, *fast]) == 0
    good = ckpt.resolve(out, "latest")
    # A second save in a child process that is SIGKILLed halfway (after the weights, while the
    # optimizer state is being written).
    code = textwrap.dedent(f"""
        import os, signal, torch
        from hytrain import checkpoint as ckpt
        from hytrain.models import LlamaConfig, LlamaModel
        import hytrain
        model = LlamaModel(LlamaConfig())
        opt = hytrain.HybridAdamW(model.parameters(), workers=1)
        real = torch.save
        def dying(obj, f, *a, **k):
            with open(f, "wb") as fh:
                fh.write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = dying
        ckpt.save({out!r}, 3, model, opt, None, {{}})
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert ckpt.resolve(out, "latest") == good
    ckpt.verify(good)
    assert main(["--steps", "3", "--eval-every", "0", "--out", out, "--resume", "latest", *fast]) == 0


def test_kill_while_old_checkpoints_are_pruned(tmp_path, fast):
    """SIGKILL halfway through removing the oldest checkpoint (--keep 1): the new checkpoint is whole
    and found by latest, the half-removed one is out of sight (renamed before its removal) and the
    next run removes it."""
    out = str(tmp_path / "run")
    assert main(["--steps", "2", "--save-every", "1", "--keep", "2", "--eval-every", "0", "--out", out, *fast]) == 0
    code = textwrap.dedent(f"""
        import os, shutil, signal, torch
        from pathlib import Path
        from hytrain import checkpoint as ckpt
        from hytrain.models import LlamaConfig, LlamaModel
        import hytrain
        model = LlamaModel(LlamaConfig())
        opt = hytrain.HybridAdamW(model.parameters(), workers=1)
        real = shutil.rmtree
        def dying(path, *a, **k):  # a prune removes one file, then the process is killed
            if not str(path).endswith(".trash"):
                return real(path, *a, **k)
            files = sorted(p for p in Path(path).iterdir())
            files[0].unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        shutil.rmtree = dying
        ckpt.save({out!r}, 3, model, opt, None, {{}}, keep=1)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    root = tmp_path / "run" / "checkpoints"
    assert ckpt.resolve(out, "latest").name == "step_00000003"
    ckpt.verify(root / "step_00000003")
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000003"]  # the others out of sight
    assert list(root.glob(".step_*.trash"))  # what the kill left
    # A kill of a prune that removed in place (no rename) leaves a half checkpoint older than latest:
    (root / "step_00000001").mkdir()
    (root / "step_00000001" / "meta.json").write_text("{")
    assert ckpt.resolve(out, "latest").name == "step_00000003"
    (root / ".latest.tmp").write_text("step_00000003\n")  # a kill during the pointer's write leaves this
    assert main(["--steps", "4", "--keep", "1", "--eval-every", "0", "--out", out, "--resume", "latest", *fast]) == 0
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004"]


def test_resuming_with_another_model_is_one_line(tmp_path, capsys, fast):
    out = str(tmp_path / "run")
    assert main(["--steps", "1", "--eval-every", "0", "--out", out, *fast]) == 0
    capsys.readouterr()
    assert main(["--steps", "2", "--model", "small", "--out", out, "--resume", "latest", *fast]) == 2
    err = capsys.readouterr().err
    assert "--model small differs from the checkpoint's tiny" in err and err.count("\n") == 1, err


def test_a_failing_metrics_sink_is_reported_once_and_training_goes_on(tmp_path, capsys, fast):
    out = tmp_path / "run"
    out.mkdir()
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (every write fails with ENOSPC)")
    (out / "metrics.jsonl").symlink_to("/dev/full")
    assert main(["--steps", "4", "--eval-every", "2", "--out", str(out), *fast]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "metrics.jsonl" in ln]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "training goes on" in lines[0], err
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    ckpt.verify(ckpt.resolve(out, "latest"))


@pytest.mark.parametrize("keep", [None, "0"])
def test_sigterm_finishes_the_step_saves_and_exits(tmp_path, keep, fast):
    # --keep 0 (no checkpoints): the model so far is written as the run's model directory instead.
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--steps", "100000", "--eval-every", "0",
                          "--out", out, *fast, *(["--keep", keep] if keep else [])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        path = os.path.join(out, "metrics.jsonl")
        if os.path.exists(path) and len(open(path).read().splitlines()) >= 2:
            break
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, stderr  # not finished: a scheduler requeues it
    assert "stopped by signal" in stdout
    last = metrics(out)[-1]["step"]
    if keep == "0":
        assert not os.path.isdir(os.path.join(out, "checkpoints")) or not os.listdir(os.path.join(out, "checkpoints"))
        assert os.path.isfile(os.path.join(out, "model", "model.safetensors")), stdout
        return
    assert ckpt.verify(ckpt.resolve(out, "latest"))["step"] == last


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_outside_the_training_loop_ends_the_run_and_releases_its_lock(tmp_path, monkeypatch, capsys, fast,
                                                                            signum):
    # While the model is built (before the loop's own handler, which finishes the step and saves):
    # the run ends with 128 + N and one line (a Ctrl-C too: no traceback), and its lock is released
    # (no takeover notice next time).
    from hytrain.job import loop

    build, before = loop.build_model, signal.getsignal(signum)

    def signalled(*a, **k):
        os.kill(os.getpid(), signum)
        return build(*a, **k)

    out = tmp_path / "run"
    monkeypatch.setattr(loop, "build_model", signalled)
    assert main(["--steps", "2", "--eval-every", "0", "--out", str(out), *fast]) == 128 + signum
    said = capsys.readouterr()
    assert f"stopped by signal {int(signum)} outside the training loop" in said.out and "Traceback" not in said.err
    assert not (out / "hytrain.lock").exists() and not (out / "checkpoints").exists()
    assert signal.getsignal(signum) == before
    monkeypatch.setattr(loop, "build_model", build)
    assert main(["--steps", "2", "--eval-every", "0", "--out", str(out), *fast]) == 0
    assert "taking over" not in capsys.readouterr().err


def test_bad_options_fail_before_training(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('steps = 2\nlearning_rate = 0.1\n')
    assert main(["--config", str(cfg), "--out", str(tmp_path / "x"), *FAST]) == 2
    assert "unknown option(s) learning_rate" in capsys.readouterr().err
    assert main(["--batch-size", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--batch-size must be an integer >= 1" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["--out", str(blocker / "sub"), *FAST]) == 2
    assert "cannot write to the output directory" in capsys.readouterr().err
    assert main(["--model", "small", "--pin-limit", "1MiB", "--out", str(tmp_path / "y"), *FAST]) == 2
    assert "--pin-limit" in capsys.readouterr().err
    assert main(["--gpu-memory-limit", "lots", "--out", str(tmp_path / "x"), *FAST]) == 2
    assert "--gpu-memory-limit must be a byte count" in capsys.readouterr().err
    cfg.write_text('gpu-blocks = -1\n')
    assert main(["--config", str(cfg), "--out", str(tmp_path / "x"), *FAST]) == 2
    assert "--gpu-blocks must be an integer >= 0" in capsys.readouterr().err
    cfg.write_text('speculate = -2\n')
    assert main(["--config", str(cfg), "--out", str(tmp_path / "x"), *FAST]) == 2
    assert "--speculate must be an integer >= 0" in capsys.readouterr().err
    assert main(["--resume", "latest", "--out", str(tmp_path / "z"), *FAST]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_toml_config_and_flags(tmp_path, fast):
    cfg = tmp_path / "c.toml"
    cfg.write_text('steps = 3\neval-every = 0\nlr = 0.001\nspeculate = false\n')
    out = str(tmp_path / "run")
    assert main(["--config", str(cfg), "--out", out, "--steps", "2", *fast]) == 0
    assert [r["step"] for r in metrics(out)] == [1, 2]
    opts = json.load(open(os.path.join(out, "config.json")))["options"]
    assert opts["lr"] == 0.001 and opts["steps"] == 2 and opts["speculate"] == "off"


def test_a_transformers_model_by_config_directory(tmp_path):
    # Any causal LM transformers can build from a config (a local directory or the local cache), with
    # random weights (--init random): here a two-layer Llama from a config.json alone, read as bytes
    # (--tokenizer bytes). It trains, saves and resumes.
    transformers = pytest.importorskip("transformers")
    cfg_dir = tmp_path / "tiny-llama"
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             tie_word_embeddings=False).save_pretrained(cfg_dir)
    out = str(tmp_path / "run")
    args = ["--model", str(cfg_dir), "--init", "random", "--tokenizer", "bytes", "--eval-every", "0", "--lr", "3e-3",
            "--out", out, *FAST]
    assert main(["--steps", "16", *args]) == 0
    rows = metrics(out)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert main(["--steps", "20", "--resume", "latest", *args]) == 0
    assert main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "bad"), *FAST]) == 2
    assert [r["step"] for r in metrics(out)][-4:] == [17, 18, 19, 20]
    from safetensors import safe_open

    with safe_open(str(ckpt.resolve(out, "latest") / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.down_proj.weight" in names, sorted(names)[:5]
    fresh = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(cfg_dir))
    from safetensors.torch import load_file

    fresh.load_state_dict(load_file(str(ckpt.resolve(out, "latest") / "model.safetensors")))  # no hytrain


def test_activation_checkpointing_is_the_same_forward():
    """One forward for both: the same loss and gradients with and without recomputation, and the
    same sequence-length check."""
    from hytrain.models import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    plain = LlamaModel(cfg)
    recomputed = LlamaModel(cfg, checkpointing=True)
    recomputed.load_state_dict(plain.state_dict())
    x = torch.randint(0, 64, (2, 16))
    losses = []
    for m in (plain, recomputed):
        loss = m(x, x)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for a, b in zip(plain.parameters(), recomputed.parameters()):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match="exceeds max_seq_len 16"):
        recomputed(torch.zeros(1, 17, dtype=torch.long))


# ---- the job under faults ---------------------------------------------------------------------------

def test_a_finished_run_resumed_says_so_and_touches_nothing(tmp_path, capsys, fast):
    out = tmp_path / "run"
    assert main(["--steps", "3", "--eval-every", "0", "--out", str(out), *fast]) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["--steps", "3", "--out", str(out), "--resume", "latest", *fast]) == 0
    said = capsys.readouterr()
    assert "already reached step 3" in said.out, said.err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_one_run_per_output_directory(tmp_path, fast):
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--steps", "100000", "--eval-every", "0",
                          "--out", str(out), *fast], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "metrics.jsonl").exists():
            time.sleep(0.2)
        second = subprocess.run([sys.executable, "-m", "hytrain", "train", "--steps", "5", "--out", str(out),
                                 *fast], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"pid {p.pid}" in second.stderr and "in use by another run" in second.stderr
        assert second.stderr.count("\n") == 1
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=120)
    assert not (out / "hytrain.lock").exists()  # released at the end


def test_a_stale_lock_is_taken_over(tmp_path, capsys, fast):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket
    (out / "hytrain.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 0}))
    assert main(["--steps", "2", "--eval-every", "0", "--out", str(out), *fast]) == 0
    err = capsys.readouterr().err
    assert "taking over" in err, err


def _race_for_the_lock(out, barrier, results):
    from hytrain.job.lock import RunLock
    from hytrain.job.options import ConfigError

    lock = RunLock(out)
    barrier.wait()  # all at once
    try:
        lock.acquire()
        results.put("held")
        time.sleep(0.3)  # hold it while the others look
    except ConfigError as e:
        results.put("refused" if "in use by another run" in str(e) else f"other: {e}")


def test_of_runs_racing_for_a_stale_lock_exactly_one_takes_it(tmp_path):
    # Eight processes released by a barrier on the same stale lock, twenty rounds: each round one
    # holds it and seven are refused naming it -- never two holders (the takeover used to let
    # about half the rounds end with two).
    import multiprocessing
    import socket

    ctx = multiprocessing.get_context("fork")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for attempt in range(20):
        out = tmp_path / f"run{attempt}"
        out.mkdir()
        (out / "hytrain.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                                      "started": 0}))
        barrier, results = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_race_for_the_lock, args=(out, barrier, results)) for _ in range(8)]
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        assert got == ["held"] + ["refused"] * 7, (attempt, got)


def _wait_steps(out, n, p, timeout=120):
    deadline = time.time() + timeout
    path = os.path.join(out, "metrics.jsonl")
    while time.time() < deadline and p.poll() is None:
        if os.path.exists(path) and len(open(path).read().splitlines()) >= n:
            return len(open(path).read().splitlines())
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} steps in {timeout} s")


def test_sigusr1_saves_and_goes_on_and_sighup_stops_saved(tmp_path, fast):
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--steps", "100000", "--eval-every", "0",
                          "--out", out, *fast], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_steps(out, 2, p)
        p.send_signal(signal.SIGUSR1)
        deadline = time.time() + 60
        while time.time() < deadline and not os.path.exists(os.path.join(out, "checkpoints", "latest")):
            time.sleep(0.1)
        saved = ckpt.verify(ckpt.resolve(out, "latest"))["step"]
        _wait_steps(out, saved + 2, p)  # training went on
        p.send_signal(signal.SIGHUP)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGHUP, stderr
    assert f"SIGUSR1 (a scheduler's warning): saving at step {saved}" in stdout
    last = metrics(out)[-1]["step"]
    assert saved < last and ckpt.verify(ckpt.resolve(out, "latest"))["step"] == last


def test_a_sigusr1_before_the_first_step_is_kept_for_it(tmp_path):
    """A warning that comes while the model is built is not lost (nor the process, by the signal's
    default action): the first step saves."""
    out = str(tmp_path / "run")
    # (The embedded default data: reading it keeps the run before its first step for a while.)
    p = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--steps", "3", "--eval-every", "0",
                          "--out", out, *FAST], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not os.path.exists(os.path.join(out, "config.json")) and p.poll() is None:
        time.sleep(0.02)
    p.send_signal(signal.SIGUSR1)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    assert "SIGUSR1" in stdout


def test_a_closed_stderr_does_not_stop_training(tmp_path, fast):
    out = tmp_path / "run"
    args = [a for a in fast if a != "--no-progress"]  # the progress bar writes to stderr
    cmd = (f"{sys.executable} -m hytrain train --steps 6 --eval-every 2 --out {out} {' '.join(args)} "
           "2>&1 >/dev/null | head -c 1")
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert metrics(str(out))[-1]["step"] == 6
    assert ckpt.resolve(out, "latest").name == "step_00000006"


def test_a_closed_stdout_does_not_stop_training(tmp_path, fast):
    out = tmp_path / "run"
    cmd = (f"{sys.executable} -m hytrain train --steps 6 --eval-every 2 --out {out} {' '.join(fast)} | head -c 1")
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert metrics(str(out))[-1]["step"] == 6
    assert ckpt.resolve(out, "latest").name == "step_00000006"


@pytest.mark.parametrize("extra,toml,message", [
    (["--device", "tpu"], None, "--device must be auto, cpu or cuda"),
    (["--pin-limit", "lots"], None, "--pin-limit must be a byte count"),
    (["--workers", "100000"], None, "--workers 100000 is more than 4 threads per core"),
    (["--seq-len", "20000000"], None, "--seq-len 20000000 is longer than the data allows"),
    ([], "lr = true", "lr must be a number, got True"),
    ([], "out = 5", "out must be a string, got 5"),
    ([], "resume = 5", "resume must be a string, got 5"),
    ([], "steps = true", "steps must be an integer, got True"),
    (["--gpu-blocks", "2"], None, "--gpu-blocks 2 needs CUDA (the blocks it updates on a GPU), and this run trains "
                                  "on the CPU (--device cpu): leave --gpu-blocks out, or pass --gpu-blocks 0"),
    ([], "gpu-blocks = 3", "--gpu-blocks 3 needs CUDA"),
    (["--max-data-bytes", "0"], None, "--max-data-bytes must be an integer >= 1, got 0"),
    (["--max-data-bytes", "1000"], None, "--max-data-bytes 1000 stopped the reading; raise it"),
])
def test_user_errors_are_one_line_with_exit_2(tmp_path, capsys, extra, toml, message):
    args = ["--out", str(tmp_path / "x"), *FAST, *extra]
    if toml is not None:
        cfg = tmp_path / "c.toml"
        cfg.write_text(toml + "\n")
        args = ["--config", str(cfg), *args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


@pytest.mark.parametrize("name, content, message", [
    ("c.yaml", b"lr: [1e-3\nsteps: 3\n", "not valid YAML at line"),
    ("c.yml", b"lr:\tbad: :\n", "not valid YAML"),
    ("c.toml", b"lr = = 3\n", "not valid TOML"),
    ("c.toml", b"lr = 1e-3 # caf\xe9\n", "not UTF-8 text"),
    ("c.yaml", b"\xff\xfe\x00l\x00r", "not UTF-8 text"),
    ("dir", None, "is a directory"),
])
def test_bad_config_files_are_one_line_with_exit_2(tmp_path, capsys, name, content, message):
    cfg = tmp_path / name
    if content is None:
        cfg.mkdir()
    else:
        cfg.write_bytes(content)
    assert main(["--config", str(cfg), "--out", str(tmp_path / "x"), *FAST]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("error, words", [
    ('OSError(errno.ENOSPC, "No space left on device", str(f))', "No space left on device"),
    # torch.save's own words when the disk fills under its zip writer (not an OSError)
    ('RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4461824 vs 4461712")',
     "unexpected pos 4461824"),
])
def test_a_full_disk_stops_the_run_with_the_last_good_checkpoint(tmp_path, error, words, fast):
    """The second save fails as on a full disk (an injected ENOSPC, or the writer's own error): the
    partial directory is removed, the message names the path and the bytes, the run stops (exit 2),
    and the first checkpoint is intact and resumable."""
    out = tmp_path / "run"
    code = textwrap.dedent(f"""
        import errno, sys, torch
        from hytrain.job import main
        real, calls = torch.save, [0]
        def save(obj, f, *a, **k):
            calls[0] += 1
            if calls[0] > 2:  # the first checkpoint's two torch.save calls go through
                raise {error}
            return real(obj, f, *a, **k)
        torch.save = save
        sys.exit(main(["--steps", "4", "--save-every", "2", "--eval-every", "0", "--out", {str(out)!r},
                       *{fast!r}]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr
    assert "step_00000004 failed: " in r.stderr and words in r.stderr and "GB needed" in r.stderr
    assert "the last good checkpoint, step_00000002, is kept" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    root = out / "checkpoints"
    assert not list(root.glob(".*.tmp"))
    assert ckpt.resolve(out, "latest").name == "step_00000002"
    ckpt.verify(root / "step_00000002")
    assert main(["--steps", "4", "--eval-every", "0", "--out", str(out), "--resume", "latest", *fast]) == 0


def test_a_disk_too_small_for_keep_plus_one_is_refused_at_start(tmp_path, capsys, monkeypatch):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1000))
    assert main(["--steps", "2", "--out", str(tmp_path / "x"), *FAST]) == 2
    err = capsys.readouterr().err
    assert "--keep 2 (3 checkpoints" in err and "GB free" in err, err


def test_an_unknown_model_is_refused_at_once_without_a_network(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    assert main(["--model", "no-such-org/no-such-model", "--steps", "1", "--out", str(tmp_path / "x"), *FAST]) == 2
    err = capsys.readouterr().err
    assert time.time() - t0 < 20 and "is neither a preset" in err and err.count("\n") == 1, err


def test_a_model_the_host_cannot_hold_is_one_line(tmp_path, capsys, monkeypatch):
    from hytrain.hybrid import budgets

    monkeypatch.setattr(budgets, "available_memory_bytes", lambda: 1 << 20)
    assert main(["--steps", "2", "--out", str(tmp_path / "x"), *FAST]) == 2
    err = capsys.readouterr().err
    assert "of pinned host memory" in err and "1.00 MiB" in err and err.count("\n") == 1, err


def test_a_full_disk_leaves_no_write_probe(tmp_path, capsys, monkeypatch):
    import errno
    import pathlib

    write_text = pathlib.Path.write_text

    def full(self, *a, **kw):  # as on a full disk: the file is created, nothing fits in it
        if self.name.startswith(".write-test"):
            self.touch()
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    out = tmp_path / "full"
    assert main(["--out", str(out), *FAST]) == 2
    assert "cannot write to the output directory" in capsys.readouterr().err
    assert not out.exists()  # no write probe left in it: made by the run and left empty, it is removed
    out.mkdir()
    assert main(["--out", str(out), *FAST]) == 2
    assert list(out.iterdir()) == []  # (one the run did not make stays)


def test_a_refused_run_leaves_no_out_directory_it_made_empty(tmp_path, capsys):
    made = tmp_path / "new" / "run"
    assert main(["--data", str(tmp_path / "missing.txt"), "--out", str(made), *FAST]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nor the parent made for it
    mine = tmp_path / "mine"
    mine.mkdir()
    assert main(["--data", str(tmp_path / "missing.txt"), "--out", str(mine), *FAST]) == 2
    assert mine.is_dir() and list(mine.iterdir()) == []  # an --out that was there stays


def test_out_naming_a_file_is_refused_in_one_line(tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    assert main(["--out", str(blocker), *FAST]) == 2
    err = capsys.readouterr().err
    assert err == f"hytrain train: error: --out {blocker} names a file, not a directory: give --out a directory " \
                  "(new, or a run's)\n", err
    assert blocker.read_text() == "mine"


def test_the_progress_and_the_summary_say_which_tokens_per_s_they_are(tmp_path, capsys, fast):
    out = tmp_path / "run"
    assert main(["--steps", "4", "--eval-every", "2", "--no-export", "--out", str(out), *fast]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[1].startswith("step 2: loss ") and said[1].endswith(" tokens/s in this step"), said
    summary = json.load(open(out / "summary.json"))
    steps = [r["tokens_per_s"] for r in metrics(str(out))]
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens"] / summary["train_loop_s"])
    assert summary["step_tokens_per_s"] == pytest.approx(statistics.median(steps))
    line = next(ln for ln in said if ln.startswith("hytrain train: ") and "over the run" in ln)
    assert line.startswith(f"hytrain train: {summary['tokens_per_s']:.0f} tokens/s over the run (1024 tokens in "), line
    assert "first step to last: the first step's set-up, validation and saves included" in line, line
    assert f"; {summary['step_tokens_per_s']:.0f} tokens/s in a step alone (the median step_tok_s)" in line, line
    assert said[-1] == json.dumps(summary)
    bar = [a for a in fast if a != "--no-progress"]  # the progress bar's figure is the step's own
    assert main(["--steps", "2", "--eval-every", "0", "--no-export", "--out", str(tmp_path / "bar"), *bar]) == 0
    err = capsys.readouterr().err
    assert "step_tok_s=" in err and "tok_s=" not in err.replace("step_tok_s=", ""), err


def test_resume_auto_starts_fresh_then_continues(tmp_path, capsys, fast):
    """A batch script a scheduler requeues runs one command: ``--resume auto`` starts afresh where --out
    has no checkpoint and continues from the last one where it has."""
    out = str(tmp_path / "run")
    assert main(["--steps", "2", "--eval-every", "0", "--out", out, "--resume", "auto", *fast]) == 0
    capsys.readouterr()
    assert main(["--steps", "4", "--eval-every", "0", "--out", out, "--resume", "auto", *fast]) == 0
    assert "at step 2" in capsys.readouterr().out and [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


@pytest.mark.parametrize("flags", [["--lr", "1e9", "--warmup", "0"], ["--weight-decay", "3e3"]],
                         ids=["lr", "weight_decay"])
def test_a_diverging_run_is_one_line_and_keeps_its_last_good_checkpoint(tmp_path, flags, fast):
    out = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "-m", "hytrain", "train", "--steps", "40", "--eval-every", "0",
                        "--save-every", "1", "--out", out, *fast, *flags], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "training diverged at step" in lines[0] and "lower --lr" in lines[0], r.stderr
    if "no checkpoint was saved" not in lines[0]:
        saved = ckpt.verify(ckpt.resolve(out, "latest"))["step"]
        assert f"step_{saved:08d}" in lines[0]
        diverged = int(lines[0].split("training diverged at step ")[1].split(":")[0])
        assert saved < diverged


def test_pruning_keeps_the_newest_checkpoints_that_verify(tmp_path, fast):
    """--keep counts only checkpoints that verify: a damaged one among the newest is not kept in place
    of an older good one."""
    out = tmp_path / "run"
    assert main(["--steps", "3", "--eval-every", "0", "--save-every", "1", "--keep", "3", "--out", str(out),
                 *fast]) == 0
    done = ckpt.complete_checkpoints(out)
    assert [d.name for d in done] == ["step_00000001", "step_00000002", "step_00000003"]
    victim = max((f for f in done[1].iterdir() if f.name != "meta.json"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte, size unchanged
    victim.write_bytes(bytes(data))
    assert ckpt._pruned(done, done[2], keep=2) == []  # good step 1 stays; the damaged step 2 is left alone
    assert ckpt._pruned(done, done[2], keep=1) == [done[0], done[1]]  # (older than the newest good one)


def test_a_resume_takes_changed_options_and_refuses_fixed_ones(tmp_path, capsys, fast):
    """--lr, --weight-decay, --steps... given on a resume take effect from the resume point, said once,
    and are what config.json records; options not given are the checkpoint's (not the defaults); a
    model-shaping option that differs is refused in one line."""
    out = str(tmp_path / "run")

    def job(*extra):
        return main(["--eval-every", "0", "--out", out, *fast, *extra])

    assert job("--steps", "6", "--save-every", "3", "--lr", "2e-3", "--warmup", "2") == 0
    capsys.readouterr()
    assert job("--steps", "8", "--resume", "latest", "--lr", "1e-2", "--weight-decay", "0.05") == 0
    said = capsys.readouterr().out
    assert said.count("from step 7: --lr 0.002 -> 0.01, --weight-decay 0.1 -> 0.05, --steps 6 -> 8") == 1, said
    rows = metrics(out)
    warm, steps = 2, 8  # the schedule of the resumed run: warm-up 2 (the checkpoint's), 8 steps, peak 1e-2
    frac = (7 - warm) / (steps - warm)
    want = 1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
    assert rows[6]["step"] == 7 and rows[6]["lr"] == pytest.approx(want, rel=1e-6)
    options = json.loads((tmp_path / "run" / "config.json").read_text())["options"]
    assert options["lr"] == 1e-2 and options["weight_decay"] == 0.05 and options["warmup"] == 2
    assert job("--steps", "9", "--resume", "latest") == 0  # nothing given: the checkpoint's values, not the defaults
    frac = (9 - warm) / (9 - warm)
    assert metrics(out)[-1]["lr"] == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))), rel=1e-6)
    bad = subprocess.run([sys.executable, "-m", "hytrain", "train", "--steps", "10", "--resume", "latest", "--out",
                          out, "--seq-len", "32", *[a for a in fast if a not in ("--seq-len", "64")]],
                         capture_output=True, text=True, timeout=180)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--seq-len 32 differs" in bad.stderr, bad.stderr


def test_a_resume_without_precision_keeps_the_checkpoints(tmp_path, fast):
    # --precision is fixed under a checkpoint: left out on a resume, the run goes on in the
    # checkpoint's (bf16 here, where the CPU's default is fp32), bit for bit with the run it continues.
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    args = ["--eval-every", "0", "--save-every", "2", *fast]
    assert main(["--steps", "4", "--out", whole, "--precision", "bf16", *args]) == 0
    assert main(["--steps", "2", "--out", part, "--precision", "bf16", *args]) == 0
    assert main(["--steps", "4", "--out", part, "--resume", "latest", *args]) == 0
    assert [r["loss"] for r in metrics(part)] == [r["loss"] for r in metrics(whole)]
    weights = load_file(os.path.join(str(ckpt.resolve(part, "latest")), "model.safetensors"))
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}


def test_fp16_weights_train_with_dynamic_loss_scaling_and_resume_with_the_scale(tmp_path, monkeypatch, fast):
    # --precision fp16: torch's GradScaler drives HybridAdamW (a step whose gradients overflow is
    # skipped and the scale halves); the scale goes into the checkpoint and a resume goes on with it.
    # A GradScaler starting at 2^30 overflows fp16 gradients at once: the first steps are skipped.
    real = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device: real(device, init_scale=2.0 ** 30))
    args = ["--precision", "fp16", "--eval-every", "0", "--save-every", "4", *fast]
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    assert main(["--steps", "8", "--out", whole, *args]) == 0
    assert main(["--steps", "4", "--out", part, *args]) == 0
    assert main(["--steps", "8", "--out", part, "--resume", "latest", *args]) == 0
    rows = metrics(whole)
    scales = [r["loss_scale"] for r in rows]
    assert scales[0] == 2.0 ** 29 and scales[-1] < 2.0 ** 29, scales  # backed off, then held
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert [(r["loss"], r["loss_scale"]) for r in metrics(part)] == [(r["loss"], r["loss_scale"]) for r in rows]


def test_without_transformers_the_run_trains_and_says_why_no_model_dir(tmp_path, capsys, monkeypatch, fast):
    # A plain `pip install .` has no transformers: the README's first command trains the embedded default
    # and must end well, saying in one line why OUT/model was not written and how to write it later
    # (it ended in a traceback); `hytrain export` refuses in one line.
    from hytrain.__main__ import main as cli

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    out = tmp_path / "run"
    assert main(["--steps", "3", "--eval-every", "0", "--out", str(out), *fast]) == 0
    said = capsys.readouterr().out
    line = next(x for x in said.splitlines() if "not written" in x)
    assert f"{out / 'model'} not written: writing a Hugging Face model directory needs transformers" in line
    assert "pip install 'hytrain[hf]'" in line and f"`hytrain export {out} --to DIR`" in line
    assert not (out / "model").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert "model_dir" not in summary and "export_error" not in summary
    assert cli(["export", str(out), "--to", str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs transformers" in err[0], err
