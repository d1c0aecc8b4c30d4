"""The job's model and tokenizer: a preset of the project's decoder (bytes as tokens), or a transformers
causal LM from a directory or the local Hugging Face cache, its weights read from its checkpoint into
the training dtype on the device (hf.py), or straight into pinned host memory where its layers stream
(window.py, reads.py), with its own tokenizer."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from .. import checkpoint as ckpt
from ..models import LlamaConfig, LlamaModel
from ..models.presets import PRESETS, CausalLM
from ..pool import CapacityError, available_memory_bytes, format_bytes
from ..state_formats import DEFAULT, FORMATS
from ..window import stream_model
from ..window_plan import streams_when_auto
from .tokenizers import ByteTokenizer, HFTokenizer
from .hf import load_causal_lm, load_tokenizer, meta_causal_lm, model_dir
from .options import ConfigError


def model_path(plan):
    """None for a preset; else the transformers model's directory (a path, or a name in the local
    Hugging Face cache: nothing is downloaded). ``plan``: a ModelPlan, as for every function here."""
    if plan.model in PRESETS:
        return None
    try:
        return model_dir(plan.model)
    except ConfigError as e:
        raise ConfigError(f"--model {plan.model!r} is neither a preset ({', '.join(PRESETS)}) nor a transformers "
                          f"model: {e}") from None


def stream_plan(plan, device, dtype, distributed: bool, state_format=None):
    """What of the model streams from host memory (``--stream``): None (nothing: the model is built
    on the device), else ``stream_model``'s ``stream`` ("auto" or the last N layers; the model is then
    built on the CPU and placed layer by layer). Auto streams where the weights, read from the shapes
    before anything is allocated, would leave less than half of the GPU free, or where the host cannot
    hold the optimizer's state in ``state_format`` for the whole model (``window_plan.host_short``)."""
    if plan.stream == "off":
        return None
    streamable = dtype in (torch.bfloat16, torch.float16)
    if plan.stream != "auto":
        if distributed:
            raise ConfigError(f"--stream {plan.stream}: streamed weights are for one process; under --nproc "
                              "FSDP2 shards the model instead (leave --stream out)")
        if not streamable:
            given = f"--precision {plan.precision_on(device)}" + ("" if plan.precision else ", the default here")
            raise ConfigError(f"--stream {plan.stream}: only bf16/fp16 weights stream ({given}; pass --precision bf16)")
        return plan.stream
    if distributed or device.type != "cuda" or not streamable:
        return None
    if plan.model in PRESETS:
        with torch.device("meta"):
            probe = LlamaModel(LlamaConfig(**PRESETS[plan.model], max_seq_len=max(plan.seq_len, 256))).to(dtype)
    else:
        probe = meta_causal_lm(str(model_path(plan)), dtype)
    return "auto" if streams_when_auto(probe, device, state_format=state_format) else None


@dataclass
class JobModel:
    """The load-model phase's model: the module, its parameter count (whole, not a rank's shard), its
    config as a dict (recorded in config.json), whether FSDP2 sharded it while it was read, and its
    weight window (streamed layers) or None."""
    module: torch.nn.Module
    n_params: int
    config: dict
    sharded: bool
    window: object = None


def build_model(plan, device, dtype, ranks, weights=None, state_format=None, batch_size=None) -> JobModel:
    """The load-model phase (``plan``: a ModelPlan). A transformers model's weights come from its
    checkpoint (``--init pretrained``), read straight into ``dtype`` shard by shard: on ``device``,
    or, where they stream (:func:`stream_plan`), straight into their places (:func:`_streamed`: never
    whole on the GPU, nor in pageable host memory); sharded (FSDP2 over ``ranks``) before they are
    read, each rank reading its own part only. ``weights``: a checkpoint directory whose weights
    replace the model's own (a resumed run's), read before the model is placed (a streamed parameter
    takes no load_state_dict afterwards). ``state_format``: the optimizer's, for the host's share;
    ``batch_size``: the sequences of a step, whose activations the host's share counts on the CPU."""
    stream = stream_plan(plan, device, dtype, ranks.distributed, state_format)
    where = device if stream is None else torch.device("cpu")
    if where.type == "cpu" and device.type == "cpu" and not ranks.distributed:
        check_host_fit(plan, dtype, state_format, batch_size=batch_size)
    if stream is not None and plan.model not in PRESETS and (plan.init == "pretrained" or weights is not None):
        return _streamed(plan, device, dtype, stream, weights, state_format)
    if plan.model in PRESETS:
        model, n, cfg = _preset(plan, where, dtype)
        sharded = False
    else:
        pretrained = plan.init == "pretrained"
        # Resuming, the weights are read from the checkpoint alone (the model's own are not read first).
        files = None if weights is None else [weights / "model.safetensors"]
        inner, cfg = load_causal_lm(str(model_path(plan)), device=where, dtype=dtype,
                                    init="pretrained" if files else plan.init, seed=plan.seed,
                                    shard=(lambda m: ranks.shard(m, device)) if pretrained else None, files=files)
        if plan.activation_checkpointing:
            inner.gradient_checkpointing_enable()
        model = CausalLM(inner)
        n = sum(p.numel() for p in model.parameters())  # (a sharded parameter's numel is its whole one)
        sharded = pretrained
        weights = None
    if weights is not None:
        ckpt.load_weights(weights, model)
    window = _stream(plan, model, device, stream, state_format) if stream is not None else None
    return JobModel(model, n, cfg, sharded, window)


def _stream(plan, model, device, stream, state_format=None):
    """``stream_model``, its refusals as one-line ConfigErrors."""
    try:
        return stream_model(model, device, stream=stream, state_format=state_format)
    except CapacityError as e:
        raise ConfigError(f"{plan.model} does not fit this GPU even streamed: {e}") from None
    except ValueError as e:
        raise ConfigError(f"--stream {stream}: {e}") from None


def _streamed(plan, device, dtype, stream, weights, state_format=None) -> JobModel:
    """A transformers model whose layers stream, built on the meta device and placed by
    ``stream_model`` before any weight is read: then each streamed layer's weights are read from the
    files straight into its pinned home, the rest straight onto the device (reads.py), from the
    model's directory or, resuming, the checkpoint ``weights``."""
    made = {}

    def place(inner):
        if plan.activation_checkpointing:
            inner.gradient_checkpointing_enable()
        made["model"] = model = CausalLM(inner)
        made["window"] = window = _stream(plan, model, device, stream, state_format)
        return lambda t: window.home(t) if window.streams(t) else t.data

    files = None if weights is None else [weights / "model.safetensors"]
    _, cfg = load_causal_lm(str(model_path(plan)), device=device, dtype=dtype, place=place, files=files)
    model = made["model"]
    return JobModel(model, sum(p.numel() for p in model.parameters()), cfg, False, made["window"])


def _preset(plan, where, dtype):
    """(model, parameter count, config as a dict) of a preset, its weights from ``plan.seed``."""
    cfg = LlamaConfig(**PRESETS[plan.model], max_seq_len=max(plan.seq_len, 256))
    torch.manual_seed(plan.seed)
    with torch.device("meta"):
        probe = LlamaModel(cfg)
    n = sum(p.numel() for p in probe.parameters())
    model = LlamaModel(cfg, checkpointing=plan.activation_checkpointing).to(device=where, dtype=dtype)
    return model, n, dataclasses.asdict(cfg)


def check_host_fit(plan, dtype, state_format=None, available=None, batch_size=None) -> None:
    """A model trained on the CPU keeps its weights, gradients and optimizer state in host memory, and
    a step's activations beside them (:func:`activation_bytes`, for ``batch_size`` sequences of
    ``plan.seq_len`` tokens; None: not counted): where those exceed what the host has available,
    refused in one line before anything is built (the parameter count and shapes from the meta
    device), naming what to lower."""
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    if plan.model in PRESETS:
        with torch.device("meta"):
            probe = LlamaModel(LlamaConfig(**PRESETS[plan.model], max_seq_len=max(plan.seq_len, 256)))
    else:
        probe = meta_causal_lm(str(model_path(plan)), dtype)
    shape = _shape(probe.config)
    n = sum(p.numel() for p in probe.parameters())
    fmt = FORMATS[state_format or DEFAULT]
    per = 2 * dtype.itemsize + fmt.bytes_per_parameter() + (4 if dtype != torch.float32 else 0)
    need = int(n * per)
    what = f"{plan.model} ({n / 1e6:.1f} M parameters) does not fit this host on the CPU"
    if need > available:
        smaller = "" if fmt.name == "8bit" else ", --state-format 8bit"
        raise ConfigError(
            f"{what}: its weights, gradients and {fmt.name} optimizer state need {format_bytes(need)} ({per:.2f} "
            f"bytes a parameter, activations not counted), and {format_bytes(available)} is available: a smaller "
            f"--model{smaller}, or a GPU")
    if batch_size is None or shape is None:
        return
    acts = activation_bytes(shape, batch_size, plan.seq_len, dtype, plan.activation_checkpointing)
    if need + acts <= available:
        return
    fix = "lower --seq-len or --batch-size"
    if not plan.activation_checkpointing:
        fix += (f", or pass --activation-checkpointing (activations about "
                f"{format_bytes(activation_bytes(shape, batch_size, plan.seq_len, dtype, True))})")
    raise ConfigError(
        f"{what} at --batch-size {batch_size} x --seq-len {plan.seq_len}: a step's activations need about "
        f"{format_bytes(acts)} and its weights, gradients and {fmt.name} optimizer state {format_bytes(need)}, "
        f"{format_bytes(need + acts)} in all, and {format_bytes(available)} is available: {fix}, or a GPU")


def _shape(cfg) -> dict | None:
    """What :func:`activation_bytes` reads of a model's config (a preset's LlamaConfig, or a
    transformers config, its language model's where it nests one); None where it lacks a width."""
    if isinstance(cfg, LlamaConfig):
        return dict(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
                    intermediate=cfg.intermediate_size, vocab=cfg.vocab_size)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    def first(*names):
        return next((v for v in (getattr(cfg, k, None) for k in names) if isinstance(v, int) and v > 0), None)

    hidden, layers, vocab = first("hidden_size", "n_embd", "d_model"), first("num_hidden_layers", "n_layer"), \
        first("vocab_size")
    if None in (hidden, layers, vocab):
        return None
    return dict(layers=layers, hidden=hidden, heads=first("num_attention_heads", "n_head") or 1,
                intermediate=first("intermediate_size", "n_inner", "ffn_dim") or 4 * hidden, vocab=vocab)


def activation_bytes(shape: dict, batch_size: int, seq_len: int, dtype, checkpointing: bool) -> int:
    """An estimate, on the high side, of the host memory a training step's activations take at their
    peak: what autograd keeps of a forward of ``batch_size`` x ``seq_len`` tokens through a decoder
    of ``shape`` (layers L, hidden h, heads H, intermediate I, vocab V, as :func:`_shape` reads them)
    in ``dtype`` (s bytes an element), and what a layer's backward holds beside it. Bytes a token:

        layer = 16 h + s (7 h + 4 I) + 4 H   # its two RMSNorms' fp32 input and output (2 x 8 h); the
                                             # normed inputs of the q/k/v and gate/up projections (2 h);
                                             # q, k and v (grouped keys and values repeated to H heads:
                                             # 3 h), the attention's output (h) and its copy into the
                                             # o projection (h); gate, silu(gate), up and their product
                                             # (4 I); the attention's fp32 log-sum-exp a head (4 H)
        head  = 8 h + s h + V (s + 12)       # the final norm's (8 h) and its output (s h); the logits
                                             # (s V), their fp32 log-softmax, its gradient and the
                                             # logits' fp32 gradient (12 V)
        without activation checkpointing:  (L + 2) layer + head
        with it:                           L s h + 4 layer + head

    The two layers more than L: a layer's backward (its activations' gradients and the kernels'
    temporaries, two layers' worth at once); with checkpointing, each layer's input is kept (L s h),
    and a layer is recomputed in backward, with its gradients and what the allocator keeps of the
    forward's recomputations (four layers' worth). The attention's T x T scores are not counted: the
    fused attention kernels (the CPU's too) keep none. Against the peak resident memory a step adds
    on the CPU (tiny, small and 125m presets, fp32 and bf16, with checkpointing and without), the
    estimate measured 1.05 to 1.6 times it; up to 2.8 where a 32000-token vocabulary's logits weigh
    most (125m, with checkpointing)."""
    h, heads, i, v, s = shape["hidden"], shape["heads"], shape["intermediate"], shape["vocab"], dtype.itemsize
    layer = 16 * h + s * (7 * h + 4 * i) + 4 * heads
    head = 8 * h + s * h + v * (s + 12)
    per_token = (shape["layers"] * s * h + 4 * layer if checkpointing else (shape["layers"] + 2) * layer) + head
    return int(batch_size) * int(seq_len) * per_token


def check_fit(plan, tokenizer) -> None:
    """Before anything is read or built: the sequence length within the model's positions, and the
    tokenizer's vocabulary within its embedding (from the config alone)."""
    where = model_path(plan)
    if where is None:
        vocab, limit = PRESETS[plan.model]["vocab_size"], None
    else:
        try:
            cfg = json.loads((where / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where / 'config.json'} cannot be read: {e}") from None
        cfg = cfg.get("text_config", cfg)  # (multimodal configs nest the language model's)
        vocab, limit = cfg.get("vocab_size"), cfg.get("max_position_embeddings")
    if isinstance(limit, int) and plan.seq_len > limit:
        raise ConfigError(f"--seq-len {plan.seq_len} is longer than {plan.model}'s context ({limit} positions)")
    if isinstance(vocab, int) and vocab < tokenizer.vocab_size:
        raise ConfigError(f"the tokenizer's vocabulary ({tokenizer.vocab_size} tokens"
                          f"{', bytes' if isinstance(tokenizer, ByteTokenizer) else ''}) does not fit the model's "
                          f"embedding ({vocab} rows)")


def job_tokenizer(plan):
    """The tokenizer the data is read with: ``--tokenizer`` (a directory, or ``bytes``), else a
    transformers model's own, else bytes (the presets)."""
    if plan.tokenizer == "bytes":
        return ByteTokenizer()
    if plan.tokenizer:
        return HFTokenizer(load_tokenizer(plan.tokenizer))
    where = model_path(plan)
    return ByteTokenizer() if where is None else HFTokenizer(load_tokenizer(str(where)))
