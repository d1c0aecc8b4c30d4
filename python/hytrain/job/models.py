"""The job's model: a preset of the project's decoder, or a transformers causal LM by name or path,
built on the device in the training dtype."""

from __future__ import annotations

import dataclasses
import os
import socket
from urllib.parse import urlparse

import torch

from ..models import LlamaConfig, LlamaModel
from ..models.presets import PRESETS, CausalLM
from .options import ConfigError


def _hub_reachable(timeout_s=3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection (a machine without network says no at
    once, instead of transformers' retries)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _hf_config(name):
    """A transformers config from a path or the local cache, else from the hub when it can be reached;
    otherwise refused at once."""
    from transformers import AutoConfig

    def refuse(e, where):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a transformers "
                          f"model {where}: {first}") from None

    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        if not _hub_reachable():
            refuse(e, "found locally or in the Hugging Face cache (and the hub cannot be reached)")
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        refuse(e, "on the hub")


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
    from transformers import AutoModelForCausalLM

    hf_cfg = _hf_config(args.model)
    torch.manual_seed(args.seed)
    inner = AutoModelForCausalLM.from_config(hf_cfg).to(device=device, dtype=dtype)
    if args.activation_checkpointing:
        inner.gradient_checkpointing_enable()
    model = CausalLM(inner)
    return model, sum(p.numel() for p in model.parameters()), hf_cfg.to_dict()
