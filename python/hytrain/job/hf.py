"""Pretrained Hugging Face models in and out of a job.

In: :func:`load_causal_lm` builds a transformers causal LM with its parameters on the meta device and
fills them from the directory's safetensors files, a file at a time, each tensor read in chunks and
cast straight into the training dtype on the training device (never a full copy in the file's dtype
on the host); given ``shard`` (FSDP2 applied to the meta model), each rank reads only its own part.
Out: :func:`export_model` writes what ``AutoModelForCausalLM.from_pretrained`` loads (a preset as a
``LlamaForCausalLM``), :func:`export_run` a run's checkpoint (``hytrain export``). Bad input is a
one-line :class:`ConfigError`. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from ..files import fsync, save_safetensors
from .options import ConfigError, first_line
from .reads import header, read_into, read_placed

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


# ---------------------------------------------------------------------------------------------------
# Loading


def model_dir(name_or_path: str) -> Path:
    """A model directory, or the snapshot of a name in the local Hugging Face cache (never downloaded)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConfigError(f"{name_or_path} is a file; name a model directory (config.json and safetensors)")
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ConfigError(f"model directory {name_or_path} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception as e:  # noqa: BLE001 -- huggingface_hub's several kinds: not cached, bad name
        raise ConfigError(f"{name_or_path!r} is neither a model directory nor in the local Hugging Face cache "
                          f"(no network is used: download it first, e.g. `hf download {name_or_path}`; "
                          f"{type(e).__name__})") from None


def _config(where: Path):
    from transformers import AutoConfig

    if not (where / "config.json").is_file():
        raise ConfigError(f"{where} has no config.json: not a transformers model directory")
    try:
        return AutoConfig.from_pretrained(str(where), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{where / 'config.json'} cannot be read: {first_line(e)}") from None


def weight_files(where: Path) -> list[Path]:
    """The safetensors files of a model directory: ``model.safetensors``, or the shards its index names."""
    index = where / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index} cannot be read: {type(e).__name__}: {first_line(e)}") from None
        for n in (n for n in names if not (where / n).is_file()):
            raise ConfigError(f"{where / n} is missing (a shard {index.name} names)")
        return [where / n for n in names]
    if (where / "model.safetensors").is_file():
        return [where / "model.safetensors"]
    if any((where / n).is_file() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise ConfigError(f"{where} holds pytorch_model.bin weights; only safetensors are read: convert them once "
                          "with model.save_pretrained(dir, safe_serialization=True)")
    raise ConfigError(f"{where} has a config but no weights (no model.safetensors or model.safetensors.index.json)")


def _headers(files: list[Path]) -> dict:
    """``{name: (file, shape, file dtype)}`` from the files' headers (no tensor data is read)."""
    found = {}
    for file in files:
        for name, (dtype, shape, _, _) in header(file)[1].items():
            found.setdefault(name, (file, shape, dtype))
    return found


def load_causal_lm(name_or_path: str, *, device: torch.device, dtype: torch.dtype, init: str = "pretrained",
                   seed: int = 0, shard=None, place=None, files=None) -> tuple[torch.nn.Module, dict]:
    """(the transformers model, its config as a dict). ``init``: ``pretrained`` (the directory's
    weights) or ``random`` (``from_config``, seeded). ``shard``: a callable applying FSDP2 to the model
    (to the meta model, before loading, for ``pretrained``). ``place``: given the meta model, puts each
    parameter where it will live (a streamed layer's pinned home) and returns ``where(tensor)``, the
    storage read straight into (reads.py). ``files``: other safetensors files with the same names."""
    from transformers import AutoModelForCausalLM

    if init not in ("pretrained", "random"):
        raise ConfigError(f"init must be 'pretrained' or 'random', got {init!r}")
    where = model_dir(name_or_path)
    cfg = _config(where)
    if init == "random":
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype)
        if shard is not None:
            shard(model)
        return model, cfg.to_dict()
    files = weight_files(where) if files is None else [Path(f) for f in files]
    headers = _headers(files)
    model = _empty(cfg, dtype)
    if shard is not None:
        shard(model)
    targets = model.state_dict(keep_vars=True)
    missing = _check(model, targets, headers, files[0].parent)  # (the model's directory, or a checkpoint)
    if place is not None:
        into = place(model)  # (the meta parameters replaced: read into the new ones)
        read_placed({n: headers[n][0] for n in targets if n in headers}, model.state_dict(keep_vars=True), into)
        return model, cfg.to_dict()
    for file in files:
        part = {name: _destination(targets[name], headers[name], dtype, device)
                for name in targets if name in headers and headers[name][0] == file}
        read_into(file, {name: place for name, (_, place) in part.items()})
        model.load_state_dict({name: t for name, (t, _) in part.items()}, strict=False,
                              assign=True)  # (FSDP2 re-pads its shards after it)
    model.tie_weights(missing_keys=set(missing))
    left = [n for n, p in model.named_parameters() if (p.to_local() if isinstance(p, DTensor) else p).is_meta]
    if left:
        raise ConfigError(f"{left[0]} was not loaded from the safetensors files in {where} ({len(left)} left)")
    model.to(device)  # the buffers (the parameters are there already)
    return model, cfg.to_dict()


def meta_causal_lm(name_or_path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model of a directory's config with its parameters on the meta device (shapes only: what a
    plan reads before anything is allocated)."""
    return _empty(_config(model_dir(name_or_path)), dtype)


def _empty(cfg, dtype):
    """The model with its parameters on the meta device, its buffers real (rotary tables: computed),
    tied as its config says, built in ``dtype`` (None: the default) as ``from_pretrained`` does."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except ValueError as e:
        raise ConfigError(f"{cfg.model_type}: not a causal LM transformers can build: {first_line(e)}") from None
    model.tie_weights()  # (before FSDP2 sees it: a tied weight is one parameter)
    return model


def _check(model, targets: dict, headers: dict, where: Path) -> list[str]:
    """Refuses a checkpoint whose tensors miss or do not fit the model (before any data is read);
    returns the tied names the files leave out (tied afterwards)."""
    for name, t in targets.items():
        if name in headers and list(t.shape) != headers[name][1]:
            raise ConfigError(f"{headers[name][0]}: tensor {name} has shape {headers[name][1]}, the model its "
                              f"config describes needs {list(t.shape)} (a checkpoint of another model?)")
    missing = [n for n in targets if n not in headers]
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    either = {n for pair in tied.items() if any(k in headers for k in pair) for n in pair}
    absent = [n for n in missing if n not in either]
    if absent:
        raise ConfigError(f"{absent[0]} is not in the safetensors files in {where} ({len(absent)} of the model's "
                          f"{len(targets)} tensors are missing: a checkpoint of another model?)")
    return missing


def _destination(like, entry, dtype: torch.dtype, device: torch.device):
    """(the tensor the model takes, where reads.read_into reads it) for the model's tensor ``like``
    and the file's ``entry`` (file, shape, dtype): floating point in ``dtype``, on ``device``; of a
    sharded (DTensor) one only this rank's rows (FSDP2 shards along dim 0), read from its first row."""
    _, shape, kind = entry
    want = dtype if kind.is_floating_point else kind
    if not isinstance(like, DTensor):
        out = torch.empty(shape, dtype=want, device=device)
        return out, out
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    size, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    if list(size[1:]) != list(shape[1:]) or any(offset[1:]):
        raise ConfigError(f"a tensor of shape {shape} sharded as {like.placements}: only shards of whole rows "
                          "are read here")
    out = torch.empty(list(size), dtype=want, device=device)
    whole = DTensor.from_local(out, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                               stride=like.stride())
    return whole, (out, int(offset[0]) if shape else None)


def load_tokenizer(name_or_path: str, tokenizer: str | None = None):
    """The tokenizer of a model directory or cached name, or of ``tokenizer`` when given."""
    from transformers import AutoTokenizer

    source = tokenizer or name_or_path
    where = model_dir(source)
    if not any((where / n).is_file() for n in TOKENIZER_FILES):
        raise ConfigError(f"{source} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}...); "
                          "pass --tokenizer DIR")
    try:
        return AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- transformers raises several kinds for bad tokenizer files
        raise ConfigError(f"the tokenizer in {where} cannot be read: {type(e).__name__}: {first_line(e)}") from None


# ---------------------------------------------------------------------------------------------------
# Export

# The preset decoder's parameter names, as LlamaForCausalLM's.
_PRESET_NAMES = [(r"^embed\.", "model.embed_tokens."), (r"^norm\.", "model.norm."),
                 (r"^layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
                 (r"^layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
                 (r"^layers\.(\d+)\.(q|k|v|o)\.", r"model.layers.\1.self_attn.\2_proj."),
                 (r"^layers\.(\d+)\.(gate|up|down)\.", r"model.layers.\1.mlp.\2_proj.")]  # lm_head: as is


def _preset_config(c):
    """The transformers config of a preset (same rotary layout, norm, attention and MLP: exact)."""
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.hidden_size // c.num_heads, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, architectures=["LlamaForCausalLM"])


def _layout(own):
    """(transformers config, name mapping, names not written: tied copies) of a model to export."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    from ..models import LlamaModel

    if isinstance(own, LlamaModel):
        rename = lambda n: next((re.sub(p, r, n) for p, r in _PRESET_NAMES if re.match(p, n)), n)  # noqa: E731
        return _preset_config(own.config), rename, set()
    if not isinstance(own, PreTrainedModel):
        raise ConfigError(f"cannot export a {type(own).__name__}: only transformers models and hytrain's presets")
    config = copy.deepcopy(own.config)
    config.architectures = [next(c.__name__ for c in type(own).__mro__ if not issubclass(c, FSDPModule))]
    names, tied = set(own.state_dict(keep_vars=True)), own.get_expanded_tied_weights_keys(all_submodels=True)
    return config, (lambda n: n), {t for t, s in tied.items() if s in names}


def export_needs(packages=("transformers",)) -> str | None:
    """Why a Hugging Face model directory (transformers' config) cannot be written here, or None."""
    for name in packages:
        try:
            importlib.import_module(name)
        except ImportError:
            return f"writing a Hugging Face model directory needs {name}: pip install 'hytrain[hf]' (\".[hf]\" here)"


class ExportError(ConfigError):
    """A failed export's write (a full disk, an I/O error); ``why``: the reason, for a caller's sentence."""

    def __init__(self, out: Path, why: str):
        super().__init__(f"exporting into {out} failed: {why}")
        self.why = why


def export_model(model: torch.nn.Module, out_dir, *, tokenizer_dir: str | None = None,
                 dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30) -> Path:
    """A Hugging Face model directory at ``out_dir``, written beside it, then renamed into place: a failed
    write (:class:`ExportError`, on every rank) leaves nothing, an empty ``out_dir`` as it was. Every rank
    of an FSDP2-sharded model calls it: each weight is gathered in turn and rank 0 writes it."""
    import torch.distributed as dist

    out, group = Path(out_dir), dist.is_available() and dist.is_initialized()
    main = not group or dist.get_rank() == 0
    own = getattr(model, "saved_module", model)
    config, rename, skipped = _layout(own)
    error, tokenizer = None, None
    if main:
        try:
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise ConfigError(f"{out} exists and is not an empty directory: export into a new one")
            tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        except ConfigError as e:
            error = str(e)
    error = _rank0s(error, group)  # rank 0's refusal, on every rank (the others would wait in its collectives)
    if error:
        raise ConfigError(error)
    tmp, failed = out.parent / f".{out.name}.tmp-{os.getpid()}", None
    made = [d for d in reversed(out.parents) if not d.exists()]  # created here: removed on a failure
    try:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    except OSError as e:
        failed = e
    try:  # (a failed write on rank 0 goes on through the gathers the other ranks wait in)
        written, failed = _write_weights(own, tmp if main and not failed else None, rename, skipped, dtype,
                                         max_shard_bytes, failed)
        if main and not failed:
            config.dtype = written
            config.save_pretrained(str(tmp))
            generation = getattr(own, "generation_config", None)
            if generation is not None and own.can_generate():
                generation.save_pretrained(str(tmp))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            for f in tmp.iterdir():
                fsync(f)
            os.rename(tmp, out)
            fsync(out.parent)
    except Exception as e:  # noqa: BLE001 -- OSError, and the writers' own on a full disk (SafetensorError)
        if not main:
            raise
        failed = e
    finally:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            for d in reversed(made if failed else []):
                with contextlib.suppress(OSError):
                    d.rmdir()
    why = _rank0s(_failure(failed, own, dtype, out) if main and failed else None, group)
    if why:
        raise ExportError(out, why)
    if group:
        dist.barrier()
    return out


def _rank0s(value, group: bool):
    """Rank 0's ``value`` on every rank of the process group (outside one: as it is)."""
    box = [value]
    if group:
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _failure(e: BaseException, own, dtype, out: Path) -> str:
    """A failed export's reason in a line, with the room it needed and the room there is."""
    why = re.sub(r"^Error while serializing: (I/O error: )?", "", getattr(e, "strerror", None) or first_line(e))
    needed = sum(t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
                 for t in own.state_dict().values()) + (1 << 20)
    try:  # (the nearest directory that exists: out's parent may be gone with the failure)
        free = shutil.disk_usage(next(d for d in (out.parent, *out.parents) if d.exists())).free
        free = f"; the disk holding {out.parent} has {free / 1e9:.3f} GB free"
    except OSError:
        free = ""
    left = f"{out} is as it was" if out.is_dir() else "nothing was left in its place"
    return f"{why} (about {needed / 1e9:.3f} GB needed{free}); {left}"


def _write_weights(own, tmp: Path | None, rename, skipped: set, dtype, max_shard_bytes: int,
                   failed: BaseException | None = None) -> tuple:
    """The weights in safetensors files of at most ``max_shard_bytes`` each (a larger tensor alone), with
    their index when there are several; ``tmp`` None: a rank other than 0, or rank 0 after a failed write,
    which only takes part in the gathers. Returns (the floating-point weights' dtype, the failure)."""
    state = {k: v for k, v in own.state_dict().items() if k not in skipped}
    cast = {k: dtype if dtype is not None and v.is_floating_point() else v.dtype for k, v in state.items()}
    groups, size = [[]], 0
    for k, v in state.items():
        nbytes = v.numel() * cast[k].itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups, size = [*groups, []], 0
        groups[-1].append(k)
        size += nbytes
    n = len(groups)
    files = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for file, keys in zip(files, groups):  # one file's tensors at a time on the host
        part = {}
        for k in keys:
            t = state[k].full_tensor() if isinstance(state[k], DTensor) else state[k]  # (a collective)
            if tmp is not None:
                part[rename(k)] = t.detach().to(device="cpu", dtype=cast[k]).contiguous()
        try:
            if tmp is not None:
                save_safetensors(part, tmp / file, metadata={"format": "pt"})
        except Exception as e:  # noqa: BLE001 -- OSError, SafetensorError (a full disk, an I/O error)
            tmp, failed = None, e
    if tmp is not None and n > 1:
        index = {"metadata": {"total_size": sum(state[k].numel() * cast[k].itemsize for k in state)},
                 "weight_map": dict(sorted((rename(k), f) for f, keys in zip(files, groups) for k in keys))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return next((cast[k] for k, v in state.items() if v.is_floating_point()), None), failed


def parameter_count(out_dir) -> int:
    """The parameters a model directory's safetensors files hold (from their headers)."""
    return sum(math.prod(shape) for _, shape, _ in _headers(weight_files(Path(out_dir))).values())


# ---------------------------------------------------------------------------------------------------
# A run's checkpoint


def export_run(run_dir, to, *, checkpoint: str = "latest", attempts: int = 5, with_source: bool = False):
    """Exports the model weights of a run's checkpoint (``latest`` or a name/path; either format), read
    under its lease (a live run does not prune it); ``latest`` pruned first is resolved again (``attempts``).
    Returns the directory written (``with_source``: and the checkpoint it was read from)."""
    from .. import checkpoint as ckpt

    if why_not := export_needs(("transformers", "accelerate")):
        raise ConfigError(why_not)
    run = Path(run_dir)
    try:
        config = json.loads((run / "config.json").read_text())
        opts, model_cfg, name = config["options"], config["model"], config["options"]["model"]
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"{run} does not exist" if not run.exists() else f"{run} is a file, not a run directory"
                          if not run.is_dir() else f"{run} is not a run directory (no config.json)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{run / 'config.json'} cannot be read: {type(e).__name__}: {first_line(e)}") from None
    for attempt in range(1, attempts + 1):
        try:
            path, sharded, weights = _read_checkpoint(run, checkpoint)
            break
        except ckpt.CheckpointGone as e:
            if checkpoint != "latest" or attempt == attempts:
                raise ConfigError(str(e) if checkpoint != "latest" else f"{run}: its newest checkpoint was pruned "
                                  f"before it could be read, {attempts} times: name one with --checkpoint") from None
    wrapper = _rebuilt(name, model_cfg)
    own = getattr(wrapper, "saved_module", wrapper)
    try:  # a sharded checkpoint holds the job's module (the wrapper), a single-process one what it wraps
        (wrapper if sharded else own).load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        raise ConfigError(f"{path} was not written for {name} as {run / 'config.json'} describes it: "
                          f"{lines[0] if lines else first_line(e)}") from None
    if hasattr(own, "tie_weights"):
        own.tie_weights()
    out = export_model(own, to, tokenizer_dir=_run_tokenizer(opts))
    return (out, path) if with_source else out


def _read_checkpoint(run: Path, checkpoint: str) -> tuple:
    """(path, sharded, model weights) of a run's checkpoint, verified and read under its lease; raises
    CheckpointGone where it was pruned first (or, on a file system without locks, while it was read)."""
    from safetensors.torch import load_file

    from .. import checkpoint as ckpt
    from .. import dist_checkpoint

    try:
        named = run / "checkpoints" / checkpoint
        path = ckpt.resolve(run, "latest" if checkpoint == "latest" else str(named if named.is_dir() else checkpoint))
    except ckpt.CheckpointError as e:
        raise ConfigError(f"{run}: {e}".replace("--resume latest: ", "")) from None
    try:
        with ckpt.reading(path):
            ckpt.verify(path)
            sharded = dist_checkpoint.is_sharded_checkpoint(path)
            return path, sharded, _sharded_weights(path) if sharded else load_file(str(path / "model.safetensors"))
    except Exception as e:  # noqa: BLE001 -- the readers' several kinds for a file gone mid-read
        if not path.is_dir() and not isinstance(e, ckpt.CheckpointGone):  # (no lease: no flock here)
            raise ckpt.CheckpointGone(f"{path} was removed while it was read (pruned)") from None
        if isinstance(e, (ConfigError, ckpt.CheckpointGone)) or not isinstance(e, (OSError, ckpt.CheckpointError)):
            raise
        if isinstance(e, OSError):
            raise ConfigError(f"checkpoint {path} cannot be read: {e.strerror or first_line(e)}") from None
        older = ckpt.after_damage(path).replace("resume from that one with --resume", "export it with --checkpoint")
        raise ConfigError(f"checkpoint {path} is damaged: {e}{older}") from None


def _rebuilt(name: str, model_cfg: dict):
    """The run's model (as the job wraps it) with its parameters on the meta device."""
    from accelerate import init_empty_weights
    from transformers import CONFIG_MAPPING

    from ..models import LlamaConfig, LlamaModel
    from ..models.presets import PRESETS, CausalLM

    if name in PRESETS:
        with init_empty_weights(include_buffers=False):
            return LlamaModel(LlamaConfig(**model_cfg))
    try:
        return CausalLM(_empty(CONFIG_MAPPING[model_cfg["model_type"]].from_dict(model_cfg), None))
    except (KeyError, ValueError) as e:
        raise ConfigError(f"the run's model ({name}) cannot be rebuilt: {type(e).__name__}: {first_line(e)}") from None


def _sharded_weights(path: Path) -> dict:
    """The full model weights of a DCP checkpoint, read in this process (no process group needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    found = reader.read_metadata().state_dict_metadata
    model = {k[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype) for k, m in found.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    try:
        with warnings.catch_warnings():  # (that it assumes one process: what is meant)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # (the latter is a BaseException)
        raise ConfigError(f"{path}: the model weights cannot be read: {first_line(e)}") from None
    return model


def _run_tokenizer(opts: dict) -> str | None:
    """The tokenizer to export with a run's model: its --tokenizer, else the model's own where it has
    one (presets, which read bytes, have none)."""
    from ..models.presets import PRESETS

    if opts.get("tokenizer") or opts["model"] in PRESETS:
        return opts.get("tokenizer")
    try:
        where = model_dir(opts["model"])
    except ConfigError:
        return None
    return str(where) if any((where / n).is_file() for n in TOKENIZER_FILES) else None
