"""What a newcomer reads first: ``--help`` (every default shown, plain text, a description for each
command), the learning rate's default by the kind of model (pre-training for a preset, fine-tuning for
a pretrained checkpoint), the warning of a build without CUDA on a machine with a GPU, and a command
refused under ``--nproc`` saying one line (no torchrun command, no warning of Python's)."""

import argparse
import re
import subprocess
import sys

import pytest
import torch

import hytrain
from hytrain.__main__ import main as hytrain_main
from hytrain.job import main as train_main
from hytrain.job.options import FINE_TUNING_LR, PRETRAINING_LR, add_arguments, job_notes, resolve_options
from test_distributed import _env

MARKUP = re.compile(r"``|`|:(class|mod|func|meth|attr|obj|data|exc):")


def _help(fn, argv, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def _entries(text: str) -> dict:
    """The options of a help text: the first flag of each entry -> the entry's text."""
    entries, name = {}, None
    for line in text.splitlines():
        m = re.match(r"  (-[-\w]+)", line)
        if m:
            name = m.group(1)
            entries[name] = line
        elif name is not None and line.startswith("   "):
            entries[name] += " " + line.strip()
        else:
            name = None
    return entries


def test_train_help_shows_every_default(capsys, monkeypatch):
    text = _help(train_main, ["--help"], capsys, monkeypatch)
    entries = _entries(text)
    assert len(entries) > 30 and "--lr" in entries and "--timeout" in entries, sorted(entries)
    missing = [name for name, entry in entries.items() if name != "-h" and "default" not in entry.lower()]
    assert not missing, missing
    assert "(default: 16)" in entries["--batch-size"] and "(default: tiny)" in entries["--model"]
    assert "(default: auto)" in entries["--gpu-blocks"]
    lr = " ".join(entries["--lr"].split())
    assert f"{PRETRAINING_LR:g} for a preset" in lr and f"{FINE_TUNING_LR:g} for a pretrained" in lr, lr


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["info", "--help"], ["verify", "--help"],
                                  ["export", "--help"]])
def test_no_markup_in_any_help(argv, capsys, monkeypatch):
    text = _help(hytrain_main, argv, capsys, monkeypatch)
    assert text.startswith("usage: hytrain")
    found = MARKUP.search(text)
    assert found is None, text[max(0, found.start() - 200):found.end() + 100]


@pytest.mark.parametrize("command, words", [("verify", "Checks a checkpoint offline"),
                                            ("export", "as a Hugging Face model directory")])
def test_export_and_verify_have_a_description(command, words, capsys, monkeypatch):
    text = _help(hytrain_main, [command, "--help"], capsys, monkeypatch)
    description = text.split("\n\n")[1]  # between the usage and the arguments
    assert not description.startswith(("positional arguments", "options")), text
    assert words in " ".join(description.split()), description


def _options(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve_options(p, argv)


def test_the_lr_default_follows_the_kind_of_model(tmp_path):
    pytest.importorskip("transformers")  # (a model other than a preset needs it)
    model = str(tmp_path / "Llama-hf")  # a pretrained checkpoint's directory (read later, by the job)
    assert _options([]).lr == PRETRAINING_LR == 3e-3
    assert _options(["--model", "small"]).lr == PRETRAINING_LR
    assert _options(["--model", model]).lr == FINE_TUNING_LR == 2e-5
    assert _options(["--model", model, "--init", "random"]).lr == PRETRAINING_LR  # from its config: pre-training
    assert _options(["--model", model, "--lr", "1e-4"]).lr == 1e-4  # an explicit --lr wins
    assert _options(["--model", "tiny", "--lr", "1e-4"]).lr == 1e-4
    config = tmp_path / "run.toml"
    config.write_text("lr = 5e-5\n")
    assert _options(["--config", str(config), "--model", model]).lr == 5e-5  # a config file's too
    args = _options(["--model", model])
    assert "lr" not in args.given
    notes = [line for line, warning in job_notes(args) if not warning]
    assert notes == ["hytrain train: lr 2e-05 (the fine-tuning default for a pretrained model; --lr to change)"]
    assert not [n for n in job_notes(_options(["--model", model, "--lr", "2e-5"])) if "lr" in n[0]]
    assert not [n for n in job_notes(_options([])) if "lr" in n[0]]


def test_a_refused_fine_tuning_job_says_its_error_line_only(tmp_path, capsys):
    pytest.importorskip("transformers")
    missing = tmp_path / "Llama-hf"  # the job fails to read the model: exit 2, its lr default not said
    assert train_main(["--model", str(missing), "--out", str(tmp_path / "run"), "--device", "cpu",
                       "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "", out  # (the notes come once nothing can refuse the run: test_hf_io, a run that goes)
    assert "error" in err and err.count("\n") == 1, err


def _gpu_and_build(monkeypatch, gpu: bool, cuda):
    info = dict(hytrain.build_info(), cuda=cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(hytrain, "build_info", lambda: dict(info))


@pytest.mark.parametrize("gpu, cuda, device, warned", [
    (True, None, "auto", True),  # a GPU, a CPU-only build: the job would train on the CPU without a word
    (True, "12.4", "auto", False),  # a CUDA build
    (False, None, "auto", False),  # no GPU: the CPU is all there is
    (True, None, "cpu", False),  # the CPU asked for
])
def test_a_build_without_cuda_on_a_gpu_machine_is_said_once(monkeypatch, gpu, cuda, device, warned):
    _gpu_and_build(monkeypatch, gpu, cuda)
    warnings = [line for line, warning in job_notes(_options(["--device", device])) if warning]
    if not warned:
        assert warnings == []
        return
    assert len(warnings) == 1
    line = warnings[0]
    assert line.startswith("hytrain train: warning:") and "\n" not in line
    assert "without CUDA" in line and "on the CPU" in line and "nvcc on PATH" in line and "pip install ." in line


def test_the_job_warns_on_stderr_once_nothing_can_refuse_it(tmp_path, corpus, capsys, monkeypatch):
    _gpu_and_build(monkeypatch, True, None)
    assert train_main(["--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "run"),
                       "--no-progress"]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()  # a refused run: its error line only
    assert len(lines) == 1 and lines[0].startswith("hytrain train: error:") and "missing.txt" in lines[0], err
    assert "warning" not in out
    assert train_main(["--data", corpus, "--steps", "1", "--eval-every", "0", "--batch-size", "2", "--seq-len", "32",
                       "--workers", "1", "--out", str(tmp_path / "ok"), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if line.startswith("hytrain train: warning:")]
    assert len(warnings) == 1 and "nvcc" in warnings[0] and "warning" not in out, err


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("verbose", [False, True])
def test_a_command_refused_under_nproc_says_one_line(tmp_path, verbose):
    """Every rank refuses it: stderr holds its one error line (no warning of Python's runpy about a module
    run twice, no traceback), and stdout the torchrun command only with --verbose."""
    argv = ["--nproc", "2", "--steps", "2", "--out", str(tmp_path / "x"), "--resume", str(tmp_path / "none"),
            "--batch-size", "4", "--seq-len", "32", "--no-progress", "--device", "cpu", "--workers", "1",
            *(["--verbose"] if verbose else [])]
    proc = subprocess.run([sys.executable, "-m", "hytrain", "train", *argv], capture_output=True, text=True,
                          timeout=300, env=_env())
    assert proc.returncode == 2, proc.stderr[-4000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hytrain train: error:") and "does not exist" in lines[0], \
        proc.stderr[-4000:]
    if verbose:
        assert proc.stdout.startswith("hytrain train: -m torch.distributed.run --nproc-per-node 2"), proc.stdout
        assert len(proc.stdout.splitlines()) == 1
    else:
        assert proc.stdout == ""


def test_the_rdzv_id_help_says_what_the_launcher_does_with_it(capsys, monkeypatch):
    from hytrain.job.plan import RunPlan
    from hytrain.job.ranks import torchrun_command

    entry = " ".join(_entries(_help(train_main, ["--help"], capsys, monkeypatch))["--rdzv-id"].split())
    assert "with --rdzv-endpoint, the same on every node (default: hytrain)" in entry, entry
    assert "without --rdzv-endpoint (one node) it is not used: each launch draws an id of its own" in entry, entry

    def rdzv_id(argv):
        cmd = torchrun_command(RunPlan.from_options(vars(_options(argv))).process, argv, 2)
        return cmd[cmd.index("--rdzv-id") + 1]

    assert rdzv_id(["--rdzv-endpoint", "node0:29400"]) == "hytrain"  # the default, with an endpoint
    assert rdzv_id(["--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7"]) == "job7"
    one, again = rdzv_id([]), rdzv_id(["--rdzv-id", "job7"])  # one node: a fresh id each launch, the flag unused
    assert re.fullmatch(r"[0-9a-f]{32}", one) and re.fullmatch(r"[0-9a-f]{32}", again) and one != again


@pytest.mark.parametrize("gpu, cuda, argv, refused", [
    (False, None, ["--gpu-blocks", "2"], "no usable GPU, or hytrain built without CUDA"),  # auto: the CPU
    (True, None, ["--gpu-blocks", "2"], "no usable GPU, or hytrain built without CUDA"),  # a CPU-only build
    (True, "12.4", ["--gpu-blocks", "2", "--device", "cpu"], "--device cpu"),
    (True, "12.4", ["--gpu-blocks", "2"], None),  # a GPU it can use
    (False, None, ["--gpu-blocks", "0"], None),
    (False, None, ["--gpu-blocks", "auto"], None),
])
def test_gpu_blocks_above_0_without_cuda_is_refused_before_anything_is_built(monkeypatch, gpu, cuda, argv, refused):
    from hytrain.job.options import ConfigError

    _gpu_and_build(monkeypatch, gpu, cuda)
    monkeypatch.setattr(hytrain, "cuda_available", lambda: cuda is not None)
    if refused is None:
        _options(argv)
        return
    with pytest.raises(ConfigError) as e:
        _options(argv)
    assert str(e.value) == (f"--gpu-blocks 2 needs CUDA (the blocks it updates on a GPU), and this run trains on the "
                            f"CPU ({refused}): leave --gpu-blocks out, or pass --gpu-blocks 0")


def test_gpu_blocks_a_checkpoint_carries_is_kept_on_the_cpu_not_refused():
    # A GPU run's checkpoint records --gpu-blocks 2; its resume on a CPU machine, which does not give
    # --gpu-blocks, takes it (unused there) rather than being refused.
    from hytrain.job.options import check_options

    args = _options(["--device", "cpu"])
    args.gpu_blocks = 2  # (as the resumed plan's, from the checkpoint)
    check_options(args)
    args.given = [*args.given, "gpu_blocks"]
    with pytest.raises(Exception, match="--gpu-blocks 2 needs CUDA"):
        check_options(args)


def test_counts_of_one_are_singular():
    from hytrain.job.options import counted

    assert [counted(1, "process", "processes"), counted(2, "process", "processes"), counted(1, "held-out file"),
            counted(3, "held-out file"), counted(0, "row")] == \
        ["1 process", "2 processes", "1 held-out file", "3 held-out files", "0 rows"]
