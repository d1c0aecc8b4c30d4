"""The job's model: a preset of the project's decoder, or a transformers causal LM by name or path,
built on the device in the training dtype."""

from __future__ import annotations

import dataclasses

import torch

from ..models import LlamaConfig, LlamaModel
from ..models.presets import PRESETS, CausalLM
from .options import ConfigError


def build_model(args, device, dtype):
    """(model, parameter count, config as a dict)."""
    if args.model in PRESETS:
        cfg = LlamaConfig(**PRESETS[args.model], max_seq_len=max(args.seq_len, 256))
        torch.manual_seed(args.seed)
        with torch.device("meta"):
            probe = LlamaModel(cfg)
        n = sum(p.numel() for p in probe.parameters())
        model = LlamaModel(cfg, checkpointing=args.activation_checkpointing).to(device=device, dtype=dtype)
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
    model = CausalLM(inner)
    return model, sum(p.numel() for p in model.parameters()), hf_cfg.to_dict()
