"""Training across the GPUs of one node: hytrain (FSDP2 + HybridAdamW, each rank updating its shards
on its share of the CPU cores) against DeepSpeed ZeRO-2 with offload_optimizer (DeepSpeedCPUAdam
after backward; when DeepSpeed is importable) and FSDP2 with its own CPUOffloadPolicy (fp32 shards
and gradients in pinned host memory; torch's AdamW on the CPU after backward, nothing overlapped, or
HybridAdamW updating those shards in place at step(): ``fsdp2_cpu_offload_hybrid``); same model, same per-GPU batch (so the same global
batch at each N), activation checkpointing in every mode, one torchrun per mode and N.

    python bench/scale_bench.py --nprocs 1,2,4 --model l7b --batch 2 --seq 1024

Per mode and N (one JSON line): iteration time (median of the timed iterations), the first
iteration's time (page-locking and the first plan included), tokens/s per GPU,
peak GPU memory (allocated and reserved) and peak host memory per rank (the largest rank), hytrain's
GPU wait share and k per rank. With ``--cap deepspeed`` (the default when DeepSpeed runs) hytrain
plans with DeepSpeed's reserved peak at the same N as its GPU memory limit, and the caching
allocator is held to it too (``set_per_process_memory_fraction``: reserved bytes count, as
DeepSpeed's do): the comparison at equal GPU memory. Then a line of ratios: hytrain against each other mode at each N, and hytrain's scaling
efficiency (per-GPU tokens/s at N over its own at N = 1). A worker that fails is one line naming
its exception. ``--device cpu`` runs the harness on CPU ranks (gloo; no DeepSpeed, no cap) to check
it before a GPU machine's time is spent on it; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timed_window import window_figures  # noqa: E402

MODES = ("deepspeed_offload", "hytrain", "hytrain_8bit", "fsdp2_cpu_offload", "fsdp2_cpu_offload_hybrid")
# (DeepSpeed first: its peak caps hytrain.) The two FSDP2 offload modes: torch's AdamW, or HybridAdamW
# updating FSDP2's host shards in place (fp32 states; its own streams are not used there).
OFFLOAD_MODES = ("fsdp2_cpu_offload", "fsdp2_cpu_offload_hybrid")
STATE_FORMATS = {"hytrain": "fp32", "hytrain_8bit": "8bit"}
# Host bytes the CPU update moves per parameter (bf16 gradient in, bf16 weight out): fp32 master, m
# and v read and written; 8-bit m and v as codes with their block scales (about 1 byte each way).
UPDATE_BYTES = {"fp32": 28, "8bit": 16}
SHAPES = {  # presets of hytrain.models.presets plus larger Llama shapes
    "13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40,
                num_kv_heads=40),
    "20b": dict(vocab_size=32000, hidden_size=6144, intermediate_size=16384, num_layers=44, num_heads=48,
                num_kv_heads=48),
    # capacity_bench.py's 32b (Qwen2.5-32B's shape as a Llama) and 50b (50.7 B): with --meta-init
    "32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64, num_heads=40,
                num_kv_heads=8),
    "50b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=22016, num_layers=62, num_heads=64,
                num_kv_heads=64),
}
LR, WD, CLIP = 1e-4, 0.01, 1.0


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from hytrain.models import LlamaConfig
    from hytrain.models.presets import PRESETS

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    offload = args.mode in OFFLOAD_MODES
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if offload and cuda:  # the offloaded gradients are CPU tensors: clipping's norm is reduced over gloo
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    mesh = init_device_mesh(args.device, (world,))  # NCCL on GPUs, gloo on the CPU
    shape = {**PRESETS, **SHAPES}[args.model]
    cfg = LlamaConfig(**shape, max_seq_len=args.seq)
    torch.manual_seed(0)
    meta = args.meta_init and args.mode in STATE_FORMATS
    model = build_meta(cfg) if meta else build(cfg, None if offload else args.device)
    if args.mode == "deepspeed_offload":
        return deepspeed_worker(args, model, cfg, rank, world)
    if offload:  # fp32 parameters stay on the CPU, bf16 compute on the GPU (FSDP2's mixed precision)
        policy = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=cuda),
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda
                      else MixedPrecisionPolicy())
    else:  # bf16 weights on the GPU; fp32 masters and Adam states in the host pool
        policy = dict(mesh=mesh)
    for layer in model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    if meta:
        materialize(model, args.device)
    if offload:  # the rotary tables are buffers, not parameters: they go to the GPU either way
        model.rope_cos, model.rope_sin = model.rope_cos.to(args.device), model.rope_sin.to(args.device)
    if cuda:
        torch.cuda.empty_cache()  # the whole model built on each GPU is gone: only this rank's shards stay
    if args.mode in STATE_FORMATS:
        import hytrain

        cap = int(args.cap_gb * 1e9) if args.cap_gb and cuda else None
        if cap is not None:  # the allocator holds hytrain's reserved bytes (not only its plan) at the cap
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        opt = hytrain.HybridAdamW(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=CLIP, model=model,
                                  gpu_memory_limit=cap, state_format=STATE_FORMATS[args.mode], workers=args.workers)
    elif args.mode == "fsdp2_cpu_offload_hybrid":  # the shards are host fp32 tensors: their own masters
        import hytrain

        opt = hytrain.HybridAdamW(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=CLIP, model=model)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    x = batch(args, cfg, rank)
    plans = []  # hytrain, per iteration from the first: (step() seconds, k, speculation's start, grad norm)

    def iteration():
        loss = model(x, x)
        loss.backward()
        if args.mode not in (*STATE_FORMATS, "fsdp2_cpu_offload_hybrid"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        t = time.perf_counter()
        opt.step()
        if args.mode in STATE_FORMATS:
            norm = opt.last_grad_norm  # (a step that clips does not let the next backward speculate)
            plans.append((round(time.perf_counter() - t, 4), opt.gpu_blocks,
                          opt.schedule_stats().get("speculative_from"), None if norm is None else round(norm, 3)))
        opt.zero_grad()

    times = timed(iteration, args)
    extra = {}
    if args.mode in STATE_FORMATS:
        stats, placed = opt.schedule_stats(), opt.residency()
        local = [sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in b) for b in opt.blocks]
        extra = dict(gpu_wait_frac=stats.get("gpu_wait_frac"), k=stats.get("k"), cap_gb=args.cap_gb,
                     cpu_params=sum(n for b, n in enumerate(local) if b not in set(placed["gpu"])),
                     blocks=len(local), state_host_gb=placed["host_bytes"] / 1e9,
                     workers=args.workers or hytrain.distributed.default_workers(),
                     # the settling, rank by rank: every iteration from the first
                     per_iteration={"step_call_s": [p[0] for p in plans], "k": [p[1] for p in plans],
                                    "speculative_from": [p[2] for p in plans],
                                    "grad_norm": [p[3] for p in plans],
                                    "shadow_allocations": stats.get("shadow_allocations"),
                                    "shadows_ahead": stats.get("shadows_ahead")})
    report(args, model, times, rank, world, extra)


def build(cfg, device):
    """The model, with activation checkpointing: for FSDP2's CPU offload (``device`` None) built on
    the host in fp32 (fully_shard keeps each rank's shards pinned there); else built where it trains,
    on the ``device`` in bf16 (on a GPU seconds, where building L7B on the host in fp32 takes minutes,
    and the host peak is then the optimizer's own), sharded by fully_shard in place or handed whole
    to DeepSpeed."""
    import torch

    from hytrain.models import LlamaModel

    if device is None:
        return LlamaModel(cfg, checkpointing=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return LlamaModel(cfg, checkpointing=True)
    finally:
        torch.set_default_dtype(default)


def build_meta(cfg):
    """The model in bf16 with its parameters on the meta device (its buffers, the rotary tables, real):
    for ``--meta-init``, where the whole model does not fit one GPU to be built there and sharded."""
    import torch

    from capacity_bench import params_on_meta
    from hytrain.models import LlamaModel

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with params_on_meta():
            return LlamaModel(cfg, checkpointing=True)
    finally:
        torch.set_default_dtype(default)


def materialize(model, device):
    """After fully_shard: each rank's shards allocated on ``device`` and initialised there (norms to
    ones, matrices from capacity_bench's tiled N(0, 0.02) pool), the buffers moved as they were."""
    import torch

    from capacity_bench import init_params

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in buffers.items():
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, leaf, b.to(device))
    init_params(list(model.parameters()))


def deepspeed_worker(args, model, cfg, rank, world):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "gradient_clipping": CLIP,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                    "contiguous_gradients": True, "overlap_comm": True},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = batch(args, cfg, rank)

    def iteration():
        engine.backward(engine(x, x))
        engine.step()

    report(args, model, timed(iteration, args), rank, world, {})


def batch(args, cfg, rank):
    """The rank's fixed batch of random tokens (its slice of the global batch)."""
    import torch

    g = torch.Generator(device=args.device).manual_seed(rank)
    return torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=args.device, generator=g)


def timed(iteration, args) -> tuple[float, list[float], list[float]]:
    """The first iteration's wall time (page-locking, the first plan), those of the iterations after
    the warm-up, and every iteration's, each between two device synchronisations."""
    import torch

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # peaks of training, not of building the model
    times = []
    for _ in range(args.warmup + args.iters):
        sync()
        t0 = time.perf_counter()
        iteration()
        sync()
        times.append(time.perf_counter() - t0)
    return times[0], times[args.warmup:], times


def report(args, model, timing, rank, world, extra):
    import torch
    import torch.distributed as dist

    first, times, every = timing
    cuda = args.device == "cuda"
    if "per_iteration" in extra:
        extra["per_iteration"]["iter_s"] = [round(t, 4) for t in every]
    mine = {"first_step_s": first, "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if cuda else None,
            "peak_host_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
            "iter_s": statistics.median(times), "times_s": list(times), **extra}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())  # DTensors: global
        out = {"mode": args.mode, "nproc": world, "model": args.model, "params": n_params,
               "iter_s": max(r["iter_s"] for r in everyone),
               "first_step_s": round(max(r["first_step_s"] for r in everyone), 2),
               "tokens_per_s_per_gpu": args.batch * args.seq / max(r["iter_s"] for r in everyone),
               # what the job gets: the slowest rank's timed window, iteration by iteration
               **window_figures([max(ts) for ts in zip(*(r["times_s"] for r in everyone))],
                                args.batch * args.seq),
               **{key: None if args.device == "cpu" else max(r[key] for r in everyone)
                  for key in ("peak_gpu_gb", "peak_gpu_reserved_gb")},
               "cap_gb": everyone[0].get("cap_gb"),
               "peak_host_gb_per_rank": max(r["peak_host_gb"] for r in everyone),
               "gpu_wait_frac": [r.get("gpu_wait_frac") for r in everyone],
               "k": [r.get("k") for r in everyone], "iter_times_s": [round(t, 4) for t in times]}
        if everyone[0].get("per_iteration"):  # hytrain: each rank's iterations from the first
            out["per_rank_iterations"] = [r["per_iteration"] for r in everyone]
        if "cpu_params" in everyone[0]:  # hytrain: what the node's CPUs update each step, all ranks together
            out.update(blocks=everyone[0]["blocks"], cpu_params=sum(r["cpu_params"] for r in everyone),
                       state_host_gb_per_rank=max(r["state_host_gb"] for r in everyone))
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def node_update_rate(nranks: int, params: int, passes: int) -> dict:
    """The node's CPU update rate with ``nranks`` ranks updating at once (each on its own parameters,
    with its share of the cores; hytrain.host_rate): parameters per second and host bytes per second,
    all ranks together."""
    from hytrain import host_rate

    r = host_rate.processes_rate(nranks, params, passes)
    return {"ranks": nranks, "threads_per_rank": r["threads_per_process"], "gparams_per_s": r["gparams_per_s"],
            "fp32_update_gbps": r["gbps"]}


def floor_of(rec: dict, rate: dict | None) -> dict:
    """The node-level floor of one hytrain configuration: the update traffic of its CPU-resident
    share, all ranks together, over the host bandwidth measured with as many ranks updating at once."""
    if not rate or "cpu_params" not in rec:
        return {}
    fmt = STATE_FORMATS[rec["mode"]]
    gbps = rate["fp32_update_gbps"]  # the fp32 kernel's traffic rate stands for the host's bandwidth
    floor = UPDATE_BYTES[fmt] * rec["cpu_params"] / (gbps * 1e9)
    return {"host_floor_s": round(floor, 6), "host_gbps_at_n": gbps,
            "iter_over_host_floor": round(rec["iter_s"] / floor, 3) if floor > 0 else None}


def failure(proc) -> str:
    """What stopped a worker: the last exception line a rank printed, else the end of its output."""
    text = proc.stderr or proc.stdout
    errors = [ln for ln in text.splitlines() if re.match(r"(\[rank\d+\]: )?[\w.]+(Error|Exception|Interrupt): ", ln)]
    # A rank's own exception before torchrun's ChildFailedError, which only says that one failed.
    ranks = [ln for ln in errors if ln.startswith("[rank")]
    return (ranks or errors)[-1] if errors else text[-600:]


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # not installed, or installed without what it needs
        return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nprocs", default="1", help="comma-separated process (GPU) counts, e.g. 1,2,4")
    ap.add_argument("--model", default="l3b", help="a preset of hytrain.models.presets, or 13b / 20b")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--batch", type=int, default=2, help="sequences per GPU")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations (hytrain)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed iterations (k settles, speculation shadows are allocated)")
    ap.add_argument("--baseline-warmup", type=int, default=None,
                    help="untimed iterations of DeepSpeed and FSDP2 (no planner to settle; default --warmup)")
    ap.add_argument("--baseline-iters", type=int, default=None, help="timed iterations of DeepSpeed and FSDP2 "
                    "(default --iters)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds each torchrun (one mode at one N) may take")
    ap.add_argument("--cap", default="deepspeed",
                    help="hytrain's GPU memory limit: 'deepspeed' (DeepSpeed's reserved peak at the same N, "
                         "when it ran), 'none', or GB")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the harness on CPU ranks (gloo, no DeepSpeed), to check it, not to time it")
    ap.add_argument("--floor-params", type=int, default=100_000_000,
                    help="parameters each rank updates to measure the node's host bandwidth (0: no floor)")
    ap.add_argument("--floor-passes", type=int, default=20, help="timed update passes of that measurement")
    # A worker's own flags (set by this script for the processes it starts; the parent's are --cap and --modes).
    ap.add_argument("--meta-init", action="store_true",
                    help="hytrain modes: build the model on the meta device, shard it, then allocate and initialise "
                         "each rank's shards on its GPU (models whose bf16 weights do not fit one GPU: 32b, 50b)")
    ap.add_argument("--workers", type=int, default=None,
                    help="hytrain's update workers per rank (default: its own, hytrain.distributed.default_workers)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cap-gb", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    given = [flag for flag, value in (("--cap-gb", args.cap_gb), ("--mode", args.mode))
             if value is not None]
    if given:  # the parent would not act on them: refused, not swallowed
        ap.error(f"{', '.join(given)}: a worker's own flag(s), not this command's; "
                 "hytrain's GPU memory limit is --cap GB (per rank), the modes are --modes")
    try:
        cap_value = None if args.cap in ("deepspeed", "none") else float(args.cap)
    except ValueError:
        ap.error(f"--cap {args.cap!r}: 'deepspeed', 'none' or a number of GB")
    if cap_value is not None and not cap_value > 0:
        ap.error(f"--cap {args.cap!r}: a number of GB must be positive")
    from hytrain.models.presets import PRESETS

    if args.model not in {**PRESETS, **SHAPES}:
        ap.error(f"--model {args.model!r}: one of {', '.join({**PRESETS, **SHAPES})}")
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        ap.error(f"--modes: {', '.join(sorted(unknown))} unknown; the modes are {', '.join(MODES)}")
    results = {}
    nprocs = [int(v) for v in args.nprocs.split(",")]
    rates = {}
    if args.floor_params > 0:
        for n in sorted({1, *nprocs}):  # one rank alone, and as many as each configuration has
            rates[n] = node_update_rate(n, args.floor_params, args.floor_passes)
            print(json.dumps({"host_update_rate": rates[n]}), flush=True)
    modes = [m for m in MODES if m in args.modes.split(",")]
    if "deepspeed_offload" in modes and (args.device == "cpu" or not deepspeed_available()):
        why = "DeepSpeed is not importable" if args.device == "cuda" else "DeepSpeed's offload needs GPUs"
        print(json.dumps({"mode": "deepspeed_offload", "skipped": why}), flush=True)
        modes.remove("deepspeed_offload")
    for n in nprocs:
        for mode in modes:
            baseline = mode not in STATE_FORMATS
            warmup = args.baseline_warmup if baseline and args.baseline_warmup is not None else args.warmup
            iters = args.baseline_iters if baseline and args.baseline_iters is not None else args.iters
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", __file__, "--worker",
                   "--mode", mode, "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
                   "--iters", str(iters), "--warmup", str(warmup), "--device", args.device]
            if args.meta_init:
                cmd.append("--meta-init")
            if args.workers is not None:
                cmd += ["--workers", str(args.workers)]
            if mode in STATE_FORMATS and args.cap != "none":
                ds = results.get(("deepspeed_offload", n), {}).get("peak_gpu_reserved_gb")
                cap = ds if args.cap == "deepspeed" else cap_value
                if cap:
                    cmd += ["--cap-gb", str(cap)]
            # Each rank's share of the cores for the CPU optimizers of the baselines (DeepSpeedCPUAdam and
            # torch's AdamW run on OpenMP/intra-op threads): torchrun would give each rank one thread
            # (OMP_NUM_THREADS=1) where it starts several. hytrain sizes its own workers the same way.
            threads = max(1, len(os.sched_getaffinity(0)) // n)
            env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(threads)))
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                rec = json.loads(lines[-1][7:]) if lines else {"mode": mode, "nproc": n, "error": failure(proc)}
            except subprocess.TimeoutExpired:
                rec = {"mode": mode, "nproc": n, "error": f"timed out after {args.timeout} s"}
            if "iter_s" in rec:
                rec.update(floor_of(rec, rates.get(n)))
                if rec.get("cap_gb") and rec.get("peak_gpu_reserved_gb"):  # the cap holds reserved bytes
                    rec["reserved_within_cap"] = rec["peak_gpu_reserved_gb"] <= rec["cap_gb"] * 1.001
            results[(mode, n)] = rec
            print(json.dumps(rec), flush=True)
    summary = {"summary": True, "model": args.model}
    for (mode, n), rec in results.items():
        if mode not in STATE_FORMATS or "iter_s" not in rec:
            continue
        for other_mode in ("deepspeed_offload", *OFFLOAD_MODES):
            other = results.get((other_mode, n), {}).get("iter_s")
            if other:
                summary[f"n{n}_{mode}_speedup_vs_{other_mode}"] = round(other / rec["iter_s"], 3)
        base = results.get((mode, 1), {}).get("tokens_per_s_per_gpu")
        if base and n > 1:  # per-GPU tokens/s at N over N = 1, the same per-GPU batch
            summary[f"n{n}_{mode}_scaling_efficiency"] = round(rec["tokens_per_s_per_gpu"] / base, 3)
        if rec.get("iter_over_host_floor") is not None:
            summary[f"n{n}_{mode}_iter_over_host_floor"] = rec["iter_over_host_floor"]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
