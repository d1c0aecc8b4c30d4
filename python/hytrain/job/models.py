"""The job's model and tokenizer: a preset of the project's decoder (bytes as tokens), or a transformers
causal LM from a directory or the local Hugging Face cache, its weights read from its checkpoint into
the training dtype on the device (hf.py), or into host memory where its layers stream (window.py),
with its own tokenizer."""

from __future__ import annotations

import dataclasses
import json

import torch

from ..models import LlamaConfig, LlamaModel
from ..models.presets import PRESETS, CausalLM
from ..pool import CapacityError
from ..window import stream_model
from ..window_plan import streams_when_auto
from .tokenizers import ByteTokenizer, HFTokenizer
from .hf import load_causal_lm, load_tokenizer, meta_causal_lm, model_dir
from .options import ConfigError


def model_path(args):
    """None for a preset; else the transformers model's directory (a path, or a name in the local
    Hugging Face cache: nothing is downloaded)."""
    if args.model in PRESETS:
        return None
    try:
        return model_dir(args.model)
    except ConfigError as e:
        raise ConfigError(f"--model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a transformers "
                          f"model: {e}") from None


def stream_plan(args, device, dtype, distributed: bool):
    """What of the model streams from host memory (``--stream``): None (nothing: the model is built
    on the device), else ``stream_model``'s ``stream`` ("auto" or the last N layers; the model is then
    built on the CPU and placed layer by layer). Auto streams where the weights, read from the shapes
    before anything is allocated, would leave less than half of the GPU free."""
    if args.stream == "off":
        return None
    streamable = dtype in (torch.bfloat16, torch.float16)
    if args.stream != "auto":
        if distributed:
            raise ConfigError(f"--stream {args.stream}: streamed weights are for one process; under --nproc "
                              "FSDP2 shards the model instead (leave --stream out)")
        if not streamable:
            raise ConfigError(f"--stream {args.stream}: only bf16/fp16 weights stream (--precision "
                              f"{args.precision or 'fp32'})")
        return args.stream
    if distributed or device.type != "cuda" or not streamable:
        return None
    if args.model in PRESETS:
        with torch.device("meta"):
            probe = LlamaModel(LlamaConfig(**PRESETS[args.model], max_seq_len=max(args.seq_len, 256))).to(dtype)
    else:
        probe = meta_causal_lm(str(model_path(args)), dtype)
    return "auto" if streams_when_auto(probe, device) else None


def build_model(args, device, dtype, shard=None, stream=None, weights=None):
    """(model, parameter count, config as a dict, whether ``shard`` was applied, its weight window or
    None). A transformers model's weights come from its checkpoint (``--init pretrained``), read
    straight into ``dtype`` shard by shard: on ``device``, or with ``stream`` (:func:`stream_plan`)
    into host memory, then placed by ``stream_model`` (never whole on the GPU); sharded (``shard``:
    FSDP2 over the ranks) before they are read, each rank reading its own part only. ``weights``:
    called with the model before it is placed (a resumed run's weights: a streamed parameter takes
    no load_state_dict afterwards)."""
    where = device if stream is None else torch.device("cpu")
    if args.model in PRESETS:
        cfg = LlamaConfig(**PRESETS[args.model], max_seq_len=max(args.seq_len, 256))
        torch.manual_seed(args.seed)
        with torch.device("meta"):
            probe = LlamaModel(cfg)
        n = sum(p.numel() for p in probe.parameters())
        model = LlamaModel(cfg, checkpointing=args.activation_checkpointing).to(device=where, dtype=dtype)
        cfg, sharded = dataclasses.asdict(cfg), False
    else:
        pretrained = args.init == "pretrained"
        inner, cfg = load_causal_lm(str(model_path(args)), device=where, dtype=dtype, init=args.init, seed=args.seed,
                                    shard=shard if pretrained else None)
        if args.activation_checkpointing:
            inner.gradient_checkpointing_enable()
        model = CausalLM(inner)
        n = sum(p.numel() for p in model.parameters())  # (a sharded parameter's numel is its whole one)
        sharded = bool(pretrained and shard)
    if weights is not None:
        weights(model)
    window = None
    if stream is not None:
        try:
            window = stream_model(model, device, stream=stream)
        except CapacityError as e:
            raise ConfigError(f"{args.model} does not fit this GPU even streamed: {e}") from None
        except ValueError as e:
            raise ConfigError(f"--stream {stream}: {e}") from None
    return model, n, cfg, sharded, window


def check_fit(args, tokenizer) -> None:
    """Before anything is read or built: the sequence length within the model's positions, and the
    tokenizer's vocabulary within its embedding (from the config alone)."""
    where = model_path(args)
    if where is None:
        vocab, limit = PRESETS[args.model]["vocab_size"], None
    else:
        try:
            cfg = json.loads((where / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where / 'config.json'} cannot be read: {e}") from None
        cfg = cfg.get("text_config", cfg)  # (multimodal configs nest the language model's)
        vocab, limit = cfg.get("vocab_size"), cfg.get("max_position_embeddings")
    if isinstance(limit, int) and args.seq_len > limit:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than {args.model}'s context ({limit} positions)")
    if isinstance(vocab, int) and vocab < tokenizer.vocab_size:
        raise ConfigError(f"the tokenizer's vocabulary ({tokenizer.vocab_size} tokens"
                          f"{', bytes' if isinstance(tokenizer, ByteTokenizer) else ''}) does not fit the model's "
                          f"embedding ({vocab} rows)")


def job_tokenizer(args):
    """The tokenizer the data is read with: ``--tokenizer`` (a directory, or ``bytes``), else a
    transformers model's own, else bytes (the presets)."""
    if args.tokenizer == "bytes":
        return ByteTokenizer()
    if args.tokenizer:
        return HFTokenizer(load_tokenizer(args.tokenizer))
    where = model_path(args)
    return ByteTokenizer() if where is None else HFTokenizer(load_tokenizer(str(where)))
