"""Training run for the multi-process tests, started by torchrun (gloo on CPUs, NCCL on GPUs) or as a
plain process. A small Llama-style model, the same fixed global batch every run; each rank trains on
its slice of it, the model is sharded by FSDP2 (fully_shard per layer and at the root) unless --plain,
and HybridAdamW updates each rank's shards. Rank 0 writes a JSON file: the global losses, the grad
norms, and the full weights after training (and after a resume, when asked)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hytrain
from hytrain.models import LlamaConfig, LlamaModel

CFG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                  num_kv_heads=2, max_seq_len=64)
GLOBAL_BATCH = 4


def data(steps):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, 32), generator=g) for _ in range(steps)]


def _full(t):
    """A DTensor's whole tensor (gathered on every rank). A host shard over a group with NCCL alone (FSDP2's
    CPU offload; the optimizer's host buffers) is gathered through this rank's GPU."""
    if not hasattr(t, "full_tensor"):
        return t
    mesh, local = t.device_mesh, t.to_local()
    if local.device.type == "cpu" and dist.get_backend(mesh.get_group()) == "nccl":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor

        on_gpu = mesh if mesh.device_type == "cuda" else DeviceMesh.from_group(mesh.get_group(), "cuda")
        t = DTensor.from_local(local.to("cuda"), on_gpu, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor()


def _torch_dcp(path, model, opt, step=None):
    """Saves (``step``) or loads the model and optimizer as torch documents for FSDP2: get_state_dict,
    dcp.save / dcp.load, set_state_dict. Returns the step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    if step is not None:
        dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=path)
        return step
    saved = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
    dcp.load(saved, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return int(saved["step"])


def _dump(path, model, opt):
    if dist.is_initialized() and dist.get_world_size() > 1:
        path = f"{path}.{dist.get_rank()}"  # each rank's own shards
    opt.synchronize()  # the optimizer's own buffers (each rank's shards, in its format), as they are
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {i: {k: v.detach().cpu().clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
             for i, p in enumerate(params) if opt.state.get(p)}
    weights = {n: _full(p).detach().float().cpu().clone()
               for n, p in model.named_parameters()}
    torch.save({"state": state, "weights": weights}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--plain", action="store_true", help="one process, no sharding (the reference)")
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--routed-clip", type=float, default=None, help="clip through opt.clip_grad_norm_")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gpu-blocks", default="auto", help="k: an integer, or auto")
    ap.add_argument("--state-format", default="fp32", choices=("fp32", "bf16", "8bit"))
    ap.add_argument("--hidden", type=int, default=CFG.hidden_size,
                    help="hidden size (256: rows of whole 8-bit blocks in most matrices)")
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (hytrain.dist_checkpoint)")
    ap.add_argument("--save-at", type=int, default=None, help="save after this step, then stop")
    ap.add_argument("--save-every", type=int, default=None, help="save after every N steps and go on")
    ap.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --ckpt")
    ap.add_argument("--resume-if-any", action="store_true", help="resume when --ckpt has a checkpoint")
    ap.add_argument("--die-at", type=int, default=None,
                    help="rank 1 exits at this step in the first attempt (torchrun restarts the group)")
    ap.add_argument("--no-speculate", action="store_true")
    ap.add_argument("--cpu-offload", action="store_true",
                    help="FSDP2's CPUOffloadPolicy: the shards (and their gradients) on the host, HybridAdamW "
                         "updating them in place; bf16 compute on a GPU (MixedPrecisionPolicy)")
    ap.add_argument("--scaler", type=float, default=None,
                    help="loss scaling from this initial scale: GradScaler (one process; HybridAdamW takes the "
                         "scale) or ShardedGradScaler with unscale_ before step (sharded)")
    ap.add_argument("--torch-dcp", action="store_true",
                    help="--save-at and --resume through torch's get_state_dict/set_state_dict and dcp, not "
                         "hytrain.dist_checkpoint")
    ap.add_argument("--torch-first", type=int, default=0,
                    help="the first N steps with torch's AdamW, whose state_dict() HybridAdamW then loads")
    ap.add_argument("--dump-state", default=None,
                    help="torch.save the optimizer's state_dict() here after a resume or a save")
    args = ap.parse_args()
    distributed = "RANK" in os.environ and not args.plain
    if distributed:
        from hytrain.distributed import init_process_group

        rank, world = init_process_group("gloo" if args.device == "cpu" else "nccl")
    else:
        rank, world = 0, 1
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    cfg = CFG if args.hidden == CFG.hidden_size else dataclasses.replace(CFG, hidden_size=args.hidden)
    model = LlamaModel(cfg).to(getattr(torch, args.dtype)).to(device)
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))  # FSDP2's default is a CUDA mesh wherever CUDA is
        policy = {}
        if args.cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

            policy["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
            if device.type == "cuda":
                policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
    opt = hytrain.HybridAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model,
                              max_grad_norm=args.clip, workers=1,
                              speculate=False if args.no_speculate else "auto", state_format=args.state_format,
                              gpu_blocks=args.gpu_blocks if args.gpu_blocks == "auto" else int(args.gpu_blocks))
    start = 0
    if args.resume_if_any and (Path(args.ckpt) / "checkpoints" / "latest").is_file():
        args.resume = True
    if args.resume and args.torch_dcp:
        start = _torch_dcp(args.ckpt, model, opt)
    elif args.resume:
        from hytrain import dist_checkpoint

        start = dist_checkpoint.load(dist_checkpoint.resolve(args.ckpt), model, opt)["step"]
        if args.dump_state:
            _dump(args.dump_state, model, opt)
    losses, norms, scales = [], [], []
    scaler = None
    if args.scaler is not None:
        if distributed:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(device.type, init_scale=args.scaler)
        else:
            scaler = torch.amp.GradScaler(device.type, init_scale=args.scaler)
    hybrid, first = opt, None
    if args.torch_first:  # (the same hyperparameters; no clipping)
        first = opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for i, x in enumerate(data(args.steps)[start:], start=start + 1):
        if args.die_at == i and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os._exit(3)
        if first is not None and i == args.torch_first + 1:
            hybrid.load_state_dict(first.state_dict())  # (DTensor states, when sharded)
            opt = hybrid
        rows = x.shape[0] // world
        mine = x[rank * rows:(rank + 1) * rows].to(device)
        loss = model(mine, mine)
        if scaler is not None:
            scaler.scale(loss).backward()
            if distributed:  # agrees found_inf across ranks, for the scale's update too (GradScaler does not)
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(float(scaler.get_scale()))
            total = loss.detach().float().clone()
            if distributed:
                dist.all_reduce(total)
            losses.append(float(total) / world)
            continue
        loss.backward()
        if args.routed_clip is not None:
            norms.append(float(opt.clip_grad_norm_(args.routed_clip)))
        opt.step()
        opt.zero_grad()
        if getattr(opt, "last_grad_norm", None) is not None and args.routed_clip is None:
            norms.append(opt.last_grad_norm)
        total = loss.detach().float().clone()
        if distributed:
            dist.all_reduce(total)
        losses.append(float(total) / world)
        if args.save_at == i and args.torch_dcp:
            _torch_dcp(args.ckpt, model, opt, step=i)
            break
        if args.save_at == i:
            from hytrain import dist_checkpoint

            dist_checkpoint.save(args.ckpt, i, model, opt)
            if args.dump_state:
                _dump(args.dump_state, model, opt)
            break
        if args.save_every and i % args.save_every == 0:
            from hytrain import dist_checkpoint

            dist_checkpoint.save(args.ckpt, i, model, opt)
    opt.synchronize()
    weights = {}
    for name, p in model.named_parameters():
        full = _full(p)
        weights[name] = full.detach().float().cpu().flatten().tolist()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "norms": norms, "scales": scales, "weights": weights, "world": world, "start": start}, f)
    if distributed:
        # Done (the last collective was the weights' gather; rank 0 has written its file): leave
        # without the process group's teardown, in which gloo now and then aborts a process whose
        # peers have already gone ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
