"""Process groups for runs started by torchrun.

``init_process_group()`` joins the group torchrun set up (gloo for CPU training, NCCL for GPUs). When
torchrun has restarted the group after a failure (``--max-restarts``), the new attempt rendezvouses
under a key prefix of its own in torchrun's store, so that it never reads the addresses a dead
attempt left there (without it, a restarted gloo group can fail with "connection refused"). A rank
that dies makes its peers' collectives fail at once (the connection drops) and torchrun stops and
restarts the group; ``timeout_s`` bounds a collective that hangs instead."""

from __future__ import annotations

import datetime
import os


def init_process_group(backend: str | None = None, timeout_s: float = 600.0):
    """Initialises torch.distributed from torchrun's environment; returns (rank, world size). Outside
    torchrun (no RANK in the environment) it does nothing and returns (0, 1)."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        return 0, 1
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return rank, world
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"hytrain/attempt{attempt}/", store), rank=rank,
                            world_size=world, timeout=timeout)
    return rank, world
