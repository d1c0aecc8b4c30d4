"""State entries from outside the store: those loaded (a state_dict, entries carried over, those the
state starts from) copied into its buffers in their format and place, and what the loop did to
``optimizer.state`` between calls, found by identity and checked as a load checks. Functions over
the plan and the state dict; the ``StateStore`` keeps the buffers they write."""

from __future__ import annotations

import torch

from .. import quant8
from .common import MOMENTS, STATE_KEYS, convert_moment, local


def copy_in(plan, state, entries, *, reset_missing, reset=(), weights=local) -> tuple[list, list]:
    """Copies loaded state entries (parameter -> {key: tensor}, checked) into the buffers of
    ``state``; with ``reset_missing`` the parameters without an entry start afresh (step 0, zero
    moments, the master from the weights), else those in ``reset``. Returns (the parameters started
    afresh, those whose entry had a master)."""
    copies, mastered, fresh = [], [], []
    for p in plan.params:
        mine = state[p]
        entry = entries.get(p)
        if entry is None:
            if reset_missing or p in reset:
                fresh.append(p)
                for key in ("step", *STATE_KEYS):
                    if key in mine:
                        copies.append((mine[key], None, key, p))
                if "master" in mine:
                    copies.append((mine["master"], weights(p).detach(), "master", p))
            continue
        if "master" in entry:
            mastered.append(p)
        for key, val in entry.items():
            if key == "master" and key not in mine:
                if p.dtype != torch.float32:
                    raise ValueError(f"parameter {plan.index(p)}: unexpected state 'master'")
                dst = local(p)  # fp32 parameters updated in place are their own master
            elif key in mine:
                dst = mine[key]
            else:
                raise ValueError(f"parameter {plan.index(p)}: state {key!r} does not fit this "
                                 "optimizer (amsgrad differs?)")
            copies.append((dst, val, key, p))
    with torch.no_grad():
        for dst, src, key, p in copies:
            if src is None:
                dst.zero_()
            elif key in MOMENTS:  # m and v in the buffer's format (8-bit or floating)
                dst.copy_(convert_moment(local(src), key, dst.dtype, local(p)))
            else:
                dst.copy_(local(src))
    return fresh, mastered


def changes(plan, state, owned) -> tuple[dict, set]:
    """What the loop changed in ``state`` (``optimizer.state``) since the store last wrote it
    (``owned``: id(p) -> the tensors it put in state[p]), found by identity (no copy, no read of the
    values): (parameter -> {key: the tensor put there} for replaced tensors, the parameters whose
    entry was removed or emptied). A key deleted from an entry that is otherwise there is refused,
    as torch's AdamW would fail on it too."""
    replaced, removed = {}, set()
    for p in plan.params:
        mine = owned.get(id(p))
        if not mine:
            continue  # no state here (an empty shard, or not made yet)
        cur = state.get(p)
        if cur is None or (isinstance(cur, dict) and not cur):
            removed.add(p)
            continue
        if cur is not mine and not isinstance(cur, dict):
            raise TypeError(f"optimizer.state[p] of parameter {plan.index(p)} is a "
                            f"{type(cur).__name__}, not a dict")
        diff = {}
        for key, t in mine.items():
            got = cur.get(key)
            if got is t:
                continue
            if got is None:
                raise KeyError(f"optimizer.state[p] of parameter {plan.index(p)} lost {key!r}; remove "
                               "the whole entry (del optimizer.state[p]) to start that parameter afresh")
            diff[key] = got
        if diff:
            replaced[p] = diff
    return replaced, removed


def checked(plan, entries: dict) -> dict:
    """Entries the loop put in ``optimizer.state`` (parameter -> {key: value}), checked as a load
    checks them -- a key of this optimizer's state, as many elements as the parameter, floating
    point (the counter: one value) -- and shaped for :func:`copy_in`."""
    out = {}
    for p, entry in entries.items():
        want, i = local(p).numel(), plan.index(p)
        kept = {}
        for key, got in entry.items():
            if key not in ("step", "master", *STATE_KEYS):
                raise ValueError(f"optimizer.state[p] of parameter {i} has {key!r}, which is not a state of "
                                 "AdamW (step, exp_avg, exp_avg_sq, max_exp_avg_sq, master)")
            got = torch.as_tensor(got)
            n = local(got).numel() if hasattr(got, "to_local") else got.numel()
            codes = key in MOMENTS and got.dtype == torch.uint8  # an 8-bit buffer (quant8)
            need = 1 if key == "step" else quant8.state_bytes(want) if codes else want
            if n != need:
                raise ValueError(f"optimizer.state[p][{key!r}] of parameter {i} was replaced by a tensor of "
                                 f"{n} elements (shape {tuple(got.shape)}); it needs {need}")
            if not (got.is_floating_point() or key == "step" or codes):
                raise TypeError(f"optimizer.state[p][{key!r}] of parameter {i} was replaced by a "
                                f"{got.dtype} tensor; it needs a floating-point one")
            kept[key] = got.reshape(()) if key == "step" else got
        out[p] = kept
    return out
