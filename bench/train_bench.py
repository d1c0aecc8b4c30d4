"""End-to-end training iterations on one GPU: hytrain against plain PyTorch, a naive offload and
DeepSpeed ZeRO-Offload, side by side in one run.

Workloads (../shared/ANCHORS.md): Llama shapes (transformers' LlamaForCausalLM when installed, else
hytrain's own model of the same shapes), untied embeddings, vocab 32000, micro-batch 2 x 2048 synthetic
tokens, bf16, AdamW (lr 1e-4, weight decay 0.01), global-norm clipping at 1.0.
  L3B  hidden 3072, 26 layers, 24 heads, intermediate 8192, no activation checkpointing
  L7B  hidden 4096, 32 layers, 32 heads, intermediate 11008, activation checkpointing

Modes (each in its own process, so memory and pinned pages start clean):
  torch_gpu           fp32 weights + fused torch AdamW on the GPU, bf16 autocast (the reference)
  naive_offload       bf16 on the GPU; after backward, gradients to the CPU, torch's fused CPU AdamW,
                      weights back; nothing overlapped
  hytrain_k0          HybridAdamW, every block updated by the CPU workers
  hytrain_no_overlap  as hytrain_k0, with every update finished inside step() (what overlap buys)
  hytrain_nospec      k auto, without speculative updates during backward (what speculation buys)
  hytrain_auto        HybridAdamW with the defaults: gpu_blocks="auto" (the k-split scheduler) and
                      speculate="auto" (CPU updates during backward, redone when clipping fires)
  hytrain_nofence     as hytrain_auto with fence=False: only the forward hooks wait for the updates
                      that outlive step() (what the fence for every other path costs)
  hytrain_nowatch     as hytrain_auto with watch_writes=False: no fingerprints of the weights (what
                      seeing writes through .data, raw pointers and other threads costs)
  deepspeed_offload   DeepSpeed ZeRO-2 with offload_optimizer cpu (DeepSpeedCPUAdam), when importable
  <hytrain mode>_bf16 that mode with compact states (state_format="bf16": bf16 m and v), e.g.
                      hytrain_auto_bf16, hytrain_k0_bf16
  <hytrain mode>_8bit that mode with 8-bit states (state_format="8bit": blockwise-quantised m and v)

--cap-gb limits hytrain's GPU memory (torch.cuda.set_per_process_memory_fraction, and the scheduler's
budget): a run pretending to be a smaller GPU, honestly. ``--cap-gb deepspeed`` uses the peak that
DeepSpeed's run reserved on this GPU in the same invocation.

Each mode prints one JSON line: iter_s (median of timed iterations), tokens_per_s, tflops (6 N per
token, model FLOPs without attention or recomputation), peak_gpu_gb (allocated), peak_host_gb (the
process's peak resident set, pinned memory included), gpu_idle_frac (from a profiled iteration: the
share of the iteration in which the busiest stream, the compute stream, ran no kernel), k, and for
hytrain the scheduler's predicted_iter_s. A final line gives the ratios the targets are stated in.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timed_window import counter_deltas, counters, thread_cpu, thread_cpu_figures, window_figures  # noqa: E402

WORKLOADS = {
    "l3b": dict(hidden_size=3072, num_layers=26, num_heads=24, intermediate_size=8192, checkpointing=False),
    "l7b": dict(hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11008, checkpointing=True),
}
VOCAB, BATCH, SEQ, LR, WD, CLIP = 32000, 2, 2048, 1e-4, 0.01, 1.0
HYTRAIN_MODES = ("hytrain_k0", "hytrain_no_overlap", "hytrain_nospec", "hytrain_auto", "hytrain_nofence",
                 "hytrain_nowatch")
FORMATS = {"_bf16": "bf16", "_8bit": "8bit"}  # a hytrain mode with this suffix runs with that state_format
FP16 = "_fp16"  # a hytrain mode ending with this trains fp16 weights under a GradScaler (after any format suffix)


def work_per_iteration(work, spans):
    """Per iteration, {kind: seconds} of the shadows' pool work ((kind, start, end, bytes), the
    planner's ``shadow_pool_work``) that overlapped it: page-locking ("ahead", "lock") or giving
    memory back ("trim"), set beside the iteration's time and its step() call."""
    out = []
    for a, b in spans:
        row = {}
        for kind, start, end, _ in work:
            overlap = min(b, end) - max(a, start)
            if overlap > 0:
                row[kind] = round(row.get(kind, 0.0) + overlap, 4)
        out.append(row)
    return out

def split_mode(mode):
    """(the hytrain mode without its state-format suffix, the state format)."""
    for suffix, fmt in FORMATS.items():
        if mode.endswith(suffix):
            return mode.removesuffix(suffix), fmt
    return mode, "fp32"
SETTLE, SETTLE_MAX = 3, 10  # iterations a hytrain plan must hold before timing; most extra warmup


# ---- one mode, in a child process -----------------------------------------------------------------

def build_model(workload, dtype, use_transformers):
    import torch

    w = WORKLOADS[workload]
    torch.manual_seed(0)
    if use_transformers:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=w["hidden_size"], intermediate_size=w["intermediate_size"],
                          num_hidden_layers=w["num_layers"], num_attention_heads=w["num_heads"],
                          num_key_value_heads=w["num_heads"], max_position_embeddings=SEQ,
                          tie_word_embeddings=False, attn_implementation="sdpa")
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).to(dtype)
        if w["checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        return model, (lambda x: model(input_ids=x, labels=x).loss)
    from hytrain.models import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=w["hidden_size"], intermediate_size=w["intermediate_size"],
                      num_layers=w["num_layers"], num_heads=w["num_heads"], num_kv_heads=w["num_heads"],
                      max_seq_len=SEQ)
    with torch.device("cuda"):
        model = LlamaModel(cfg, checkpointing=w["checkpointing"]).to(dtype)
    return model, (lambda x: model(x, x))


def deepspeed_config(micro_batch, accum=1):
    """DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU (DeepSpeedCPUAdam), bf16, clipping."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accum,
            "bf16": {"enabled": True}, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "contiguous_gradients": True, "overlap_comm": True},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


class NaiveOffload:
    """fp32 masters in pinned host memory, torch's fused CPU AdamW after backward, no overlap."""

    def __init__(self, model):
        import torch

        self.params = [p for p in model.parameters()]
        self.master = [p.detach().to("cpu", torch.float32).pin_memory() for p in self.params]
        for m in self.master:
            m.grad = torch.empty_like(m)
        self.opt = torch.optim.AdamW(self.master, lr=LR, weight_decay=WD, fused=True)

    def step(self):
        import torch

        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        for m, p in zip(self.master, self.params):
            m.grad.copy_(p.grad)
        self.opt.step()
        for m, p in zip(self.master, self.params):
            p.data.copy_(m, non_blocking=True)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def gpu_idle_frac(run_iteration, iterations=2):
    """Profiles `iterations` iterations; the share of their wall time in which the stream with the
    most kernel time (the compute stream) had no kernel running."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            with record_function("bench_iteration"):
                run_iteration()
                torch.cuda.current_stream().synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("name") == "bench_iteration" and e.get("ph") == "X"]
    kernels = {}
    for e in events:
        if e.get("cat") == "kernel" and e.get("ph") == "X":
            kernels.setdefault(e["args"].get("stream"), []).append((e["ts"], e["ts"] + e["dur"]))
    if not windows or not kernels:
        return None
    spans = max(kernels.values(), key=lambda s: sum(b - a for a, b in s))
    busy = total = 0.0
    for w0, w1 in windows:
        total += w1 - w0
        end = w0
        for a, b in sorted(spans):
            a, b = max(a, end, w0), min(b, w1)
            if b > a:
                busy += b - a
                end = b
    return max(0.0, 1.0 - busy / total) if total > 0 else None


def run_mode(args):
    import torch

    mode, workload = args.mode, args.workload
    fp16 = mode.startswith("hytrain") and mode.endswith(FP16)
    mode = mode.removesuffix(FP16) if fp16 else mode
    use_tf = not args.own_model
    if use_tf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            use_tf = False
    cap = args.cap_gb
    if cap is not None and mode.startswith("hytrain"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 1e9 / total))
    dtype = torch.float32 if mode == "torch_gpu" else torch.float16 if fp16 else torch.bfloat16
    model, loss_fn = build_model(workload, dtype, use_tf)
    n_params = sum(p.numel() for p in model.parameters())
    opt = engine = None
    scaler = torch.amp.GradScaler("cuda") if fp16 else None
    autocast = mode == "torch_gpu"
    if mode == "torch_gpu":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    elif mode == "naive_offload":
        opt = NaiveOffload(model)
    elif mode.startswith("hytrain"):
        import hytrain

        mode, state_format = split_mode(mode)
        opt = hytrain.HybridAdamW(
            model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=None if args.keep_grads else CLIP, model=model,
            gpu_blocks="auto" if mode in ("hytrain_auto", "hytrain_nospec", "hytrain_nofence", "hytrain_nowatch") else 0,
            overlap=mode != "hytrain_no_overlap", speculate=False if mode == "hytrain_nospec" else "auto",
            gpu_memory_limit=int(cap * 1e9) if cap is not None else None, trace=args.trace_keep if args.trace is not None else False,
            **({"host_memory_limit": int(args.host_limit_gb * 1e9)} if args.host_limit_gb else {}),
            **({"fence": False} if mode == "hytrain_nofence" else {}),
            **({"watch_writes": False} if mode == "hytrain_nowatch" else {}), state_format=state_format,
            **({"release_grads": False} if args.keep_grads else {}),
            **({"workers": args.workers} if args.workers else {}), accumulation_steps=args.accum)
    elif mode == "deepspeed_offload":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=deepspeed_config(BATCH, args.accum))
    else:
        raise SystemExit(f"unknown mode {mode}")

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)

    accum = args.accum
    step_calls = []

    def iteration():
        # accum micro-batches of BATCH x SEQ tokens a step, each loss divided by accum (the mean).
        if engine is not None:
            for _ in range(accum):  # DeepSpeed steps its optimizer at the accumulation boundary
                engine.backward(loss_fn(x))
                engine.step()
            return
        for _ in range(accum):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(x) / accum
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            if args.keep_grads:
                opt.clip_grad_norm_(CLIP)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return
        if mode == "torch_gpu":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        elif args.keep_grads and mode.startswith("hytrain"):  # the loop clips, through the optimizer
            opt.clip_grad_norm_(CLIP)
        t_step = time.perf_counter()
        opt.step()
        step_calls.append(time.perf_counter() - t_step)  # host time inside step(), every iteration
        opt.zero_grad()

    # Iterations end when the compute stream has drained. Not torch.cuda.synchronize(): that would
    # also wait for hytrain's copy streams, i.e. for every CPU update, and so forbid the overlap of
    # the updates with the next forward that the iteration is meant to measure (those waits fall in
    # the next iteration's forward, as in training).
    # Untimed: at least --warmup iterations, and for hytrain until k and the speculation start have
    # held for SETTLE iterations (at most SETTLE_MAX more): moving states and page-locking new shadow
    # memory are one-time costs of a decision, not the iteration's. Every time is in iter_times_s.
    stream = torch.cuda.current_stream()
    times, ks, norms, plans, spans = [], [], [], [], []
    torch.cuda.synchronize()
    warmup = args.warmup
    i = 0
    cpu_before = None
    readings = []  # --counters: the kernel's counts at each iteration's start (and the last one's end)
    while i < warmup + args.iters:
        if i == warmup:
            cpu_before = thread_cpu()
        if args.counters:
            readings.append(counters())
        t0 = time.perf_counter()
        iteration()
        stream.synchronize()
        times.append(time.perf_counter() - t0)
        spans.append((t0, t0 + times[-1]))
        if mode.startswith("hytrain"):
            ks.append(opt.gpu_blocks)
            norms.append(opt.last_grad_norm)
            sched_stats = opt.schedule_stats()
            # (k, where speculation starts, shadow allocations so far): what settles, per iteration
            plans.append((opt.gpu_blocks, sched_stats.get("speculative_from"),
                          len(sched_stats.get("shadow_allocations") or ())))
            if i + 1 == warmup and warmup < args.warmup + SETTLE_MAX and len({p[:2] for p in plans[-SETTLE:]}) > 1:
                warmup += 1
        i += 1
    cpu_after = thread_cpu()
    if args.counters:
        readings.append(counters())
    iter_s = statistics.median(times[warmup:])
    tokens = BATCH * SEQ * accum
    rec = {"mode": mode, "workload": workload, "model": "transformers" if use_tf else "hytrain",
           "params": n_params, "iter_s": iter_s, "tokens_per_s": tokens / iter_s,
           "tflops": 6 * n_params * tokens / iter_s / 1e12, "tokens_per_step": tokens, "accum": accum,
           "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9,
           "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
           "cap_gb": cap if mode.startswith("hytrain") else None, "k": None, "predicted_iter_s": None,
           # times the caching allocator hit the memory limit, freed its cache and retried (a device sync each)
           "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
           "warmup": warmup, "iter_times_s": [round(t, 4) for t in times],
           **window_figures(times[warmup:], tokens),
           # the cores each kind of thread kept busy over the timed window (hytrain-update: the CPU AdamW)
           "thread_cpu": thread_cpu_figures(cpu_before or {}, cpu_after, sum(times[warmup:]))}
    if args.counters:  # per iteration, from the first: page faults, the update workers' CPU and preemptions, steal
        rec["iter_counters"] = counter_deltas(readings)
    if scaler is not None:
        rec["loss_scale"] = scaler.get_scale()
    rec["kept_grads"] = bool(args.keep_grads) if mode.startswith("hytrain") else None
    rec["workers"] = args.workers if mode.startswith("hytrain") else None  # None: HybridAdamW's default
    if mode.startswith("hytrain"):
        stats = opt.schedule_stats()
        rec.update(speculative_from=stats.get("speculative_from"), speculation=dict(opt.speculation_counts),
                   first_k=stats.get("first_k"), shadow_allocations=stats.get("shadow_allocations"),
                   speculative_from_per_iteration=[p[1] for p in plans],
                   shadow_allocations_per_iteration=[p[2] for p in plans],
                   step_call_s=[round(t, 4) for t in step_calls[:len(times)]],
                   shadows_ahead=stats.get("shadows_ahead"),
                   shadow_pool_work_per_iteration=work_per_iteration(stats.get("shadow_pool_work") or (), spans))
        rec.update(k=stats["k"], k_per_iteration=ks, grad_norms=[round(v, 4) for v in norms if v is not None], predicted_iter_s=stats.get("predicted_iter_s"),
                   predicted_gpu_idle_s=stats.get("predicted_gpu_idle_s"), gpu_wait_frac=stats.get("gpu_wait_frac"),
                   state_budget_gb=stats.get("state_budget_bytes", 0) / 1e9)
        if rec["predicted_iter_s"]:
            rec["measured_vs_predicted"] = iter_s / rec["predicted_iter_s"]
        costs = opt.scheduler.costs() if opt.scheduler is not None else []
        if costs:
            rec["block_costs_ms"] = {name: round(sum(c[i] for c in costs) * 1e3, 2)
                                     for i, name in enumerate(("fwd", "bwd", "d2h", "cpu", "h2d", "gpu"))}
    rec["gpu_idle_frac"] = gpu_idle_frac(iteration) if not args.no_profile else None
    if args.trace is not None and mode.startswith("hytrain"):
        opt.export_trace(args.trace)
    rec["peak_host_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print("RESULT " + json.dumps(rec), flush=True)


# ---- the driver -----------------------------------------------------------------------------------

def child(mode, workload, args, cap=None, trace=None, label=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", mode, "--workloads", workload,
           "--warmup", str(args.warmup), "--iters", str(args.iters)]
    if cap is not None:
        cmd += ["--cap-gb", str(cap)]
    if trace is not None:
        cmd += ["--trace", trace, "--trace-keep", str(args.trace_keep)]
    if args.own_model:
        cmd.append("--own-model")
    if args.host_limit_gb:
        cmd += ["--host-limit-gb", str(args.host_limit_gb)]
    if args.no_profile:
        cmd.append("--no-profile")
    if args.counters:
        cmd.append("--counters")
    if args.keep_grads:
        cmd.append("--keep-grads")
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    if args.torch_threads:
        cmd += ["--torch-threads", str(args.torch_threads)]
    if args.accum != 1:
        cmd += ["--accum", str(args.accum)]
    env = dict(os.environ)
    if mode == "deepspeed_offload":
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        rec = {"mode": mode, "workload": workload, "error": f"timed out after {args.timeout} s"}
        print(json.dumps(rec), flush=True)
        return rec
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[len("RESULT "):])
            rec["mode"] = label or mode
            rec["wall_s"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(rec), flush=True)
            return rec
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    rec = {"mode": mode, "workload": workload, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    print(json.dumps(rec), flush=True)
    return rec


def deepspeed_available():
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="l3b,l7b")
    ap.add_argument("--modes", default="torch_gpu,naive_offload,deepspeed_offload,hytrain_k0,hytrain_no_overlap,"
                                       "hytrain_nospec,hytrain_auto")
    ap.add_argument("--cap-gb", default=None,
                    help="GPU memory for hytrain modes in GB, or 'deepspeed' (DeepSpeed's reserved peak)")
    ap.add_argument("--l7b-cap-gb", type=float, default=75.0, help="hytrain's GPU memory on L7B (an H100's worth)")
    ap.add_argument("--l7b-modes", default="torch_gpu,hytrain_auto",
                    help="modes run on L7B (DeepSpeed and the naive offload do not fit its host memory/time)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations, at least (hytrain: more until k and the speculation start hold)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=400, help="seconds per mode")
    ap.add_argument("--host-limit-gb", type=float, default=None,
                    help="hytrain's host_memory_limit in GB (bounds its speculation shadows)")
    ap.add_argument("--own-model", action="store_true", help="hytrain's Llama model even when transformers exists")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled iterations (gpu_idle_frac)")
    ap.add_argument("--skip-nocap", action="store_true", help="with --cap-gb, skip the extra uncapped hytrain_auto run")
    ap.add_argument("--trace", default=None,
                    help="Chrome traces of each hytrain mode's last --trace-keep iterations, at "
                         "TRACE.<workload>.<mode>.json")
    ap.add_argument("--trace-keep", type=int, default=3, help="iterations each trace keeps")
    ap.add_argument("--keep-grads", action="store_true",
                    help="hytrain keeps .grad until step() (release_grads=False) and the loop clips "
                         "(opt.clip_grad_norm_), as a loop that reads the gradients")
    ap.add_argument("--workers", type=int, default=None,
                    help="hytrain's CPU update threads (default: HybridAdamW's, the cores less one)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch's intra-op threads in each run (default: torch's, every core), beside "
                         "hytrain's update workers")
    ap.add_argument("--counters", action="store_true",
                    help="record each iteration's page faults, update-worker CPU and preemptions, and the machine's steal")
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches of 2 x 2048 tokens a step (gradient accumulation): 4 -> 16 K tokens a step")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    if args.one is not None:
        args.mode, args.workload = args.one, args.workloads
        args.cap_gb = float(args.cap_gb) if args.cap_gb is not None else None
        run_mode(args)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("train_bench.py needs a CUDA GPU")
    modes = [m for m in args.modes.split(",") if m]
    if "deepspeed_offload" in modes and not deepspeed_available():
        print(json.dumps({"mode": "deepspeed_offload", "skipped": "DeepSpeed is not importable"}), flush=True)
        modes.remove("deepspeed_offload")
    results = {}
    for workload in [w for w in args.workloads.split(",") if w]:
        ds_cap = None
        order = sorted(modes, key=lambda m: (m != "torch_gpu", m != "deepspeed_offload", m))
        if workload == "l7b":
            order = [m for m in order if m in args.l7b_modes.split(",")]
        for mode in order:
            cap = None
            if mode.startswith("hytrain"):
                if workload == "l7b":
                    cap = args.l7b_cap_gb
                elif args.cap_gb == "deepspeed":
                    cap = ds_cap
                elif args.cap_gb is not None:
                    cap = float(args.cap_gb)
            trace = f"{args.trace}.{workload}.{mode}.json" if args.trace and mode.startswith("hytrain") else None
            rec = child(mode, workload, args, cap=cap, trace=trace)
            results[(workload, mode)] = rec
            if mode == "deepspeed_offload" and "peak_gpu_reserved_gb" in rec:
                ds_cap = round(rec["peak_gpu_reserved_gb"], 2)
        if workload != "l7b" and "hytrain_auto" in order and args.cap_gb is not None and not args.skip_nocap:
            rec = child("hytrain_auto", workload, args, label="hytrain_auto_nocap")  # without the cap
            results[(workload, "hytrain_auto_nocap")] = rec

    def t(w, m):  # wall-clock: the timed window's mean iteration (the median where a record lacks it)
        rec = results.get((w, m), {})
        return rec.get("iter_s_mean") or rec.get("iter_s")

    summary = {"summary": True, "device": torch.cuda.get_device_name(),
               "ratios_of": "wall-clock time: the timed window's total over its iterations"}
    for w in {w for w, _ in results}:
        ref = t(w, "torch_gpu")
        for (ww, m), rec in results.items():
            if ww == w and t(w, m) and ref and m != "torch_gpu":
                summary[f"{w}_{m}_vs_torch_gpu"] = round(t(w, m) / ref, 3)
        ds = t(w, "deepspeed_offload")
        for m in (b + suffix for b in ("hytrain_auto", "hytrain_k0") for suffix in ("", *FORMATS)):
            if ds and t(w, m):
                summary[f"{w}_{m}_speedup_vs_deepspeed"] = round(ds / t(w, m), 3)
            base = split_mode(m)[0]
            if base != m and t(w, m) and t(w, base):
                summary[f"{w}_{m}_speedup_vs_fp32_states"] = round(t(w, base) / t(w, m), 3)
        for m in [m for ww, m in results if ww == w and m.endswith(FP16)]:
            if t(w, m) and t(w, m.removesuffix(FP16)):  # fp16 weights + GradScaler against bf16 weights
                summary[f"{w}_{m}_vs_bf16_weights"] = round(t(w, m) / t(w, m.removesuffix(FP16)), 3)
        if t(w, "hytrain_auto") and t(w, "hytrain_nofence"):
            summary[f"{w}_fence_cost"] = round(t(w, "hytrain_auto") / t(w, "hytrain_nofence"), 3)
        if t(w, "hytrain_auto") and t(w, "hytrain_nowatch"):
            summary[f"{w}_watch_cost"] = round(t(w, "hytrain_auto") / t(w, "hytrain_nowatch"), 3)
        if t(w, "hytrain_no_overlap") and t(w, "hytrain_k0"):
            summary[f"{w}_overlap_speedup"] = round(t(w, "hytrain_no_overlap") / t(w, "hytrain_k0"), 3)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
