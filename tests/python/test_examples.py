"""Every script in examples/ runs as a user would run it (a subprocess, from the repository root) and
exits 0 without a warning; each asserts its own outcome (the model learned, the model loads). Those
that need an optional package skip without it. The Slurm script cannot run here: its syntax is
checked, its #SBATCH lines must come before its first command (Slurm reads no further), and every
`hytrain train` option it uses must be accepted by the job's own parser. A new file in examples/ fails
the last test until a test here runs it.

What the examples train is next-token prediction: `model(x, x)` with the labels shifted inside the
model. A loss that fell proves nothing about that (a model scored against the tokens it is given
learns to copy them, and its loss falls further), so the examples print the next-token loss on unseen
rows of a Markov chain (examples/_data.py), from the logits, and it must be below the unigram baseline
(the entropy of the token frequencies; streamed_model.py checks instead that streamed and resident
training agree bit for bit); and both models (the decoder and the transformers wrapper the
job uses), trained by `model(x, x)` on random tokens, must leave their own held-out loss near ln V,
where there is nothing to learn."""

import argparse
import math
import os
import re
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
# (_data.py: the examples' data and held-out check, which they import and so run)
COVERED = {*PYTHON_EXAMPLES, "fsdp2_torchrun.py", "finetune.sh", "slurm.sbatch", "_data.py"}
# the examples that print their held-out next-token loss
LEARNS_NEXT_TOKEN = {"plain_loop.py", "accelerate_loop.py", "lightning_module.py", "fsdp2_torchrun.py", "trainer.py"}
HELD_OUT = re.compile(r"held-out next-token loss ([0-9.]+), unigram baseline ([0-9.]+)")
# A warning as Python prints it ("path:line: Category: message"; Lightning's without the category), or
# as transformers logs it.
WARNING = re.compile(r"^(\S+\.py:\d+: .*|\[transformers\] .*)$", re.M)
# Warnings a library gives about its own code, whatever the example does: Lightning's use of torch's
# pytree, deprecated in recent torch.
NOT_THE_EXAMPLES = ("`isinstance(treespec, LeafSpec)` is deprecated",)


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


def assert_no_warning(stderr):
    found = [w for w in WARNING.findall(stderr) if not any(text in w for text in NOT_THE_EXAMPLES)]
    assert not found, "\n".join(found)


def assert_learned_next_token(stdout):
    """The example's held-out next-token loss (from the logits: position t against token t + 1) is
    below the unigram baseline of its data: it learned what comes next, not only how often each token
    occurs (a model trained to copy its input stays at or above the baseline)."""
    found = HELD_OUT.findall(stdout)
    assert found, f"no held-out next-token loss printed:\n{stdout[-2000:]}"
    for held, unigram in found:
        assert float(held) < float(unigram) - 0.3, stdout[-2000:]


@pytest.mark.parametrize("name", sorted(PYTHON_EXAMPLES))
def test_python_example(name):
    for package in PYTHON_EXAMPLES[name]:
        pytest.importorskip(package)
    proc = run(sys.executable, EXAMPLES / name)
    assert_no_warning(proc.stderr)
    if name in LEARNS_NEXT_TOKEN:
        assert_learned_next_token(proc.stdout)


def test_fsdp2_torchrun(tmp_path):
    """Two processes with a sharded checkpoint at step 40, then two more that resume from it."""
    import torch

    if not torch.distributed.is_available():
        pytest.skip("needs torch.distributed")
    # The example takes one GPU a process: with fewer than two, two CPU processes.
    env = {"CUDA_VISIBLE_DEVICES": ""} if torch.cuda.is_available() and torch.cuda.device_count() < 2 else {}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                EXAMPLES / "fsdp2_torchrun.py", "--out", tmp_path]
    first = run(*torchrun, "--steps", "40", retry_gloo_abort=True, **env)
    assert_no_warning(first.stderr)
    assert_learned_next_token(first.stdout)
    assert (tmp_path / "checkpoints" / "step_00000040").is_dir() and (tmp_path / "model.safetensors").is_file()
    resumed = run(*torchrun, "--steps", "44", "--resume", tmp_path / "checkpoints" / "step_00000040",
                  retry_gloo_abort=True, **env)
    assert "resumed from step 40" in resumed.stdout
    assert_learned_next_token(resumed.stdout)


def test_finetune_sh(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    if shutil.which("hytrain") is None:
        pytest.skip("the hytrain command is not installed")
    proc = run("bash", EXAMPLES / "finetune.sh", tmp_path / "work")
    # What the fine-tuned model says after the prompt: what its data taught it (after 4 steps on words
    # drawn at random it was spaces, the data's commonest token).
    said = re.search(r"^generated: the quick brown(.*)$", proc.stdout, re.M)
    assert said and said.group(1).strip(), proc.stdout
    assert said.group(1).split()[:3] == ["fox", "jumps", "over"], said.group(0)
    assert "\n\n" not in proc.stdout, proc.stdout  # (a progress bar's blank lines, once)
    assert_no_warning(proc.stderr)
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


# ---- the models' objective: `model(x, x)` is next-token prediction ----------------------------------

VOCAB, SEQ = 64, 32


def tiny_model(kind):
    """The project's decoder, or a transformers Llama in the wrapper the job trains it in."""
    import torch

    torch.manual_seed(0)
    if kind == "decoder":
        from hytrain.models import LlamaConfig, LlamaModel

        return LlamaModel(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                                      num_heads=4, num_kv_heads=2, max_seq_len=SEQ))
    transformers = pytest.importorskip("transformers")
    from hytrain.models.presets import CausalLM

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return CausalLM(transformers.LlamaForCausalLM(cfg))


def markov_rows(n, seed):
    """Rows of a Markov chain over token ids 0..15, each followed by one of 4 (a fixed table)."""
    import torch

    followers = torch.randint(0, 16, (16, 4), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    cols = [torch.randint(0, 16, (n,), generator=g)]
    while len(cols) < SEQ:
        cols.append(followers[cols[-1], torch.randint(0, 4, (n,), generator=g)])
    return torch.stack(cols, dim=1)


def random_rows(n, seed):
    import torch

    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def train_on(model, rows, steps=40):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    seen = []
    for step in range(steps):
        x = rows(8, seed=step)
        model(x, x).backward()  # as the examples, the README and usage.md train
        opt.step()
        opt.zero_grad()
        seen.append(x)
    return torch.cat(seen)


@pytest.mark.parametrize("kind", ["decoder", "transformers"])
def test_labels_are_shifted_inside_the_model(kind):
    """`model(x, labels)` is the cross-entropy of the logits at position t against labels[t + 1],
    labels of -100 left out (the transformers wrapper: exactly transformers' own loss)."""
    import torch
    import torch.nn.functional as F

    model = tiny_model(kind)
    x = random_rows(3, seed=1)
    labels = x.clone()
    labels[0, 5:9] = -100
    logits = model(x)
    assert logits.shape == (3, SEQ, VOCAB)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(model(x, labels), expected, rtol=1e-6, atol=1e-6)
    unshifted = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    assert not torch.allclose(model(x, labels), unshifted, rtol=1e-4, atol=1e-4)
    if kind == "transformers":
        assert torch.allclose(model(x, labels), model.inner(input_ids=x, labels=labels).loss, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="aligned with the tokens"):
        model(x, x[:, 1:])  # targets shifted by the caller: refused, not shifted a second time


@pytest.mark.parametrize("kind", ["decoder", "transformers"])
def test_trained_by_model_x_x_it_learns_what_comes_next(kind):
    """On a Markov chain, the held-out next-token loss (from the logits alone) falls below the unigram
    baseline; a model scored against the tokens it is given would learn to copy them and stay above it."""
    import torch
    import torch.nn.functional as F

    model = tiny_model(kind)
    seen = train_on(model, markov_rows)
    p = torch.bincount(seen.flatten()).double() / seen.numel()
    unigram = float(-(p[p > 0] * p[p > 0].log()).sum())
    rows = markov_rows(32, seed=10_000)
    with torch.no_grad():
        logits = model(rows)
        held = float(F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), rows[:, 1:].reshape(-1)))
        assert float(model(rows, rows)) == pytest.approx(held, rel=1e-5)  # its own loss is that one
    assert held < unigram - 0.3, (held, unigram)


@pytest.mark.parametrize("kind", ["decoder", "transformers"])
def test_on_random_tokens_the_held_out_loss_stays_near_ln_v(kind):
    """Random tokens hold nothing to learn: trained by `model(x, x)`, the model's own loss on unseen
    rows stays near ln V. (Scored against its input, it would copy and fall far below.)"""
    import torch

    model = tiny_model(kind)
    train_on(model, random_rows)
    rows = random_rows(32, seed=10_000)
    with torch.no_grad():
        held = float(model(rows, rows))
    assert math.log(VOCAB) - 0.3 < held < math.log(VOCAB) + 0.5, (held, math.log(VOCAB))
