"""What the parts of HybridAdamW share."""

import torch

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
MOMENTS = STATE_KEYS[:2]  # m and v: kept in the state format (fp32, bf16 or 8-bit); the rest in fp32


def is_sharded(p) -> bool:
    """Whether p is a DTensor (a parameter sharded by FSDP2's fully_shard)."""
    return type(p).__name__ == "DTensor" and hasattr(p, "to_local")


def local(t):
    """The tensor a DTensor holds on this rank (its shard), else t itself; never part of a graph."""
    if is_sharded(t):
        with torch.no_grad():
            return t.to_local()
    return t
