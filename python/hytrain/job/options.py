"""The job's options: flags, a TOML/YAML config file under them, and the checks run before anything
is built (a bad option exits 2 with a message, never a traceback). The options resolved here become
the run plan (plan.py), once."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

import torch

from .. import state_formats
from ..models.presets import PRESETS
from ..pool import parse_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ConfigError(ValueError):
    """A bad option or config file; reported before any training starts."""


def first_line(e: BaseException) -> str:
    """An exception's message as one line for a ConfigError (its first line, at most 300 characters)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def to_stderr(text: str) -> None:
    """A refusal's line (or a failure's text) on stderr, flushed. A closed stderr (``2>&-``, a dead
    log pipe) loses the line, not the exit status the caller returns: nothing is raised, and stderr
    then writes to os.devnull (the interpreter's flush at exit would fail too)."""
    if sys.stderr is None:  # (no descriptor 2 when the interpreter started: print would write to stdout)
        return
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        try:
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115 -- for the rest of the process
        except OSError:
            pass


def counted(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and the noun, singular for one: "1 file", "2 files"; ``nouns``: the plural where it is not
    the noun and an s ("processes")."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


# --lr's default: a pre-training rate for a model that starts from random weights, a fine-tuning rate
# for a pretrained checkpoint (a transformers model directory, or a name in the Hugging Face cache).
PRETRAINING_LR, FINE_TUNING_LR = 3e-3, 2e-5


def plain(text: str) -> str:
    """A docstring as plain text for ``--help``: reST roles and literals (``x``, :mod:`x`) lose their markup."""
    return re.sub(r":[a-z]+(?::[a-z]+)*:`~?([^`]*)`", r"\1", text or "").replace("`", "")


class Parser(argparse.ArgumentParser):
    """The command line's parser: a bad flag or value is one line (``prog: error: ...``, exit 2), as
    every other refusal of the job is, not argparse's usage block and then the line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default after its help (where the help does not say it already)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or action.default in (None, argparse.SUPPRESS)
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def fine_tuning(args) -> bool:
    """Whether the job starts from a pretrained checkpoint (not a preset, not ``--init random``)."""
    return args.model not in PRESETS and getattr(args, "init", "pretrained") == "pretrained"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The job's options on ``p``; its help becomes plain text with every default shown."""
    p.formatter_class = HelpFormatter
    p.description = plain(p.description) or None
    _model_and_data_options(p.add_argument)
    _training_options(p.add_argument)
    _process_options(p.add_argument_group("several processes (one per GPU, sharded with FSDP2; see README)"))


def _model_and_data_options(a) -> None:
    a("--config", help="TOML (or YAML, with PyYAML installed) file of the options below; flags win "
      "(default: none, the flags and their defaults)")
    a("--model", default="tiny", help=f"preset ({', '.join(PRESETS)}) or a transformers model name/path")
    a("--init", choices=("pretrained", "random"), default="pretrained",
      help="a transformers model's weights: its checkpoint's (safetensors), or random from its config")
    a("--tokenizer", default=None,
      help="tokenizer directory, or 'bytes' (default: the transformers model's own; bytes for the presets)")
    a("--data", default="stdlib",
      help="'stdlib' (the embedded corpus), text files or directories (read whole), or JSON lines, gzip "
           "JSONL shards, Parquet, Arrow or a datasets.save_to_disk directory (streamed); comma-separated")
    a("--data-kind", choices=("auto", "text", "prompt", "chat"), default="auto",
      help="text (packed, EOS between documents), prompt (prompt/response or instruction/input/output "
           "records) or chat (messages, the tokenizer's chat template): loss on the responses only, one "
           "example per sequence, padded; auto: from the first record")
    a("--text-field", default="text", help="the field of JSON/Parquet records that holds the text")
    a("--eos-token", default=None, metavar="TEXT",
      help="the EOS token of streamed data (after each document, at the end of a response), where the "
           "tokenizer has none or another is wanted: a text that is one token of the tokenizer (e.g. '</s>'; "
           "one byte for the byte tokenizer; default: the tokenizer's own)")
    a("--val-data", default=None, help="validation data (default: a held-out part of --data)")
    a("--export", action=argparse.BooleanOptionalAction, default=True,
      help="write a Hugging Face model directory (config, safetensors, tokenizer) to OUT/model at the end")
    a("--batch-size", type=int, default=16, help="sequences per step")
    a("--seq-len", type=int, default=128, help="tokens per sequence")


def _training_options(a) -> None:
    a("--steps", type=int, default=400, help="optimizer steps in total (a resumed run continues to it)")
    a("--lr", type=float, default=None,
      help=f"peak learning rate (linear warm-up, cosine decay to 10%%); default: {PRETRAINING_LR:g} for a preset "
           f"or --init random (pre-training), {FINE_TUNING_LR:g} for a pretrained transformers model (fine-tuning)")
    a("--warmup", type=int, default=30, help="warm-up steps")
    a("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    a("--max-grad-norm", type=float, default=1.0, help="global-norm clipping (0: off)")
    a("--gpu-blocks", type=_k_option, default="auto",
      help="k: leading blocks updated on the GPU (CUDA only), or 'auto': the scheduler picks k each step")
    a("--speculate", type=_auto_off_or_int, default="auto",
      help="CPU updates during backward under clipping (CUDA): 'auto' (the scheduler picks from which "
           "block), 'off', or N (blocks >= N); redone exactly when clipping fires")
    a("--stream", type=_auto_off_or_int, default="auto",
      help="weights streamed from host memory through a window of layers on the GPU (one process, bf16/fp16 "
           "weights): 'auto' (on a GPU, where the weights would leave less than half of it free: the model is "
           "then read straight into host memory, never whole onto the GPU), 'off', or N (the last N layers)")
    a("--gpu-memory-limit", default=None,
      help="GPU memory hytrain may plan with, e.g. 40GiB (default: the device's); resident states fit in it")
    a("--state-format", choices=state_formats.NAMES, default=None,
      help="Adam's m and v (the fp32 master beside them): " + "; ".join(
          f"{f.name}: {f.summary}, {4 + f.bytes_per_parameter():.1f} bytes of state a parameter"
          for f in state_formats.FORMATS.values()) + f". Default: {state_formats.DEFAULT}; on --resume, the "
      "checkpoint's format")
    a("--precision", choices=list(DTYPES), default=None, help="weights dtype (default: bf16 on GPU, fp32 on CPU)")
    a("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=False,
      help="recompute each layer in backward")
    a("--device", default="auto", help="auto, cpu or cuda[:N]")
    a("--workers", type=int, default=0,
      help="CPU update threads (0: this process's share of the cores less one, at most 32 a NUMA node)")
    a("--eval-every", type=int, default=100,
      help="validation every N steps and at the end (0: at the end only, and none where the data is too small "
           "for a validation split: training then uses every document)")
    a("--eval-batches", type=int, default=8, help="batches of held-out data in each validation")
    a("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end and on signals)")
    a("--keep", type=int, default=2,
      help="checkpoints kept (0: none are written; what remains is the model directory written at the end)")
    a("--resume", default=None, help="a checkpoint directory, 'latest' in --out, or 'auto' (latest where "
      "--out has a checkpoint, else a fresh start: for a job a scheduler requeues); default: a fresh start")
    a("--out", default="runs/default", help="output directory")
    a("--seed", type=int, default=0, help="seed of the weights (presets, --init random) and of the batches")
    a("--max-data-bytes", type=int, default=24 << 20, help="cap on the corpus read into memory")
    a("--pin-limit", default=None, help="pinned-memory limit for optimizer state, e.g. 64GiB (default: none; "
      "the optimizer sizes its pool to its state)")
    a("--no-progress", action="store_true", help="no progress bar (one line per eval instead)")


def _process_options(g) -> None:
    g.add_argument("--nproc", default=None,
                   help="start torchrun with N processes on this node (or 'auto': one per GPU); "
                        "--batch-size is the global batch, split between the ranks (default: one process, "
                        "no torchrun)")
    g.add_argument("--nnodes", default="1", help="torchrun --nnodes (e.g. 2 or 1:4), with --rdzv-endpoint")
    g.add_argument("--rdzv-endpoint", default=None, help="torchrun's c10d rendezvous HOST:PORT (several nodes; "
                   "default: a free port on this node)")
    g.add_argument("--rdzv-id", default="hytrain",
                   help="torchrun's rendezvous id with --rdzv-endpoint, the same on every node (default: hytrain); "
                        "without --rdzv-endpoint (one node) it is not used: each launch draws an id of its own")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts the group this many times after a failure; the job resumes "
                        "from the latest checkpoint")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective may wait before the rank fails (a hung peer)")
    g.add_argument("--verbose", action="store_true", help="print the torchrun command that --nproc runs")


def resolve_options(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Defaults, then the config file, then explicit flags; unknown config keys are refused."""
    args = p.parse_args(argv)
    if args.config:
        path = Path(args.config)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory; --config names a TOML or YAML file")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save the config as UTF-8") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigError("YAML config files need PyYAML (pip install pyyaml); or use TOML") from None
            try:
                data = yaml.safe_load(text) or {}
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
        else:
            import tomllib
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: not valid TOML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a table of options")
        known = {a.dest: a for a in p._actions if a.dest not in ("help", "config")}
        unknown = sorted(k for k in data if k.replace("-", "_") not in known)
        if unknown:
            raise ConfigError(f"{path}: unknown option(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(k.replace('_', '-') for k in known))}")
        defaults = {k.replace("-", "_"): v for k, v in data.items()}
        for key, value in defaults.items():
            _check_config_type(path, key, value, known[key])
        p.set_defaults(**defaults)
        args = p.parse_args(argv)
    args.given = sorted(_flags_given(p, argv) | (set(defaults) if args.config else set()))
    if args.lr is None:
        args.lr = FINE_TUNING_LR if fine_tuning(args) else PRETRAINING_LR
    check_options(args)
    return args


def job_notes(args) -> list[tuple[str, bool]]:
    """What the job says before it trains, for the resolved options (:func:`resolve_options`): see
    :func:`notes`."""
    return notes(args, args.lr, args.device, getattr(args, "given", ()))


def notes(model, lr: float, device: str, given) -> list[tuple[str, bool]]:
    """What the job says before it trains, as (line, whether it is a warning, for stderr): a GPU that
    torch sees while the native build has no CUDA (the job would train on the CPU without a word), and
    the fine-tuning default of --lr where it applies. ``model``: what names the model (its ``model``
    and ``init``: a ModelPlan, or the options); ``given``: the options the command line sets."""
    import hytrain

    said = []
    if device == "auto" and torch.cuda.is_available() and hytrain.build_info().get("cuda") is None:
        said.append(("hytrain train: warning: torch sees a GPU, but hytrain was built without CUDA (no nvcc when "
                     "it was installed): training runs on the CPU; to use the GPU, put nvcc on PATH (e.g. export "
                     "PATH=/usr/local/cuda/bin:$PATH) and reinstall (pip install .)", True))
    if "lr" not in given and fine_tuning(model) and lr == FINE_TUNING_LR:
        said.append((f"hytrain train: lr {lr:g} (the fine-tuning default for a pretrained model; --lr to "
                     "change)", False))
    return said


def _flags_given(p: argparse.ArgumentParser, argv) -> set:
    """The options the command line sets (whatever their value), by a parse without defaults."""
    saved = [(a, a.default) for a in p._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        return set(vars(p.parse_args(argv))) - {"help"}
    finally:
        for a, d in saved:
            a.default = d


def _check_config_type(path, key, value, action) -> None:
    """A config file's value must have the type its flag would have parsed to (TOML's booleans are
    not numbers, numbers are not paths)."""
    name = key.replace("_", "-")
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        ok, want = isinstance(value, bool), "true or false"
    elif action.type is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif action.type is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif action.type in (_k_option, _auto_off_or_int):
        ok = (isinstance(value, int) and not isinstance(value, bool)) or value in ("auto", "off") or value is False
        want = "an integer or 'auto'" + (" or 'off'" if action.type is _auto_off_or_int else "")
    elif action.choices is not None:
        ok, want = value in action.choices, "one of " + ", ".join(map(str, action.choices))
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        raise ConfigError(f"{path}: {name} must be {want}, got {value!r}")


def _k_option(text):
    return text if text == "auto" else int(text)


def _auto_off_or_int(text):
    if text in ("auto", "off"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'off' or a number, got {text!r}") from None


def check_options(args) -> None:
    def positive(name, lo=1):
        v = getattr(args, name)
        if not isinstance(v, int) or v < lo:
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")

    for name in ("batch_size", "seq_len", "steps", "eval_batches", "max_data_bytes"):
        positive(name)
    for name in ("warmup", "workers", "eval_every", "save_every", "seed", "max_restarts", "keep"):
        positive(name, 0)
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.gpu_blocks != "auto":
        positive("gpu_blocks", 0)
    if args.speculate is False:  # a TOML boolean
        args.speculate = "off"
    if args.speculate not in ("auto", "off"):
        positive("speculate", 0)
    if args.stream is False or args.stream == 0:  # a TOML boolean; no layer
        args.stream = "off"
    if args.stream not in ("auto", "off") and not (isinstance(args.stream, int) and args.stream > 0):
        raise ConfigError(f"--stream must be 'auto', 'off' or a number of layers (0: off), got {args.stream!r}")
    for name in ("gpu_memory_limit", "pin_limit"):
        if getattr(args, name) is not None:
            try:
                parse_bytes(f"--{name.replace('_', '-')}", getattr(args, name))
            except (TypeError, ValueError) as e:
                raise ConfigError(str(e)) from None
    eos = getattr(args, "eos_token", None)
    if eos is not None and not (isinstance(eos, str) and eos):
        raise ConfigError(f"--eos-token must be a non-empty text (one token of the tokenizer), got {eos!r}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(args.device)):
        raise ConfigError(f"--device must be auto, cpu or cuda[:N], got {args.device!r}")
    cores = os.cpu_count() or 1
    if args.workers > 4 * cores:
        raise ConfigError(f"--workers {args.workers} is more than 4 threads per core ({cores} cores here)")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ConfigError(f"--lr must be a positive number, got {args.lr}")
    if args.max_grad_norm < 0 or args.weight_decay < 0:
        raise ConfigError("--max-grad-norm and --weight-decay must be >= 0")
    if args.model not in PRESETS and not _transformers_available():
        raise ConfigError(f"unknown model {args.model!r}: presets are {', '.join(PRESETS)} "
                          "(other names need the transformers package)")
    _check_out_and_gpu_blocks(args)


def _check_out_and_gpu_blocks(args) -> None:
    """--out names a directory; a --gpu-blocks k above 0 that the command line (or its config) gives
    needs CUDA: a run on the CPU would ignore it (one the checkpoint of a GPU run carries is kept, not
    refused, so that a resume on the CPU goes on)."""
    out = Path(str(args.out))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} names a file, not a directory: give --out a directory (new, or a run's)")
    k = args.gpu_blocks
    if "gpu_blocks" not in getattr(args, "given", ()) or not isinstance(k, int) or k <= 0:
        return
    why = "--device cpu" if args.device == "cpu" else None
    if args.device == "auto":
        import hytrain

        try:
            usable = torch.cuda.is_available() and hytrain.cuda_available()
        except ImportError:  # (no native build: the job says so when it needs it)
            usable = False
        why = None if usable else "no usable GPU, or hytrain built without CUDA"
    if why:
        raise ConfigError(f"--gpu-blocks {k} needs CUDA (the blocks it updates on a GPU), and this run trains on the "
                          f"CPU ({why}): leave --gpu-blocks out, or pass --gpu-blocks 0")


def _transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
