"""The optimizer's collectives: what HybridAdamW needs of torch.distributed when its parameters are sharded by FSDP2
(``torch.distributed.fsdp.fully_shard``): the process group the shards are spread over, and the few
small collectives that keep the ranks' steps exact -- the global gradient norm (each rank has the
squared norm of its own shards) and GradScaler's overflow flag (a step is skipped on every rank or
on none). Nothing here runs for unsharded parameters."""

from __future__ import annotations

import torch

from .common import is_sharded


def shard_group(params):
    """The process group of FSDP2-sharded parameters, or None when none is sharded. All or none must
    be sharded, on one 1-D device mesh with Shard placements (fully_shard's layout); anything else is
    refused with a ValueError that says what to do."""
    sharded = [is_sharded(p) for p in params]
    if not any(sharded):
        return None
    if not all(sharded):
        n = sum(1 for s in sharded if not s)
        raise ValueError(f"{n} of {len(params)} parameters are not sharded while the others are DTensors: "
                         "apply fully_shard to the whole model (its root too) so that every parameter is "
                         "sharded, or to none of it")
    mesh = params[0].device_mesh
    for i, p in enumerate(params):
        if p.device_mesh != mesh:
            raise ValueError(f"parameter {i} is sharded over another device mesh than parameter 0; "
                             "HybridAdamW needs one mesh for all of them")
        if mesh.ndim != 1 or any(type(pl).__name__ != "Shard" for pl in p.placements):
            raise ValueError(f"parameter {i} has placements {tuple(p.placements)} on a {mesh.ndim}-D mesh: "
                             "HybridAdamW supports fully_shard on a 1-D mesh (Shard placements); "
                             "hybrid sharding (HSDP) and tensor parallelism are not supported")
    return mesh.get_group()


def host_mesh(mesh):
    """The mesh as host (CPU) tensors see it: the same ranks and process group, device type "cpu".
    The optimizer's shards are host buffers; a DTensor over a CUDA mesh would copy them to the GPU
    (``DTensor.from_local`` moves a local tensor to its mesh's device), so that a checkpoint load
    would fill the GPU copy and not the buffers, and a save would stage the whole state in GPU memory.
    Only metadata: no collective runs on it."""
    if mesh.device_type == "cpu":
        return mesh
    cached = _HOST_MESHES.get(id(mesh))
    if cached is None or cached[0] is not mesh:
        from torch.distributed.device_mesh import DeviceMesh

        cpu = DeviceMesh.from_group(mesh.get_group(), "cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
        cached = _HOST_MESHES[id(mesh)] = (mesh, cpu)
    return cached[1]


_HOST_MESHES = {}


def all_reduce(t: torch.Tensor, group, op="sum") -> torch.Tensor:
    """t reduced over the group, in place (sum or max). A host tensor over a group without a CPU
    backend (NCCL alone: FSDP2's ``CPUOffloadPolicy`` keeps the shards, and so the gradients and
    their norms, on the host while the mesh is a CUDA mesh) is reduced through this rank's GPU."""
    import torch.distributed as dist

    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    if t.device.type == "cpu" and not _reduces_on_cpu(group):
        on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu, op=reduce_op, group=group)
        return t.copy_(on_gpu)
    dist.all_reduce(t, op=reduce_op, group=group)
    return t


def _reduces_on_cpu(group) -> bool:
    """Whether the group has a backend for host tensors: gloo (or MPI, UCC), alone or beside NCCL
    ("cpu:gloo,cuda:nccl", or the default backend torch picks by device); NCCL alone has none."""
    import torch.distributed as dist

    group = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return group._get_backend(torch.device("cpu")) is not None
    except RuntimeError:  # "No backend type associated with device type cpu"
        return False
    except AttributeError:  # (a torch without the per-device lookup)
        return any(name in str(dist.get_backend(group)).lower() for name in ("gloo", "mpi", "ucc"))


def host_group(group):
    """A process group for small agreements between the ranks' host threads, over the same ranks as
    ``group``: ``group`` itself when it is gloo; a gloo group when it is NCCL (a collective on a
    CUDA tensor read back on the host would wait for all the GPU work queued before it, and the
    agreement is made while backward's updates are still running). Every rank of the job must call
    it, together (``new_group`` is collective over the default group)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return group
    return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo")


def agree_min(value: int, group) -> int:
    """The smallest of the ranks' integers (a host-side all-reduce on ``group``, a gloo group)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t[0])
