"""``hytrain train``: train a causal LM with HybridAdamW, with checkpoints, metrics and pictures.

With no arguments it trains the ``tiny`` Llama-style model on an embedded corpus (the Python standard
library's own source files, read as bytes: present on every machine, nothing to download), holding
out about 5% of the files for validation. The same command runs on a CPU-only machine (the CPU
update path) and on a GPU (the full offload pipeline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .models import LlamaConfig, LlamaModel

PRESETS = {
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=344, num_layers=4, num_heads=4, num_kv_heads=2),
    "small": dict(vocab_size=256, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
                  num_kv_heads=2),
    "125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                 num_kv_heads=12),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_layers=16, num_heads=16,
               num_kv_heads=16),
    "l3b": dict(vocab_size=32000, hidden_size=3072, intermediate_size=8192, num_layers=26, num_heads=24,
                num_kv_heads=24),
    "l7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                num_kv_heads=32),
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ConfigError(ValueError):
    """A bad option or config file; reported before any training starts."""


# ---- options ----------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--config", help="TOML (or YAML, with PyYAML installed) file of the options below; flags win")
    a("--model", default="tiny", help=f"preset ({', '.join(PRESETS)}) or a transformers model name/path")
    a("--data", default="stdlib", help="'stdlib' (the embedded corpus) or a text file or directory")
    a("--batch-size", type=int, default=16, help="sequences per step")
    a("--seq-len", type=int, default=128, help="tokens per sequence")
    a("--steps", type=int, default=400, help="optimizer steps in total (a resumed run continues to it)")
    a("--lr", type=float, default=3e-3, help="peak learning rate (linear warm-up, cosine decay to 10%%)")
    a("--warmup", type=int, default=30, help="warm-up steps")
    a("--weight-decay", type=float, default=0.1)
    a("--max-grad-norm", type=float, default=1.0, help="global-norm clipping (0: off)")
    a("--gpu-blocks", type=_k_option, default="auto",
      help="k: leading blocks updated on the GPU (CUDA only), or 'auto': the scheduler picks k each step")
    a("--speculate", type=_speculate_option, default="auto",
      help="CPU updates during backward under clipping (CUDA): 'auto' (the scheduler picks from which "
           "block), 'off', or N (blocks >= N); redone exactly when clipping fires")
    a("--gpu-memory-limit", default=None,
      help="GPU memory hytrain may plan with, e.g. 40GiB (default: the device's); resident states fit in it")
    a("--precision", choices=list(DTYPES), default=None, help="weights dtype (default: bf16 on GPU, fp32 on CPU)")
    a("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=False,
      help="recompute each layer in backward")
    a("--device", default="auto", help="auto, cpu or cuda[:N]")
    a("--workers", type=int, default=0, help="CPU update threads (0: the usable cores)")
    a("--eval-every", type=int, default=100, help="validation every N steps (and at the end)")
    a("--eval-batches", type=int, default=8)
    a("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end and on signals)")
    a("--keep", type=int, default=2, help="checkpoints kept")
    a("--resume", default=None, help="a checkpoint directory, or 'latest' in --out")
    a("--out", default="runs/default", help="output directory")
    a("--seed", type=int, default=0)
    a("--max-data-bytes", type=int, default=24 << 20, help="cap on the corpus read into memory")
    a("--pin-limit", default=None, help="pinned-memory limit for optimizer state, e.g. 64GiB")
    a("--no-progress", action="store_true", help="no progress bar (one line per eval instead)")


def resolve_options(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Defaults, then the config file, then explicit flags; unknown config keys are refused."""
    args = p.parse_args(argv)
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigError("YAML config files need PyYAML (pip install pyyaml); or use TOML") from None
            data = yaml.safe_load(path.read_text()) or {}
        else:
            import tomllib
            try:
                data = tomllib.loads(path.read_text())
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a table of options")
        known = {a.dest: a for a in p._actions if a.dest not in ("help", "config")}
        unknown = sorted(k for k in data if k.replace("-", "_") not in known)
        if unknown:
            raise ConfigError(f"{path}: unknown option(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(k.replace('_', '-') for k in known))}")
        defaults = {k.replace("-", "_"): v for k, v in data.items()}
        p.set_defaults(**defaults)
        args = p.parse_args(argv)
    check_options(args)
    return args


def _k_option(text):
    return text if text == "auto" else int(text)


def _speculate_option(text):
    return text if text in ("auto", "off") else int(text)


def check_options(args) -> None:
    def positive(name, lo=1):
        v = getattr(args, name)
        if not isinstance(v, int) or v < lo:
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")

    for name in ("batch_size", "seq_len", "steps", "eval_batches", "keep"):
        positive(name)
    for name in ("warmup", "workers", "eval_every", "save_every", "seed"):
        positive(name, 0)
    if args.gpu_blocks != "auto":
        positive("gpu_blocks", 0)
    if args.speculate is False:  # a TOML boolean
        args.speculate = "off"
    if args.speculate not in ("auto", "off"):
        positive("speculate", 0)
    if args.gpu_memory_limit is not None:
        try:
            from .pool import parse_bytes

            parse_bytes("--gpu-memory-limit", args.gpu_memory_limit)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ConfigError(f"--lr must be a positive number, got {args.lr}")
    if args.max_grad_norm < 0 or args.weight_decay < 0:
        raise ConfigError("--max-grad-norm and --weight-decay must be >= 0")
    if args.model not in PRESETS and not _transformers_available():
        raise ConfigError(f"unknown model {args.model!r}: presets are {', '.join(PRESETS)} "
                          "(other names need the transformers package)")


def _transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# ---- data -------------------------------------------------------------------------------------------

def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def load_corpus(spec: str, max_bytes: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train bytes, validation bytes, description). Files are split by a hash of their name, so
    the split does not depend on the order or the number of files."""
    if spec == "stdlib":
        files, root = stdlib_files(), Path(sysconfig.get_paths()["stdlib"])
    else:
        root = Path(spec)
        if root.is_file():
            data = root.read_bytes()[:max_bytes]
            if len(data) < 4096:
                raise ConfigError(f"{root} has {len(data)} bytes; at least 4096 are needed")
            cut = len(data) * 19 // 20
            return (torch.frombuffer(bytearray(data[:cut]), dtype=torch.uint8),
                    torch.frombuffer(bytearray(data[cut:]), dtype=torch.uint8), str(root))
        if not root.is_dir():
            raise ConfigError(f"--data {spec!r} is neither 'stdlib', a file nor a directory")
        files = sorted(p for p in root.rglob("*") if p.is_file())
    train, val, total = bytearray(), bytearray(), 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        name = str(f.relative_to(root)).encode()
        (val if zlib.crc32(name) % 20 == 0 else train).extend(data)
        total += len(data)
        if total >= max_bytes:
            break
    if len(train) < 4096 or len(val) < 1024:
        raise ConfigError(f"the corpus {spec!r} is too small ({len(train)} train / {len(val)} validation bytes)")
    desc = f"{spec} ({len(files)} files, {len(train) / 1e6:.1f} MB train, {len(val) / 1e6:.2f} MB validation)"
    return (torch.frombuffer(train, dtype=torch.uint8).clone(), torch.frombuffer(val, dtype=torch.uint8).clone(),
            desc)


def batch_at(data: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The batch of step ``step``: a function of (seed, step) only, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()


# ---- model ------------------------------------------------------------------------------------------

class CheckpointedLlama(LlamaModel):
    """LlamaModel whose layers are recomputed in backward (activation checkpointing)."""

    def forward(self, tokens, targets=None):
        from torch.utils.checkpoint import checkpoint

        t = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False) if torch.is_grad_enabled() else layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(args, device, dtype):
    if args.model in PRESETS:
        cfg = LlamaConfig(**PRESETS[args.model], max_seq_len=max(args.seq_len, 256))
        torch.manual_seed(args.seed)
        cls = CheckpointedLlama if args.activation_checkpointing else LlamaModel
        with torch.device("meta"):
            probe = cls(cfg)
        n = sum(p.numel() for p in probe.parameters())
        model = cls(cfg).to(device=device, dtype=dtype)
        return model, n, dataclasses.asdict(cfg)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        hf_cfg = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as e:  # not a hub name, a config directory or a cached model
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                          f"transformers config transformers could load: {first}") from None
    torch.manual_seed(args.seed)
    inner = AutoModelForCausalLM.from_config(hf_cfg).to(device=device, dtype=dtype)
    if args.activation_checkpointing:
        inner.gradient_checkpointing_enable()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        @property
        def saved_module(self):  # checkpoints hold the transformers model under its own names
            return self.inner

        def forward(self, tokens, targets=None):
            out = self.inner(input_ids=tokens)
            if targets is None:
                return out.logits
            return torch.nn.functional.cross_entropy(out.logits.float().view(-1, out.logits.shape[-1]),
                                                     targets.reshape(-1))

    model = Wrapped()
    return model, sum(p.numel() for p in model.parameters()), hf_cfg.to_dict()


# ---- metrics ----------------------------------------------------------------------------------------

class Power:
    """GPU power and energy through NVML (nvidia-ml-py), when available."""

    def __init__(self, device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self.last = pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception:  # no nvidia-ml-py, no driver, or no energy counter on this GPU
            self.handle = None

    def sample(self) -> dict:
        if self.handle is None:
            return {}
        try:
            now = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            out = {"power_w": self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0,
                   "energy_j": (now - self.last) / 1000.0}
            self.last = now
            return out
        except Exception:
            return {}


class Metrics:
    def __init__(self, out: Path):
        self.file = open(out / "metrics.jsonl", "a")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except Exception:  # TensorBoard not installed
            self.tb = None

    def write(self, rec: dict) -> None:
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])

    def close(self):
        self.file.close()
        if self.tb is not None:
            self.tb.close()


@torch.no_grad()
def evaluate(model, val, args, device) -> float:
    model.eval()
    total = 0.0
    for i in range(args.eval_batches):
        b = batch_at(val, i, args.batch_size, args.seq_len, seed=12345).to(device)
        total += float(model(b[:, :-1], b[:, 1:]))
    model.train()
    return total / args.eval_batches


# ---- the run ----------------------------------------------------------------------------------------

def pick_device(spec: str) -> torch.device:
    import hytrain

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and hytrain.cuda_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not (torch.cuda.is_available() and hytrain.cuda_available()):
            raise ConfigError("--device cuda: no usable GPU (or hytrain was built without CUDA)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigError(f"--device must be auto, cpu or cuda[:N], got {spec!r}")
    return dev


def lr_lambda(args):
    def f(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return f


def run(args) -> int:
    import hytrain

    from .hybrid_adam import detect_blocks
    from .pool import PinnedPool, parse_bytes

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to the output directory {out}: {e}") from None
    device = pick_device(args.device)
    dtype = DTYPES[args.precision or ("bf16" if device.type == "cuda" else "fp32")]
    resume_dir = None
    if args.resume:
        resume_dir = ckpt.resolve(out, args.resume)
        ckpt.verify(resume_dir)  # a corrupted checkpoint is refused before anything is built
    train_data, val_data, desc = load_corpus(args.data, args.max_data_bytes)
    model, n_params, model_cfg = build_model(args, device, dtype)
    vocab = model_cfg.get("vocab_size", 256)
    if vocab < 256:
        raise ConfigError(f"the model's vocabulary ({vocab}) is smaller than the byte alphabet (256)")
    state_bytes = n_params * (16 if device.type == "cuda" else 12) + (256 << 20)
    pool = None
    if args.pin_limit is not None:
        limit = parse_bytes("pin_limit", args.pin_limit)
        if state_bytes > limit:
            raise ConfigError(f"the optimizer state of {n_params / 1e6:.1f} M parameters needs about "
                              f"{state_bytes / 2**30:.2f} GiB of pinned memory, over --pin-limit {args.pin_limit}")
        pool = PinnedPool(limit)
    k = args.gpu_blocks if device.type == "cuda" else 0
    if k != "auto":
        k = min(k, len(detect_blocks(model, list(model.parameters()))))
    limit = parse_bytes("gpu_memory_limit", args.gpu_memory_limit) if args.gpu_memory_limit else None
    opt = hytrain.HybridAdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                              max_grad_norm=args.max_grad_norm or None, model=model, pool=pool,
                              gpu_blocks=k, gpu_memory_limit=limit if device.type == "cuda" else None,
                              workers=args.workers or None, trace=True,
                              speculate=False if args.speculate == "off" else args.speculate,
                              release_grads=True)  # this loop never reads the gradients after backward
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    start = 0
    if resume_dir is not None:
        start = ckpt.load(resume_dir, model, opt, sched)
        print(f"resumed from {resume_dir} at step {start}", flush=True)
    (out / "config.json").write_text(json.dumps({"options": vars(args), "model": model_cfg}, indent=1, default=str))
    print(f"hytrain train: {args.model} ({n_params / 1e6:.2f} M parameters, {dtype}) on {device}, "
          f"k={opt.gpu_blocks}, data {desc}", flush=True)

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum  # finish the step, save, exit

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    metrics = Metrics(out)
    power = Power(device)
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)
        except ImportError:
            bar = None
    tokens_per_step = args.batch_size * args.seq_len
    history, energy, t_start = [], 0.0, time.perf_counter()
    step = start
    try:
        while step < args.steps:
            t0 = time.perf_counter()
            b = batch_at(train_data, step, args.batch_size, args.seq_len, args.seed).to(device, non_blocking=True)
            loss = model(b[:, :-1], b[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            loss_v = float(loss.detach())  # the one host synchronisation per step
            step += 1
            dt = time.perf_counter() - t0
            rec = {"step": step, "loss": loss_v, "lr": sched.get_last_lr()[0], "step_s": dt,
                   "tokens_per_s": tokens_per_step / dt, **power.sample()}
            if opt.last_grad_norm is not None:
                rec["grad_norm"] = opt.last_grad_norm
            sched_stats = opt.schedule_stats()
            rec.update({key: sched_stats[key] for key in ("k", "gpu_wait_frac", "predicted_iter_s")
                        if key in sched_stats})
            energy += rec.get("energy_j", 0.0)
            if not math.isfinite(loss_v):
                raise RuntimeError(f"the loss became {loss_v} at step {step}; lower --lr")
            if step % args.eval_every == 0 if args.eval_every else False:
                rec["val_loss"] = evaluate(model, val_data, args, device)
            if step == args.steps and "val_loss" not in rec:
                rec["val_loss"] = evaluate(model, val_data, args, device)
            metrics.write(rec)
            history.append(rec)
            if bar is not None:
                bar.update(1)
                post = dict(loss=f"{loss_v:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}", k=rec["k"])
                if "gpu_wait_frac" in rec:
                    post["gpu_idle"] = f"{rec['gpu_wait_frac']:.0%}"
                bar.set_postfix(**post)
            elif "val_loss" in rec:
                print(f"step {step}: loss {loss_v:.4f} val {rec['val_loss']:.4f} "
                      f"{rec['tokens_per_s']:.0f} tokens/s", flush=True)
            if (args.save_every and step % args.save_every == 0) or step == args.steps or stop["signal"]:
                ckpt.save(out, step, model, opt, sched, {"options": vars(args), "model": model_cfg}, keep=args.keep)
            if stop["signal"]:
                print(f"\nstopped by signal {stop['signal']} after step {step}; checkpoint saved "
                      f"(resume with --resume latest --out {out})", flush=True)
                break
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if bar is not None:
            bar.close()
        metrics.close()
    summary = finish(out, opt, history, n_params, tokens_per_step, time.perf_counter() - t_start, energy, device)
    print(json.dumps(summary), flush=True)
    return 0


def finish(out, opt, history, n_params, tokens_per_step, elapsed, energy, device) -> dict:
    from . import plots

    trace = opt.export_trace(out / "trace.json")
    pictures = plots.write_all(out, history, trace)
    vals = [r["val_loss"] for r in history if "val_loss" in r]
    tokens = tokens_per_step * len(history)
    summary = {"steps": history[-1]["step"] if history else 0, "params": n_params, "device": str(device),
               "first_loss": history[0]["loss"] if history else None,
               "final_loss": history[-1]["loss"] if history else None,
               "final_val_loss": vals[-1] if vals else None, "tokens": tokens,
               "tokens_per_s": tokens / elapsed if elapsed > 0 else None, "trace": str(trace), **pictures}
    if energy > 0:
        summary["energy_j"] = energy
        summary["energy_per_token_j"] = energy / tokens
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hytrain train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    try:
        args = resolve_options(p, argv)
        return run(args)
    except (ConfigError, ckpt.CheckpointError) as e:
        print(f"hytrain train: error: {e}", file=sys.stderr)
        return 2
    except hytrain_pool_error() as e:
        print(f"hytrain train: error: {e} (lower the model size or raise --pin-limit)", file=sys.stderr)
        return 2


def hytrain_pool_error():
    from ._native import native

    return native().PoolExhaustedError
