"""What the parts of HybridAdamW share."""

import torch

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def is_sharded(p) -> bool:
    """Whether p is a DTensor (a parameter sharded by FSDP2's fully_shard)."""
    return type(p).__name__ == "DTensor" and hasattr(p, "to_local")


def local(t):
    """The tensor a DTensor holds on this rank (its shard), else t itself; never part of a graph."""
    if is_sharded(t):
        with torch.no_grad():
            return t.to_local()
    return t
