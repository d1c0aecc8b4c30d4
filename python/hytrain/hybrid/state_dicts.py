"""The optimizer's state dicts: torch's (``state_dict``/``load_state_dict``: parsed and checked before
anything changes) and the one for ``torch.distributed.checkpoint`` (the buffers themselves, as
DTensors over the parameters' mesh for FSDP2 shards)."""

from __future__ import annotations

import math

import torch

from .. import _checks, quant8, state_formats
from .collectives import host_mesh
from .common import MOMENTS, STATE_KEYS, convert_moment, is_sharded, local
from .settings import check_state_value

# The 8-bit scales beside m and v in sharded checkpoints (_sharded_moment).
SCALE_KEYS = tuple(m + suffix for m in MOMENTS for suffix in ("_scales", "_rank_scales"))


def checked_groups(state_dict, param_groups, what, source):
    """The saved param groups, one per group of the optimizer."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(what)
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups):
        raise ValueError(f"{source} has {len(groups)} param groups, the optimizer has {len(param_groups)}")
    return groups


def parse(state_dict, param_groups, amsgrad_bound, state_format=state_formats.DEFAULT) -> tuple[list, dict]:
    """torch's state dict, checked: (the saved groups, parameter -> {key: tensor}).
    ``amsgrad_bound``: each group's amsgrad when the state was created (None before);
    ``state_format``: the optimizer's (amsgrad needs fp32 states)."""
    groups = checked_groups(state_dict, param_groups,
                            "state_dict must have 'state' and 'param_groups' (from optimizer.state_dict())",
                            "state_dict")
    index = paired(groups, param_groups)
    for gi, g_saved in enumerate(groups):
        if g_saved.get("amsgrad", False) and not state_formats.get(state_format).amsgrad:
            raise ValueError(f"saved param group {gi} has amsgrad=True, which needs fp32 states, but this "
                             f"optimizer's state_format is {state_format!r}: load it into a HybridAdamW built "
                             "with state_format='fp32'")
        bound = amsgrad_bound[gi] if amsgrad_bound is not None else None
        if bound is not None and bool(g_saved.get("amsgrad", False)) != bound:
            raise ValueError(f"saved param group {gi} has amsgrad={bool(g_saved.get('amsgrad', False))}, but "
                             f"this optimizer's state was created with amsgrad={bound}: load "
                             "it into a new HybridAdamW before its first step")
    entries = {}
    for i, st in state_dict["state"].items():
        if i not in index:
            raise ValueError(f"state_dict has state for unknown parameter index {i}")
        p, entry = index[i], {}
        for key, val in st.items():
            if key not in ("step", "master", *STATE_KEYS):
                raise ValueError(f"parameter {i}: unexpected state {key!r}")
            if key == "step" and not isinstance(val, torch.Tensor):
                val = torch.tensor(float(_checks.real(f"parameter {i}: step", val, lo=0.0)))
            check_state_value(i, key, val, torch.Size([]) if key == "step" else local(p).shape)
            entry[key] = val
        entries[p] = entry
    return groups, entries


def paired(groups, param_groups) -> dict:
    """The saved groups' parameter keys (positions, or names) -> our parameters, group by group, as
    torch's ``load_state_dict`` pairs them; groups of other lengths are refused."""
    index = {}
    for gi, (g_saved, g) in enumerate(zip(groups, param_groups)):
        if len(g_saved["params"]) != len(g["params"]):
            raise ValueError(f"saved param group {gi} has {len(g_saved['params'])} parameters, the "
                             f"optimizer's has {len(g['params'])}")
        index.update(zip(g_saved["params"], g["params"]))
    return index


def apply_groups(groups, param_groups, defaults) -> None:
    """As torch: each group becomes the saved one (with our parameters), missing keys from the
    defaults; and as torch's AdamW, decoupled_weight_decay is True whatever was saved (an Adam's)."""
    for g_saved, g in zip(groups, param_groups):
        params = g["params"]
        g.clear()
        g.update({k: v for k, v in g_saved.items() if k != "params"})
        g["params"] = params
        for k, v in defaults.items():
            g.setdefault(k, v)
        if "decoupled_weight_decay" in defaults:
            g["decoupled_weight_decay"] = True


def with_entries(out, entries, param_groups) -> dict:
    """torch's state dict ``out`` with the entries of parameters that have no state here (frozen,
    or loaded before the state exists) added under their indices; as in torch, a parameter no longer
    in the param groups (swapped out of them) has none."""
    if entries:
        index = {id(p): i for i, p in enumerate(p for g in param_groups for p in g["params"])}
        for p, entry in entries.items():
            if id(p) in index:
                out["state"][index[id(p)]] = entry
    return out


def torch_state_dict(opt) -> dict:
    """``torch.optim.Optimizer.state_dict`` without its hooks: the face runs them around the whole
    (the pre-hooks before the state is reconciled, the post-hooks on the dict it returns)."""
    pre, post = opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks
    opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks = {}, {}
    try:
        return torch.optim.Optimizer.state_dict(opt)
    finally:
        opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks = pre, post


def run_hooks(hooks, opt, *args):
    """Runs torch's optimizer hooks in their order: with a state dict (``args``), a hook that returns
    one replaces it for the hooks after it; returns the dict (or None)."""
    out = args[0] if args else None
    for hook in list(hooks.values()):
        got = hook(opt, out) if args else hook(opt)
        if args and got is not None:
            out = got
    return out


def in_format(entries, state_format) -> dict:
    """Loaded entries (parameter -> {key: tensor}) with m and v in ``state_format``, as the buffers will
    hold them once the state exists (``StateStore``'s conversion: 8-bit quantised or dequantised,
    floating cast), as torch's ``load_state_dict`` casts a loaded state at once."""
    dtype = state_formats.get(state_format).dtype
    out = {}
    for p, entry in entries.items():
        out[p] = {key: convert_moment(val, key, dtype, local(p))
                  if key in MOMENTS and isinstance(val, torch.Tensor) else val for key, val in entry.items()}
    return out


def sharded(params, state, param_groups, state_format=state_formats.DEFAULT, as_format=None) -> dict:
    """``{"state": {index: {key: tensor}}, "param_groups": [...]}`` over the buffers (host, or GPU
    for resident blocks). ``as_format``: the state format of the checkpoint the dict will be loaded
    from (default: ``state_format``, the optimizer's own); where 8-bit states are involved on either
    side the sharded m and v take that format's layout (:func:`_sharded_moment`), in new tensors where
    it is not the buffers'."""
    as_format = as_format or state_format
    out = {}
    for i, p in enumerate(params):
        st = state[p]
        entry = {"step": st["step"]}
        for key in ("master", *STATE_KEYS):
            if key not in st:
                continue
            if key in MOMENTS and (_blockwise(state_format) or _blockwise(as_format)):
                entry.update(_sharded_moment(p, key, st[key], state_format, as_format))
            else:
                entry[key] = _as_global(p, st[key])
        out[i] = entry
    return {"state": out, "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in param_groups]}


def as_shards(out, params, state, param_groups, state_format) -> dict:
    """torch's state dict ``out`` with the entries of FSDP2-sharded ``params`` as :func:`sharded` gives
    them: DTensors whose local shards are the buffers (8-bit m and v in that layout), as torch's AdamW
    keeps DTensor states for DTensor parameters. torch.distributed.checkpoint's ``get_state_dict`` and
    ``dcp.save`` then write every rank's shard, where plain local tensors would be taken for replicas
    and one rank's kept for all."""
    index = {id(p): i for i, p in enumerate(q for g in param_groups for q in g["params"])}
    for j, entry in sharded(params, state, param_groups, state_format)["state"].items():
        out["state"][index[id(params[j])]] = entry
    return out


def has_dtensors(state_dict) -> bool:
    """Whether a state dict's entries hold DTensors (a sharded one: :func:`as_shards`, or torch's
    AdamW's under FSDP2)."""
    from torch.distributed.tensor import DTensor

    entries = state_dict.get("state") if isinstance(state_dict, dict) else None
    return isinstance(entries, dict) and any(
        isinstance(v, DTensor) for e in entries.values() if isinstance(e, dict) for v in e.values())


def by_plan_index(state_dict, params, param_groups) -> dict:
    """A state dict keyed as torch's are (by what its param groups' ``params`` list: positions, or the
    names torch.distributed.checkpoint's ``set_state_dict`` gives them) keyed by positions in
    ``params`` (the engine's: :func:`load_sharded`); entries of parameters outside ``params`` are left
    out. The saved groups and ours are matched as torch's ``load_state_dict`` matches them."""
    groups = checked_groups(state_dict, param_groups, "a state dict has 'state' and 'param_groups'", "the state dict")
    mine, key_of = {id(p): j for j, p in enumerate(params)}, paired(groups, param_groups)
    state = {}
    for key, entry in state_dict["state"].items():
        if key not in key_of:
            raise ValueError(f"the state dict has state for a parameter its param groups do not list: {key!r}")
        if id(key_of[key]) in mine:
            state[mine[id(key_of[key])]] = entry
    return {**state_dict, "state": state}


def _blockwise(name) -> bool:
    """Whether a format's m and v are blockwise codes and scales (quant8's layout: 8-bit)."""
    return state_formats.get(name).blockwise


def _row_blocks(p):
    """Blocks of 8-bit scales per row of a parameter whose rows are whole blocks and, when sharded, is
    sharded by rows (each shard, a run of rows, then quantises in blocks that never straddle a row,
    at any world size), else None."""
    row = p.numel() // p.shape[0] if p.ndim >= 2 and p.shape[0] else 0
    if not row or row % quant8.BLOCK:
        return None
    if is_sharded(p) and [(type(pl).__name__, getattr(pl, "dim", None)) for pl in p.placements] != [("Shard", 0)]:
        return None
    return row // quant8.BLOCK


def _sharded_moment(p, key, buf, own, want) -> dict:
    """m or v of a parameter (sharded or not) in checkpoint format ``want``, from the optimizer's
    buffer of format ``own``. In 8-bit checkpoints, for a parameter whose rows are whole blocks: the
    codes, a uint8 DTensor shaped like the parameter, and ``<key>_scales``, fp32 of (rows, blocks per
    row), both sharded by rows like the parameter -- views of the buffer, so saving and loading copy
    nothing, and any world size reads the same blocks. For other parameters (norms, biases, rows cut
    across blocks): the values as fp32 shaped like the parameter, and ``<key>_rank_scales``, each
    rank's block scales as one row of (world size, blocks of the largest shard), so that at the same
    world size the codes come back exactly (quantised against the saved scales) and at another they
    are quantised afresh for the new blocks (the loader leaves the scales out). Floating checkpoints:
    the values. Loading converts whatever is not the buffer itself (:func:`load_sharded`)."""
    w = local(p)
    n, per_row = w.numel(), _row_blocks(p)
    own, want = _blockwise(own), _blockwise(want)
    if want and per_row is not None:
        shape = (w.shape[0], per_row)
        if own:
            codes = buf[:n].view(w.shape)
            scales = buf[quant8.codes_bytes(n):quant8.state_bytes(n)].view(torch.float32).view(shape)
        else:
            codes = torch.zeros(w.shape, dtype=torch.uint8, device=buf.device)
            scales = torch.zeros(shape, dtype=torch.float32, device=buf.device)
        return {key: _as_global(p, codes), key + "_scales": _as_global(p, scales, (p.shape[0], per_row))}
    if not own:
        values = buf
    elif n:
        values = quant8.dequantize(buf, n, key).view(w.shape)
    else:
        values = torch.zeros(w.shape)
    out = {key: _as_global(p, values)}
    if want:
        world, widest = _shards(p)
        scales = torch.zeros((1, quant8.blocks(widest)), dtype=torch.float32)
        if own and n:
            scales[0, :quant8.blocks(n)] = buf[quant8.codes_bytes(n):quant8.state_bytes(n)].view(torch.float32)
        out[key + "_rank_scales"] = _by_rank(p, scales, world)
    return out


def _shards(p) -> tuple:
    """(ranks the parameter is sharded over, elements of its largest shard): chunks as DTensor cuts."""
    if not is_sharded(p):
        return 1, p.numel()
    world, dim = p.device_mesh.size(), p.placements[0].dim
    rows = -(-p.shape[dim] // world) if p.shape[dim] else 0
    return world, rows * (p.numel() // p.shape[dim] if p.shape[dim] else 0)


def _by_rank(p, t, world):
    """``t`` (one row) as row r of a DTensor of ``world`` rows over the parameter's ranks (host mesh)."""
    if not is_sharded(p):
        return t
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(t, host_mesh(p.device_mesh), (Shard(0),), run_check=False,
                              shape=torch.Size((world, t.shape[1])), stride=(t.shape[1], 1))


def _moment_in(i, key, val, entry, dst, shape):
    """A loaded m or v (``val``, local) in the format of the buffer ``dst`` of a parameter of local
    ``shape``, with the scales that came with it in ``entry``: the buffer itself when DCP filled it
    in place."""
    n = math.prod(shape)
    at = quant8.codes_bytes(n)
    if val.dtype == torch.uint8 and tuple(val.shape) == tuple(shape):  # codes shaped like the parameter
        scales = entry.get(key + "_scales")
        if scales is None:
            raise ValueError(f"parameter {i}: the checkpoint has 8-bit codes of {key!r} without their scales")
        scales = local(scales)
        if dst.dtype == torch.uint8 and (not n or (val.data_ptr() == dst.data_ptr()
                                                   and scales.data_ptr() == dst.data_ptr() + at)):
            return dst
        buf = torch.zeros(quant8.state_bytes(n), dtype=torch.uint8)
        buf[:n] = val.reshape(-1).cpu()
        buf[at:quant8.state_bytes(n)] = scales.detach().reshape(-1).float().cpu().view(torch.uint8)
        val = buf
    if (dst.dtype == torch.uint8) == (val.dtype == torch.uint8):
        return val  # the same format (a floating one casts in the copy)
    check_state_value(i, key, val, shape)
    scales = entry.get(key + "_rank_scales")
    if dst.dtype == torch.uint8 and scales is not None:  # this rank's saved scales: the codes exactly
        return quant8.quantize(val, key, local(scales).reshape(-1)[:quant8.blocks(n)])
    return quant8.convert(val, key, dst.dtype, shape)


def load_sharded(state_dict, params, state, param_groups) -> list:
    """Copies what ``dcp.load`` put outside the buffers (normally nothing: it fills them in place)
    into them, converted to the buffers' format, after the same checks as ``load_state_dict``;
    returns the saved groups."""
    groups = checked_groups(state_dict, param_groups, "expected the dict from sharded_state_dict() "
                            "(after dcp.load)", "the checkpoint")
    plan = []
    for i, entry in state_dict["state"].items():
        if not isinstance(i, int) or not 0 <= i < len(params):
            raise ValueError(f"the checkpoint has state for unknown parameter index {i!r}")
        st, shape = state[params[i]], local(params[i]).shape
        for key, val in entry.items():
            if key in SCALE_KEYS:
                continue  # read with its moment
            if key not in st:
                raise ValueError(f"parameter {i}: unexpected state {key!r}")
            val, dst = local(val), st[key]
            if key in MOMENTS and isinstance(val, torch.Tensor):
                val = _moment_in(i, key, val, entry, dst, shape)
            check_state_value(i, key, val, torch.Size([]) if key == "step" else shape)
            if val.numel() and val.data_ptr() != dst.data_ptr():
                plan.append((dst, val))
    for dst, val in plan:
        dst.copy_(val)
    return groups


def _as_global(p, buf, shape=None):
    """The buffer as a DTensor over the parameter's ranks (the buffer itself is the local shard,
    nothing is copied): over a mesh of host tensors for a host buffer, the parameter's own mesh for
    a GPU-resident block's. ``shape``: the global shape when it is not the parameter's (sharded the
    same way)."""
    if not is_sharded(p):
        return buf
    from torch.distributed.tensor import DTensor

    mesh = p.device_mesh if buf.device.type == p.device_mesh.device_type else host_mesh(p.device_mesh)
    shape = torch.Size(shape or p.shape)
    stride = torch.empty(shape, device="meta").stride()
    out = DTensor.from_local(buf, mesh, p.placements, run_check=False, shape=shape, stride=stride)
    assert out.to_local().data_ptr() == buf.data_ptr() or not buf.numel()
    return out
