"""Process groups for runs started by torchrun.

``init_process_group()`` joins the group torchrun set up (gloo for CPU training, NCCL for GPUs). A
restarted group (``--max-restarts``) must never read what the dead round left in the rendezvous
store (a restarted gloo group then fails with "connection refused", an NCCL one waits for peers
that are gone). ``hytrain train --nproc`` starts torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
every round gets a store of its own. Under a torchrun that shares its agent's store across rounds
(its default), each round joins under a key prefix named by TORCHELASTIC_RESTART_COUNT. That count
agrees between the ranks of one node, but not across nodes: after a failure on one node the other
nodes' agents restart their workers for the membership change without counting it, and the two
halves then wait for each other under different prefixes until ``timeout_s``. So several nodes with
restarts need the variable above (a warning says so). A rank that dies makes its gloo peers'
collectives fail at once; NCCL peers wait in their collective until torchrun stops them (SIGTERM,
SIGKILL 30 s later) or ``timeout_s`` passes.

``bind_to_numa_node()`` keeps a rank on the NUMA node of its GPU, on machines with several: its CPU
update workers run there and its pinned state is first touched there, so each rank's share of the
host memory traffic stays on its own node's memory bus."""

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
    if (rank == 0 and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        import warnings

        warnings.warn("torchrun shares its rendezvous store across restarts: after a failure on one node, "
                      "the nodes' restarted workers may wait for each other until the timeout. Set "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node (hytrain train --nproc "
                      "does), or restart the job without torchrun's --max-restarts.", stacklevel=2)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"hytrain/attempt{attempt}/", store), rank=rank,
                            world_size=world, timeout=timeout)
    return rank, world


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    out = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def numa_nodes(root="/sys/devices/system/node") -> dict[int, list[int]]:
    """NUMA node -> its CPUs (empty where the kernel does not say)."""
    nodes = {}
    try:
        names = os.listdir(root)
    except OSError:
        return nodes
    for name in names:
        if name.startswith("node") and name[4:].isdigit():
            try:
                with open(os.path.join(root, name, "cpulist")) as f:
                    cpus = parse_cpulist(f.read())
            except OSError:
                continue
            if cpus:
                nodes[int(name[4:])] = cpus
    return nodes


def gpu_numa_node(index: int, pci_root="/sys/bus/pci/devices") -> int | None:
    """The NUMA node the GPU is attached to (from its PCI device in sysfs), or None."""
    import torch

    try:
        bus = torch.cuda.get_device_properties(index).pci_bus_id  # e.g. 0000:1B:00.0
    except (AttributeError, RuntimeError, AssertionError):
        return None
    for name in (bus.lower(), bus.lower()[4:]):
        try:
            with open(os.path.join(pci_root, name if name.count(":") == 2 else "0000:" + name, "numa_node")) as f:
                node = int(f.read().strip())
            return node if node >= 0 else None
        except (OSError, ValueError):
            continue
    return None


def rank_cpus(local_rank: int, local_world: int, nodes: dict[int, list[int]], allowed: set[int],
              gpu_nodes: list[int | None]) -> list[int]:
    """The CPUs a rank's process should run on: the NUMA node of its GPU (or, where that is not known,
    node ``local_rank * nodes // local_world``), shared evenly with the other ranks placed on the
    same node; only CPUs the process may use. Every CPU allowed when there is one node."""
    usable = {n: [c for c in cpus if c in allowed] for n, cpus in sorted(nodes.items())}
    usable = {n: cpus for n, cpus in usable.items() if cpus}
    if len(usable) < 2:
        return sorted(allowed)
    order = list(usable)

    def node_of(r):
        g = gpu_nodes[r] if r < len(gpu_nodes) else None
        return g if g in usable else order[r * len(order) // local_world]

    mine = node_of(local_rank)
    peers = [r for r in range(local_world) if node_of(r) == mine]
    cpus = usable[mine]
    i, n = peers.index(local_rank), len(peers)
    share = cpus[i * len(cpus) // n:(i + 1) * len(cpus) // n]
    return share or cpus


def bind_to_numa_node(local_rank: int | None = None, local_world: int | None = None) -> list[int]:
    """Binds this process (and so the CPU update workers it starts, and the first touch of the pinned
    memory it allocates) to its share of the CPUs of its GPU's NUMA node, on machines with several
    nodes; returns the CPUs it runs on. A no-op on one node. Call it before the optimizer's first
    step (the job does, under torchrun)."""
    import torch


    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    local_world = local_world_size() if local_world is None else local_world
    allowed = set(os.sched_getaffinity(0))
    nodes = numa_nodes()
    if len(nodes) < 2:
        return sorted(allowed)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_nodes = [gpu_numa_node(r) if r < gpus else None for r in range(local_world)]
    cpus = rank_cpus(local_rank, local_world, nodes, allowed, gpu_nodes)
    if set(cpus) != allowed:
        os.sched_setaffinity(0, cpus)
    return cpus


def process_cpus() -> int:
    """The CPUs this process may run on: its main thread's affinity (a helper thread, a gradient hook's
    or a thread pool's, may have been confined to fewer; threads started for the process's own work
    use these). ``os.cpu_count()`` where the platform has no affinity."""
    if not hasattr(os, "sched_getaffinity"):
        return max(1, os.cpu_count() or 1)
    return max(1, len(os.sched_getaffinity(os.getpid())))


def local_world_size() -> int:
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


# Update threads per NUMA node at most. The update is bound by the node's memory bandwidth, which 16
# to 32 threads already draw (docs/performance.md, section 1: one process on a 64-vCPU host updates
# 5.35 G parameters/s with 32 threads and 5.26 with 63); beyond that, threads only wait on memory, and
# on a virtual machine whose vCPUs are not all backed by cores at once they are what the hypervisor
# takes away: with 63 workers on 64 vCPUs, 15-25 vCPUs' worth of time was stolen in every step and
# each step's first block waited 50-200 ms for its sleeping workers to be run again (section 3,
# "Why hytrain's iterations alternate").
MAX_WORKERS_PER_NODE = 32


def default_workers(nodes=None) -> int:
    """CPU update threads for this process: the cores it may use, shared with the other processes of
    the node (torchrun starts one per GPU; each gets its share, less one for its training thread),
    and at most ``MAX_WORKERS_PER_NODE`` for each NUMA node those cores are on. Where the affinity
    already narrows the cores to this process's share, that share is used as is."""
    allowed = os.sched_getaffinity(0)
    cores = len(allowed)
    per_node = local_world_size()
    total = os.cpu_count() or cores
    share = cores if cores < total else cores // per_node
    nodes = numa_nodes() if nodes is None else nodes
    spanned = sum(1 for cpus in nodes.values() if allowed.intersection(cpus)) or 1
    return max(1, min(share - 1, MAX_WORKERS_PER_NODE * spanned))
