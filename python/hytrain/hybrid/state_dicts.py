"""The optimizer's state dicts: torch's (``state_dict``/``load_state_dict``: parsed and checked before
anything changes) and the one for ``torch.distributed.checkpoint`` (the buffers themselves, as
DTensors over the parameters' mesh for FSDP2 shards)."""

from __future__ import annotations

import torch

from .. import _checks
from .collectives import host_mesh
from .common import STATE_KEYS, is_sharded, local
from .settings import check_state_value


def checked_groups(state_dict, param_groups, what, source):
    """The saved param groups, one per group of the optimizer."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(what)
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups):
        raise ValueError(f"{source} has {len(groups)} param groups, the optimizer has {len(param_groups)}")
    return groups


def parse(state_dict, param_groups, amsgrad_bound, state_format="fp32") -> tuple[list, dict]:
    """torch's state dict, checked: (the saved groups, parameter -> {key: tensor}).
    ``amsgrad_bound``: each group's amsgrad when the state was created (None before);
    ``state_format``: the optimizer's (amsgrad needs fp32 states)."""
    groups = checked_groups(state_dict, param_groups,
                            "state_dict must have 'state' and 'param_groups' (from optimizer.state_dict())",
                            "state_dict")
    index = {}
    for gi, (g_saved, g) in enumerate(zip(groups, param_groups)):
        if len(g_saved["params"]) != len(g["params"]):
            raise ValueError(f"saved param group {gi} has {len(g_saved['params'])} parameters, the "
                             f"optimizer's has {len(g['params'])}")
        if g_saved.get("amsgrad", False) and state_format != "fp32":
            raise ValueError(f"saved param group {gi} has amsgrad=True, which needs fp32 states, but this "
                             f"optimizer's state_format is {state_format!r}: load it into a HybridAdamW built "
                             "with state_format='fp32'")
        bound = amsgrad_bound[gi] if amsgrad_bound is not None else None
        if bound is not None and bool(g_saved.get("amsgrad", False)) != bound:
            raise ValueError(f"saved param group {gi} has amsgrad={bool(g_saved.get('amsgrad', False))}, but "
                             f"this optimizer's state was created with amsgrad={bound}: load "
                             "it into a new HybridAdamW before its first step")
        for i, p in zip(g_saved["params"], g["params"]):
            index[i] = p
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


def apply_groups(groups, param_groups, defaults) -> None:
    """As torch: each group becomes the saved one (with our parameters), missing keys from the
    defaults."""
    for g_saved, g in zip(groups, param_groups):
        params = g["params"]
        g.clear()
        g.update({k: v for k, v in g_saved.items() if k != "params"})
        g["params"] = params
        for k, v in defaults.items():
            g.setdefault(k, v)


def with_entries(out, entries, param_groups) -> dict:
    """torch's state dict ``out`` with the entries of parameters that have no state here (frozen,
    or loaded before the state exists) added under their indices."""
    if entries:
        index = {id(p): i for i, p in enumerate(p for g in param_groups for p in g["params"])}
        for p, entry in entries.items():
            out["state"][index[id(p)]] = entry
    return out


def sharded(params, state, param_groups) -> dict:
    """``{"state": {index: {key: tensor}}, "param_groups": [...]}`` over the buffers (host, or GPU
    for resident blocks)."""
    out = {}
    for i, p in enumerate(params):
        st = state[p]
        entry = {"step": st["step"]}
        for key in ("master", *STATE_KEYS):
            if key in st:
                entry[key] = _as_global(p, st[key])
        out[i] = entry
    return {"state": out, "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in param_groups]}


def load_sharded(state_dict, params, state, param_groups) -> list:
    """Copies what ``dcp.load`` put outside the buffers (normally nothing: it fills them in place)
    into them, after the same checks as ``load_state_dict``; returns the saved groups."""
    groups = checked_groups(state_dict, param_groups, "expected the dict from sharded_state_dict() "
                            "(after dcp.load)", "the checkpoint")
    plan = []
    for i, entry in state_dict["state"].items():
        if not isinstance(i, int) or not 0 <= i < len(params):
            raise ValueError(f"the checkpoint has state for unknown parameter index {i!r}")
        st = state[params[i]]
        for key, val in entry.items():
            if key not in st:
                raise ValueError(f"parameter {i}: unexpected state {key!r}")
            val, dst = local(val), st[key]
            check_state_value(i, key, val, dst.shape)
            if val.numel() and val.data_ptr() != dst.data_ptr():
                plan.append((dst, val))
    for dst, val in plan:
        dst.copy_(val)
    return groups


def _as_global(p, buf):
    """The buffer as a DTensor over the parameter's ranks (the buffer itself is the local shard,
    nothing is copied): over a mesh of host tensors for a host buffer, the parameter's own mesh for
    a GPU-resident block's."""
    if not is_sharded(p):
        return buf
    from torch.distributed.tensor import DTensor

    mesh = p.device_mesh if buf.device.type == p.device_mesh.device_type else host_mesh(p.device_mesh)
    out = DTensor.from_local(buf, mesh, p.placements, run_check=False,
                             shape=p.shape, stride=p.stride())
    assert out.to_local().data_ptr() == buf.data_ptr() or not buf.numel()
    return out
