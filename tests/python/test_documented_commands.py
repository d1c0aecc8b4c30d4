"""The commands README.md and docs/usage.md give run as written: every `hytrain ...` command in their
fenced shell blocks (`hytrain ...`, `python -m hytrain ...`, `torchrun ... -m hytrain ...`, after
environment assignments or `srun`; continued lines joined) is parsed by hytrain's own parsers and the
checks the job makes before it reads anything, so an unknown flag, a bad choice or a bad value fails
here; no command in those blocks is left unfinished (`...`); and each TOML block is a config file the
job accepts. The last tests feed the checker wrong commands: each must be refused."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

import hytrain.__main__ as cli
from hytrain.job import options

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/usage.md")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELL = {"bash", "sh", "shell", "console"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
LAUNCHERS = {"srun", "mpirun", "exec", "nohup", "time", "env"}  # a command that runs the command after it
OPERATORS = {"&&", "||", ";", "|", "&"}


def blocks(text: str, kinds: set[str]):
    """(line number of its first line, body) of each fenced block whose language is one of kinds."""
    for m in FENCE.finditer(text):
        if m.group(1) in kinds:
            yield text.count("\n", 0, m.start(2)) + 1, m.group(2)


def commands(text: str):
    """(line number, source, words) of each simple command in the shell blocks of a markdown text:
    continued lines joined, comments dropped, split at && || ; | &."""
    for first, body in blocks(text, SHELL):
        lines, start, joined = body.splitlines(), None, ""
        for n, line in enumerate(lines, first):
            start = n if start is None else start
            if line.endswith("\\"):
                joined += line[:-1] + " "
                continue
            joined += line
            lexer = shlex.shlex(joined, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            try:
                words = list(lexer)
            except ValueError as e:  # an unclosed quote
                raise ValueError(f"line {start}: {e}: {joined}") from None
            command = []
            for word in [*words, ";"]:
                if word in OPERATORS:
                    if command:
                        yield start, " ".join(joined.split()), command
                    command = []
                else:
                    command.append(word)
            start, joined = None, ""


def hytrain_argv(words: list[str]) -> list[str] | None:
    """The arguments hytrain's command line gets from a command, or None where it does not run hytrain."""
    while words and ASSIGNMENT.match(words[0]):  # CUDA_VISIBLE_DEVICES=0 hytrain ...
        words = words[1:]
    for i in range(len(words) - 1):  # python -m hytrain ..., torchrun ... -m hytrain ...
        if words[i] == "-m" and words[i + 1] == "hytrain":
            return words[i + 2:]
    if words and (words[0] == "hytrain" or words[0] in LAUNCHERS and "hytrain" in words):
        return words[words.index("hytrain") + 1:]
    return None


def parse(argv: list[str]) -> argparse.Namespace:
    """argv as `hytrain` parses it, and as the job checks its options before it reads anything; raises
    SystemExit (argparse's exit, 0 for --help) or ConfigError."""
    if argv[:1] == ["train"]:
        parser = argparse.ArgumentParser(prog="hytrain train")
        options.add_arguments(parser)  # what hytrain.job.loop.main parses with
        args = parser.parse_args(argv[1:])
        args.lr = options.PRETRAINING_LR if args.lr is None else args.lr
        with pytest.MonkeyPatch.context() as mp:  # (a model directory needs transformers only to be read)
            mp.setattr(options, "_transformers_available", lambda: True)
            options.check_options(args)
        return args
    parsed = []
    with pytest.MonkeyPatch.context() as mp:  # the commands record their arguments instead of running
        for name in ("cmd_info", "cmd_verify", "cmd_export"):
            mp.setattr(cli, name, lambda args: parsed.append(args) or 0)
        cli.main(argv)
    return parsed[0]


def problem(words: list[str]) -> str | None:
    """What is wrong with a documented command, or None."""
    unfinished = [w for w in words if w.endswith("...")]
    if unfinished:
        return f"unfinished: {' '.join(unfinished)} stands for arguments; write them out"
    if "hytrain" not in words:
        return None
    argv = hytrain_argv(words)
    if argv is None:
        return "a hytrain command this test does not read: teach hytrain_argv its form"
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            parse(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            return f"refused (exit {e.code}): {(err.getvalue().strip().splitlines() or [''])[-1]}"
    except options.ConfigError as e:
        return f"refused: {e}"
    return None


def documented():
    for doc in DOCS:
        seen = {}
        for line, source, words in commands((ROOT / doc).read_text(encoding="utf-8")):
            seen[line] = seen.get(line, 0) + 1  # (the second command of a line: README.md:12+2)
            yield pytest.param(source, words, id=f"{doc}:{line}" + (f"+{seen[line]}" if seen[line] > 1 else ""))


DOCUMENTED = list(documented())


@pytest.mark.parametrize("source, words", DOCUMENTED)
def test_documented_command(source, words):
    found = problem(words)
    assert found is None, f"{source}\n{found}"


def test_every_form_is_found():
    """The reader sees the commands at all: each document's, and each form they take."""
    for doc in DOCS:
        assert any(p.id.startswith(doc) and "hytrain" in p.values[1] for p in DOCUMENTED), doc
    argvs = [hytrain_argv(p.values[1]) for p in DOCUMENTED]
    sources = [p.values[0] for p, argv in zip(DOCUMENTED, argvs) if argv is not None]
    assert len(sources) >= 15, sources
    for form in ("hytrain train --model", "torchrun", "srun hytrain", "hytrain export", "hytrain verify",
                 "--nnodes"):
        assert any(form in s for s in sources), form


@pytest.mark.parametrize("doc", DOCS)
def test_documented_config_files(doc, tmp_path):
    """A TOML block is a config file `hytrain train --config` accepts (known keys, their types)."""
    for line, body in blocks((ROOT / doc).read_text(encoding="utf-8"), {"toml"}):
        path = tmp_path / "run.toml"
        path.write_text(body)
        parser = argparse.ArgumentParser(prog="hytrain train")
        options.add_arguments(parser)
        try:
            options.resolve_options(parser, ["--config", str(path)])
        except options.ConfigError as e:
            pytest.fail(f"{doc}:{line}: {e}")


# ---- the checker itself ----------------------------------------------------------------------------

def problems(markdown: str) -> list[str]:
    return [f"{line}: {p}" for line, _, words in commands(markdown) if (p := problem(words))]


@pytest.mark.parametrize("command", [
    "hytrain train --model small --learning-rate 1e-4",  # no such flag
    "hytrain train --state-format fp8",  # not a choice
    "hytrain train --steps many",  # not an integer
    "hytrain train --device gpu",  # a value the job refuses before it starts
    "hytrain train --model ./Llama-2-13b-hf --data train.jsonl --data-kind prompt ...",
    "hytrain train --model ./Llama-2-7b-hf \\\n  --data ./c4/en ...   # the rest as above",
    "hf download meta-llama/Llama-2-7b-hf ...",
    "hytrain fit --model small",  # no such command
    "hytrain export runs/ft7b --checkpoint latest",  # --to is required
    "hytrain verify",  # the path is required
    "hytrain info --params 0",
    "CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=8 hytrain train --bogus",
    "torchrun --nproc-per-node 8 -m hytrain train --nproc-per-node 8",
    "python -m hytrain train --model small --stream sometimes",
    "srun hytrain train --nproc 4 --resume",
    "pip install . && hytrain train --out",
    "mpirun -np 2 hytrain train --bogus",
    "uv run hytrain train --model small",  # a form the reader does not know is said, not passed over
])
def test_a_wrong_command_is_refused(command):
    found = problems(f"Text.\n\n```bash\n# a comment\n{command}\n```\n")
    assert len(found) == 1, found


def test_an_unclosed_quote_is_said():
    with pytest.raises(ValueError, match="line 2: No closing quotation"):
        problems("```bash\nhytrain train --model 'small\n```\n")


def test_right_commands_pass():
    text = """```bash
pip install torch==2.13.0 && pip install . && hytrain train   # install, then train
CUDA_VISIBLE_DEVICES=0 hytrain train --model small --state-format bf16 \\
  --steps 10 --out runs/x   # a comment ending in ...
torchrun --nproc-per-node 2 -m hytrain train --model tiny --device cpu
python -m hytrain info --no-measure
hytrain export runs/x --to ./x-hf --checkpoint step_00000010
hytrain verify runs/x
hytrain train --help
```

```python
opt.step()  # not a shell block: ...
```
"""
    assert problems(text) == []
    assert len(list(commands(text))) == 9
