"""The job's model and tokenizer: a preset of the project's decoder (bytes as tokens), or a transformers
causal LM from a directory or the local Hugging Face cache, its weights read from its checkpoint into
the training dtype on the device (hf.py), with its own tokenizer."""

from __future__ import annotations

import dataclasses
import json

import torch

from ..models import LlamaConfig, LlamaModel
from ..models.presets import PRESETS, CausalLM
from .tokenizers import ByteTokenizer, HFTokenizer
from .hf import load_causal_lm, load_tokenizer, model_dir
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


def build_model(args, device, dtype, shard=None):
    """(model, parameter count, config as a dict, whether ``shard`` was applied). A transformers
    model's weights come from its checkpoint (``--init pretrained``), read straight into ``dtype`` on
    ``device`` shard by shard; sharded (``shard``: FSDP2 over the ranks) before they are read, each
    rank reading its own part only."""
    if args.model in PRESETS:
        cfg = LlamaConfig(**PRESETS[args.model], max_seq_len=max(args.seq_len, 256))
        torch.manual_seed(args.seed)
        with torch.device("meta"):
            probe = LlamaModel(cfg)
        n = sum(p.numel() for p in probe.parameters())
        model = LlamaModel(cfg, checkpointing=args.activation_checkpointing).to(device=device, dtype=dtype)
        return model, n, dataclasses.asdict(cfg), False
    pretrained = args.init == "pretrained"
    inner, cfg = load_causal_lm(str(model_path(args)), device=device, dtype=dtype, init=args.init, seed=args.seed,
                                shard=shard if pretrained else None)
    if args.activation_checkpointing:
        inner.gradient_checkpointing_enable()
    model = CausalLM(inner)
    n = sum(p.numel() for p in model.parameters())  # (a sharded parameter's numel is its whole one)
    return model, n, cfg, bool(pretrained and shard)


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
