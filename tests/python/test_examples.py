"""Every script in examples/ runs as a user would run it (a subprocess, from the repository root) and
exits 0; each asserts its own outcome (the loss fell, the model loads). Those that need an optional
package skip without it. The Slurm script cannot run here: its syntax is checked, its #SBATCH lines
must come before its first command (Slurm reads no further), and every `hytrain train` option it uses
must be accepted by the job's own parser. A new file in examples/ fails the last test until a test
here runs it."""

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_distributed import _env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.timeout(600)  # each process started has its own, tighter limit

# example -> the optional packages it needs
PYTHON_EXAMPLES = {
    "plain_loop.py": (),
    "trainer.py": ("transformers",),
    "accelerate_loop.py": ("accelerate",),
    "lightning_module.py": ("lightning",),
    "streamed_model.py": ("transformers",),
}
COVERED = {*PYTHON_EXAMPLES, "fsdp2_torchrun.py", "finetune.sh", "slurm.sbatch"}


def run(*cmd, timeout=300, retry_gloo_abort=False, **env_vars):
    env = {**_env(), **env_vars}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # this python first
    for _ in range(2):
        proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        # A gloo process can abort in its teardown on a loaded 2-core machine (as in test_distributed).
        if not (retry_gloo_abort and proc.returncode != 0
                and "terminate called without an active exception" in proc.stderr):
            break
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}: exit {proc.returncode}\n" \
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


@pytest.mark.parametrize("name", sorted(PYTHON_EXAMPLES))
def test_python_example(name):
    for package in PYTHON_EXAMPLES[name]:
        pytest.importorskip(package)
    run(sys.executable, EXAMPLES / name)


def test_fsdp2_torchrun(tmp_path):
    """Two processes with a sharded checkpoint at step 10, then two more that resume from it."""
    import torch

    if not torch.distributed.is_available():
        pytest.skip("needs torch.distributed")
    # The example takes one GPU a process: with fewer than two, two CPU processes.
    env = {"CUDA_VISIBLE_DEVICES": ""} if torch.cuda.is_available() and torch.cuda.device_count() < 2 else {}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                EXAMPLES / "fsdp2_torchrun.py", "--out", tmp_path]
    run(*torchrun, "--steps", "10", retry_gloo_abort=True, **env)
    assert (tmp_path / "checkpoints" / "step_00000010").is_dir() and (tmp_path / "model.safetensors").is_file()
    resumed = run(*torchrun, "--steps", "14", "--resume", tmp_path / "checkpoints" / "step_00000010",
                  retry_gloo_abort=True, **env)
    assert "resumed from step 10" in resumed.stdout


def test_finetune_sh(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    if shutil.which("hytrain") is None:
        pytest.skip("the hytrain command is not installed")
    proc = run("bash", EXAMPLES / "finetune.sh", tmp_path / "work")
    assert "generated: the quick brown" in proc.stdout
    assert (tmp_path / "work" / "run" / "model" / "config.json").is_file()


def test_slurm_sbatch_is_valid():
    from hytrain.job.options import add_arguments, resolve_options

    script = EXAMPLES / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    lines = script.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    directives = " ".join(line for line in lines if line.startswith("#SBATCH"))
    assert not any(line.startswith("#SBATCH") for line in lines[first_command:]), "Slurm ignores these"
    assert "--requeue" in directives and "--signal=USR1@" in directives  # the job step gets the warning

    jobs = [shlex.split(cmd) for cmd in script.read_text().replace("\\\n", " ").splitlines()
            if "hytrain train" in cmd and not cmd.startswith("#")]
    assert jobs
    for words in jobs:
        argv = words[words.index("hytrain") + 2:]
        parser = argparse.ArgumentParser(prog="hytrain train")
        add_arguments(parser)
        args = resolve_options(parser, argv)  # an unknown option or bad value exits 2 (fails the test)
        assert args.resume == "auto"


def test_every_example_is_run_by_a_test():
    present = {p.name for p in EXAMPLES.iterdir() if p.is_file()}
    assert present == COVERED, f"not run by any test: {sorted(present - COVERED)}; " \
                               f"missing: {sorted(COVERED - present)}"
