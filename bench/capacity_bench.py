"""Capacity: the largest Llama model one node trains, per system.

For each system, Llama shapes of growing size are trained in turn, each in its own process, until one
does not train (the larger ones are then not tried, unless --keep-going). "Trains" means: the model
is built, the optimizer constructed, and 1 + --warmup + --iters training iterations complete within
--timeout seconds. Everything else is a failure with a one-line reason: CUDA out of memory, host
memory (MemoryError, hytrain's CapacityError), a kill by a signal (exit -9: usually the host ran out of
memory and the kernel's OOM killer stepped in), a timeout, or any other exception.

Workload (as bench/train_bench.py, whose constants and DeepSpeed configuration are
imported): transformers' LlamaForCausalLM when importable (else hytrain.models.LlamaModel of the same
shapes), untied embeddings, vocab 32000 (unless said), micro-batch 4 x 1024 synthetic tokens, activation
checkpointing on, AdamW (lr 1e-4, weight decay 0.01), global-norm clipping at 1.0, bf16 training
weights on the GPU.
  tiny  hidden   64,  2 layers,  4 heads, intermediate   128, vocab 512 (smoke test only)
  3b    hidden 3200, 26 layers, 32 heads, intermediate  8640
  7b    hidden 4096, 32 layers, 32 heads, intermediate 11008
  13b   hidden 5120, 40 layers, 40 heads, intermediate 13824
  16b   hidden 5120, 50 layers, 40 heads, intermediate 13824 (16.2 B)
  20b   hidden 6144, 44 layers, 48 heads, intermediate 16384
  24b   hidden 6144, 52 layers, 48 heads, intermediate 16384
  28b   hidden 6656, 52 layers, 52 heads, intermediate 17920
  30b   hidden 6656, 60 layers, 52 heads, intermediate 17920 (32.5 B)
  32b   hidden 5120, 64 layers, 40 heads (8 KV heads), intermediate 27648, vocab 152064: Qwen2.5-32B's
        shape as a Llama (no biases; 32.8 B)
  34b   hidden 5120, 64 layers, 40 heads, intermediate 27648
  50b   hidden 8192, 62 layers, 64 heads, intermediate 22016 (50.7 B)

Systems:
  hytrain            hytrain.HybridAdamW(max_grad_norm=1.0, model=model, gpu_blocks="auto"); the bf16 model
                     is built directly on the GPU; fp32 masters and Adam states in pinned host memory
                     except the k blocks the scheduler keeps on the GPU
  hytrain_bf16       the same with compact states (state_format="bf16": bf16 m and v beside fp32 masters)
  hytrain_8bit       the same with 8-bit states (state_format="8bit": blockwise-quantised m and v)
  hytrain_stream, hytrain_stream_bf16, hytrain_stream_8bit
                     the same three with streamed weights: the model is built on the meta device,
                     materialised in bf16 on the CPU and initialised there (as fsdp2_offload), then
                     hytrain.stream_model(model, "cuda", stream=--stream) keeps the last layers' weights in
                     pinned host memory and streams them through a window of 2 layers; "auto": none
                     where the weights leave half the GPU free, else every layer until the second
                     iteration has been measured, then the first layers that fit beside its peak stay
  deepspeed_offload  DeepSpeed ZeRO-2, offload_optimizer cpu (DeepSpeedCPUAdam), configured as in
                     train_bench.py; only when `import deepspeed` works (else a record says skipped)
  deepspeed_zero3_offload
                     DeepSpeed ZeRO-3 with offload_param and offload_optimizer cpu (pinned), otherwise
                     train_bench.py's configuration (bf16, clipping, AdamW -> DeepSpeedCPUAdam with fp32
                     masters and moments); the model is built under deepspeed.zero.Init, each module's
                     bf16 parameters partitioned to host memory as it is constructed, so the whole model
                     never sits on the GPU; its weights are the layers' constructor draws (nn.Linear's and
                     nn.Embedding's own initialisation: a loss on another scale than the other systems',
                     the same work); DeepSpeed's module hooks gather each layer's parameters onto the
                     GPU before it runs and release them after. Skipped where deepspeed_offload is
  fsdp2_offload      torch FSDP2 at world size 1: fully_shard on each decoder layer, then the root, with
                     CPUOffloadPolicy(pin_memory=True) and MixedPrecisionPolicy(bf16 params, fp32
                     reduce); fp32 sharded parameters, gradients and AdamW states on the CPU; torch's
                     fused CPU AdamW and clip_grad_norm_ over the sharded parameters; process group
                     cpu:gloo,cuda:nccl (the norm's reduction runs on CPU tensors). The model is built
                     on the meta device, sharded, then materialised on the CPU (to_empty) and
                     initialised there cheaply (a tiled N(0, 0.02) pattern for matrices, ones for norms);
                     the buffers (rotary tables) stay on the GPU, as FSDP2 puts them.

--micro-batch M splits each step's --batch sequences into forwards and backwards of M (gradient
accumulation: the same tokens a step, the mean loss), for batches whose activations or logits do not
fit at once (not for the DeepSpeed systems, which are then skipped).

Per run, one JSON line: trains, micro_batch, params, build_s (model construction, and for FSDP2 sharding and
materialisation), first_step_s (from the start of the optimizer's construction to the end of the first
iteration), iter_s (median of --iters timed iterations after --warmup untimed ones), tokens_per_s,
peak_gpu_reserved_gb / peak_gpu_allocated_gb (torch.cuda.max_memory_*: the caching allocator's peak;
NCCL's and DeepSpeed's own allocations outside it are not included, gpu_used_at_end_gb includes them;
under --gpu-gb the ballast, ballast_gb, is taken out of all three),
peak_host_gb (the child's peak resident set, pinned memory included), k and blocks for hytrain, and for
a failure the reason, its kind and the stage it happened in. Iterations end when the compute stream
has drained (as in train_bench.py: not torch.cuda.synchronize(), which would also wait for hytrain's
copy streams, whose work overlaps the next forward in training).

Then a table (one row per system: largest size that trained, its params, iter_s, tokens/s, peak GPU
reserved, peak host) and a final `SUMMARY {json}` line: the machine, per system the largest size that
trained and its parameters, and hytrain's largest parameter count over each other system's (null where
the other trained nothing). A system that trained the largest size tried has no ceiling found
(`ceiling_found: false`): its ratio is then a lower bound for it, an upper bound against it.

--device cpu runs everything on the CPU (smoke test): float32 weights, no mixed precision, hytrain with
CPU parameters (k stays 0), FSDP2 over gloo without pinning, DeepSpeed skipped; GPU fields are null.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_bench  # noqa: E402  -- the workload's constants (vocab, AdamW, clipping)
from timed_window import window_figures  # noqa: E402

VOCAB, LR, WD, CLIP = train_bench.VOCAB, train_bench.LR, train_bench.WD, train_bench.CLIP
BATCH, SEQ = 4, 1024

SIZES = {  # in increasing order
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vocab=512),
    "3b": dict(hidden_size=3200, num_layers=26, num_heads=32, intermediate_size=8640, vocab=VOCAB),
    "7b": dict(hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11008, vocab=VOCAB),
    "13b": dict(hidden_size=5120, num_layers=40, num_heads=40, intermediate_size=13824, vocab=VOCAB),
    "16b": dict(hidden_size=5120, num_layers=50, num_heads=40, intermediate_size=13824, vocab=VOCAB),
    "18b": dict(hidden_size=5120, num_layers=56, num_heads=40, intermediate_size=13824, vocab=VOCAB),
    "20b": dict(hidden_size=6144, num_layers=44, num_heads=48, intermediate_size=16384, vocab=VOCAB),
    "24b": dict(hidden_size=6144, num_layers=52, num_heads=48, intermediate_size=16384, vocab=VOCAB),
    "28b": dict(hidden_size=6656, num_layers=52, num_heads=52, intermediate_size=17920, vocab=VOCAB),
    "30b": dict(hidden_size=6656, num_layers=60, num_heads=52, intermediate_size=17920, vocab=VOCAB),
    # Qwen2.5-32B's shape as a Llama (grouped-query attention, 8 KV heads; its vocabulary; no biases)
    "32b": dict(hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8, intermediate_size=27648,
                vocab=152064),
    "34b": dict(hidden_size=5120, num_layers=64, num_heads=40, intermediate_size=27648, vocab=VOCAB),
    "50b": dict(hidden_size=8192, num_layers=62, num_heads=64, intermediate_size=22016, vocab=VOCAB),
}
SYSTEMS = ("hytrain", "hytrain_bf16", "hytrain_8bit", "hytrain_stream", "hytrain_stream_bf16", "hytrain_stream_8bit",
           "deepspeed_offload", "deepspeed_zero3_offload", "fsdp2_offload")
DEEPSPEED_SYSTEMS = ("deepspeed_offload", "deepspeed_zero3_offload")
HYTRAIN_FORMATS = {"hytrain": "fp32", "hytrain_bf16": "bf16", "hytrain_8bit": "8bit", "hytrain_stream": "fp32",
                   "hytrain_stream_bf16": "bf16", "hytrain_stream_8bit": "8bit"}
INIT_STD = 0.02
INIT_POOL = 4194301  # a prime: the tiled init pattern does not repeat along rows of any matrix here


def materialize_cpu(model, dtype):
    """Parameters on the meta device -> uninitialised CPU tensors of ``dtype`` (initialised by
    init_params); buffers are where the model built them."""
    import torch

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype),
                                                              requires_grad=p.requires_grad)


def zero3_offload_config(micro_batch):
    """train_bench.py's DeepSpeed configuration at ZeRO-3: parameters and optimizer in pinned host memory."""
    cfg = train_bench.deepspeed_config(micro_batch)
    cfg["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "contiguous_gradients": True, "overlap_comm": True}
    return cfg


def expected_params(size):
    """Parameters of the shape (both models: no biases, untied embeddings)."""
    s = SIZES[size]
    h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab"]
    kv = h // s["num_heads"] * kv_heads(s)  # the width of k and of v
    return 2 * v * h + h + s["num_layers"] * (2 * h + 2 * h * h + 2 * h * kv + 3 * h * i)


def kv_heads(shape):
    """Key/value heads (grouped-query attention where fewer than the query heads)."""
    return shape.get("num_kv_heads", shape["num_heads"])


# ---- one (system, size), in a child process ------------------------------------------------------

def progress(**kw):
    """What the child has done so far: the driver keeps the last one for a run that never reports."""
    print("PROGRESS " + json.dumps(kw), flush=True)


@contextlib.contextmanager
def params_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, initialisation free),
    their buffers where they would be anyway (real values: the rotary tables)."""
    from torch import nn

    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_model(size, dtype, device, use_transformers, meta_params=False, within=None):
    """train_bench.build_model for these shapes, built on `device` directly in `dtype` (train_bench
    builds fp32 on the GPU and casts, a transient 6 bytes a parameter that would decide capacity), or
    with parameters on the meta device, or inside the context manager `within` (deepspeed.zero.Init,
    which places and casts the parameters itself). Returns the model, the loss function and the decoder
    layers."""
    import torch

    s = SIZES[size]
    if use_transformers:
        # Imported before `within` is entered: the import runs torch._dynamo's checks of torch's own
        # functions, which deepspeed.zero.Init has replaced while it is active.
        from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with (within if within is not None else params_on_meta() if meta_params else torch.device(device)):
            if use_transformers:
                cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden_size"],
                                  intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
                                  num_attention_heads=s["num_heads"], num_key_value_heads=kv_heads(s),
                                  max_position_embeddings=SEQ, tie_word_embeddings=False,
                                  attn_implementation="sdpa")
                model = LlamaForCausalLM(cfg)
            else:
                from hytrain.models import LlamaConfig, LlamaModel

                cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden_size"],
                                  intermediate_size=s["intermediate_size"], num_layers=s["num_layers"],
                                  num_heads=s["num_heads"], num_kv_heads=kv_heads(s), max_seq_len=SEQ)
                model = LlamaModel(cfg, checkpointing=True)
    finally:
        torch.set_default_dtype(old)
    if not meta_params and within is None:
        model.to(dtype)  # the buffers too, as train_bench's models have them
    if use_transformers:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
        return model, (lambda x: model(input_ids=x, labels=x).loss), list(model.model.layers)
    return model, (lambda x: model(x, x)), list(model.layers)


def shard_fsdp2(model, layers, device):
    """fully_shard (CPU offload) on each decoder layer, then the root; the sharded parameters are then
    materialised on the CPU and initialised, the buffers kept where fully_shard put them."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = device == "cuda"
    mesh = init_device_mesh(device, (1,))
    kw = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=cuda),
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda
              else MixedPrecisionPolicy())
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    # fully_shard moved the (real) buffers to the mesh's device; to_empty would replace them with
    # uninitialised CPU tensors: kept, and put back.
    buffers = dict(model.named_buffers())
    model.to_empty(device="cpu")
    for name, buf in buffers.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buf
    init_params(model.parameters())


def init_params(params):
    """Norm weights (1-D) to ones, matrices to N(0, 0.02) -- one pool of normals tiled over them with
    a running offset: memory speed, where drawing 13B normals on the CPU would take minutes."""
    import torch

    g = torch.Generator().manual_seed(0)
    pool = torch.randn(INIT_POOL, generator=g).mul_(INIT_STD)
    off = 0
    with torch.no_grad():
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.dim() < 2:
                local.fill_(1.0)
                continue
            flat = local.view(-1)
            pool_t = pool.to(flat.dtype)
            i, n = 0, flat.numel()
            while i < n:
                take = min(INIT_POOL - off, n - i)
                flat[i:i + take].copy_(pool_t[off:off + take])
                i += take
                off = (off + take) % INIT_POOL


def failure_kind(exc):
    import torch

    text = f"{type(exc).__name__} {exc}".lower()
    if isinstance(exc, torch.OutOfMemoryError) or ("cuda" in text and "out of memory" in text):
        return "gpu_oom"
    if isinstance(exc, MemoryError) or "capacity" in text or "poolexhausted" in text or "out of memory" in text:
        return "host_memory"
    return "error"


def one_line(exc):
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()


def run_one(args):
    """Builds, constructs the optimizer, trains; prints one RESULT line, whatever happens."""
    import torch

    system, size, device = args.one, args.sizes, args.device
    cuda = device == "cuda"
    rec = {"system": system, "size": size, "device": device, "trains": False, "params": None,
           "expected_params": expected_params(size)}
    state = {"stage": "setup"}
    dist_up = False
    try:
        use_tf = not args.own_model
        if use_tf:
            try:
                importlib.import_module("transformers")
            except ImportError:
                use_tf = False
        rec["model"] = "transformers" if use_tf else "hytrain"
        if cuda:
            torch.cuda.set_device(0)
            if args.gpu_gb:  # a smaller card: the rest of this one taken by a ballast, before anything is built
                free, _ = torch.cuda.mem_get_info(0)
                ballast = int(free - args.gpu_gb * 1e9)
                if ballast > 0:
                    state["ballast"] = torch.empty(ballast, dtype=torch.uint8, device="cuda")
                rec["gpu_gb"] = args.gpu_gb
                rec["ballast_gb"] = max(ballast, 0) / 1e9  # left out of the peaks below
        if system == "fsdp2_offload":
            import torch.distributed as dist

            # With CPU offload the sharded gradients live on the CPU: the collectives clipping makes on
            # them (the norm's reduction) need a CPU backend beside NCCL, as torchtitan does it.
            dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                                    **({"device_id": torch.device("cuda", 0)} if cuda else {}))
            dist_up = True

        state["stage"] = "build"
        progress(stage="build")
        t0 = time.perf_counter()
        if system == "fsdp2_offload":
            model, loss_fn, layers = build_model(size, torch.float32, device, use_tf, meta_params=True)
            shard_fsdp2(model, layers, device)
        elif system.startswith("hytrain_stream"):
            import hytrain

            model, loss_fn, layers = build_model(size, torch.bfloat16, device, use_tf, meta_params=True)
            materialize_cpu(model, torch.bfloat16)
            init_params(list(model.parameters()))
            stream = {"auto": "auto", "all": len(layers)}.get(args.stream) or int(args.stream)
            ends = {"auto": "auto", "on": True, "off": False}[args.ends]
            window = hytrain.stream_model(model, device, stream=stream, ends=ends,
                                          state_format=HYTRAIN_FORMATS[system])  # (as the job does)
            rec["streamed_layers"] = len(window.streamed)
            rec["streamed_ends"] = window.ends
            rec["window_host_gb"] = window.host_bytes() / 1e9
        elif system == "deepspeed_zero3_offload":
            import deepspeed

            init = deepspeed.zero.Init(config_dict_or_path=zero3_offload_config(args.batch), remote_device="cpu",
                                       pin_memory=cuda, dtype=torch.bfloat16)
            model, _, _ = build_model(size, torch.bfloat16, device, use_tf, within=init)
        else:
            model, loss_fn, _ = build_model(size, torch.bfloat16 if cuda else torch.float32, device, use_tf)
        if cuda:
            torch.cuda.synchronize()
        rec["build_s"] = round(time.perf_counter() - t0, 3)
        # A ZeRO-3 parameter holds an empty tensor between uses; ds_numel is its size.
        rec["params"] = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())

        state["stage"] = "optimizer"
        progress(stage="optimizer", build_s=rec["build_s"], params=rec["params"])
        if args.inject_failure == "memory":
            raise MemoryError("injected by --inject-failure memory (a test of the failure path)")
        if args.inject_failure == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        opt = engine = None
        t1 = time.perf_counter()
        if system.startswith("hytrain"):
            import hytrain

            opt = hytrain.HybridAdamW(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=CLIP,
                                      model=model, gpu_blocks="auto", state_format=HYTRAIN_FORMATS[system],
                                      accumulation_steps=args.batch // (args.micro_batch or args.batch))
        elif system == "deepspeed_offload":
            import deepspeed

            # train_bench.py's configuration, with this benchmark's micro-batch
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=train_bench.deepspeed_config(args.batch))
        elif system == "deepspeed_zero3_offload":
            import deepspeed

            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=zero3_offload_config(args.batch))
            # Through the engine, as DeepSpeed's documentation has it: its forward resets the ZeRO
            # optimizer's per-backward state and hooks the backward's prologue onto the loss.
            loss_fn = (lambda x: engine(input_ids=x, labels=x).loss) if use_tf else (lambda x: engine(x, x))
        elif system == "fsdp2_offload":
            params = list(model.parameters())
            opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)  # torch's fused CPU AdamW
        else:
            raise ValueError(f"unknown system {system!r}")

        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randint(0, SIZES[size]["vocab"], (args.batch, args.seq), device=device, generator=g)

        micro = args.micro_batch or args.batch  # (validated: divides --batch; DeepSpeed takes whole batches)
        chunks = x.split(micro)

        def iteration():
            if engine is not None:
                loss = loss_fn(x)
                engine.backward(loss)
                engine.step()
                return loss.detach()
            total = 0.0
            for part in chunks:  # gradient accumulation: the step's mean loss over its micro-batches
                loss = loss_fn(part) / len(chunks)
                loss.backward()
                total = total + loss.detach()
            loss = total
            if system == "fsdp2_offload":
                torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        sync = torch.cuda.current_stream().synchronize if cuda else (lambda: None)
        state["stage"] = "first_step"
        losses = [iteration()]
        sync()
        rec["first_step_s"] = round(time.perf_counter() - t1, 3)

        state["stage"] = "iterations"
        progress(stage="iterations", build_s=rec["build_s"], params=rec["params"], first_step_s=rec["first_step_s"])
        times, ks = [], []
        for _ in range(args.warmup + args.iters):
            t = time.perf_counter()
            losses.append(iteration())
            sync()
            times.append(time.perf_counter() - t)
            if system.startswith("hytrain"):
                ks.append(opt.gpu_blocks)
        iter_s = statistics.median(times[args.warmup:])
        losses = [float(v) for v in losses]
        rec.update(micro_batch=micro, trains=True, iter_s=iter_s, tokens_per_s=args.batch * args.seq / iter_s,
                   tokens=args.batch * args.seq, **window_figures(times[args.warmup:], args.batch * args.seq),
                   iter_times_s=[round(t, 4) for t in times], loss_first=losses[0], loss_last=losses[-1],
                   finite_loss=all(v == v and abs(v) != float("inf") for v in losses))
        if system.startswith("hytrain"):
            stats = opt.schedule_stats()
            rec["k"] = stats.get("k", opt.gpu_blocks)
            rec["first_k"] = stats.get("first_k")  # (made at once, made in the first step)
            rec["k_per_iteration"] = ks
            rec["gpu_wait_frac"] = stats.get("gpu_wait_frac")
            if system.startswith("hytrain_stream"):
                rec["window_stats"] = dict(window.stats)
                rec["streamed_layers_end"] = len(window.streamed)  # (made resident where the host was short)
            try:
                rec["blocks"] = len(opt.blocks)
            except Exception:  # noqa: BLE001 -- informational
                rec["blocks"] = None
    except Exception as exc:  # noqa: BLE001 -- MemoryError, torch.OutOfMemoryError and the rest: reported
        traceback.print_exc()
        rec.update(trains=False, reason=one_line(exc), failure=failure_kind(exc), stage=state["stage"])
    ballast_gb = rec.get("ballast_gb", 0.0)
    rec.update(peak_gpu_reserved_gb=torch.cuda.max_memory_reserved() / 1e9 - ballast_gb if cuda else None,
               peak_gpu_allocated_gb=torch.cuda.max_memory_allocated() / 1e9 - ballast_gb if cuda else None,
               peak_host_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    if cuda:
        with contextlib.suppress(Exception):
            free, total = torch.cuda.mem_get_info()
            rec["gpu_used_at_end_gb"] = (total - free) / 1e9 - ballast_gb
    print("RESULT " + json.dumps(rec), flush=True)
    if dist_up and rec["trains"]:
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            dist.destroy_process_group()
    # No teardown beyond this (optimizer destructors waiting for work in flight, a communicator after an
    # OOM, gloo's exit): the record is out, and a teardown that hangs would only turn into a timeout.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if rec["trains"] else 1)


def machine_info():
    """In a child, so that the driver never creates a CUDA context (which would hold GPU memory
    during the runs)."""
    import torch

    info = {"cuda": torch.cuda.is_available(), "gpu": None, "gpu_total_gb": None, "torch": torch.__version__}
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_total_gb=round(props.total_memory / 1e9, 2))
    for mod in ("transformers", "deepspeed"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 -- not importable, for whatever reason
            info[mod] = None
            info[f"{mod}_error"] = one_line(exc)
    print("MACHINE " + json.dumps(info), flush=True)


# ---- the driver -----------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def signal_reason(code):
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    reason = f"killed by {name} (exit {code})"
    if -code == signal.SIGKILL:
        reason += ": usually the host ran out of memory (the kernel's OOM killer)"
    return reason


def last_exception_line(text):
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head and " " not in head and (head.endswith(("Error", "Exception", "Interrupt", "Exit"))):
            return ln
    return lines[-1] if lines else ""


def run_bounded(cmd, timeout, env=None):
    """(stdout, stderr, timed out, wall seconds, exit status) of a child run in a session of its own: a timeout
    ends it and anything it started (compilers, workers), by group."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return out, err, timed_out, round(time.perf_counter() - t0, 1), proc.returncode


def child_records(out):
    """A child's RESULT record (None if it printed none) and its last PROGRESS one."""
    rec, last = None, {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[len("RESULT "):])
        elif line.startswith("PROGRESS "):
            last = json.loads(line[len("PROGRESS "):])
    return rec, last


def child(system, size, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", system, "--sizes", size, "--device", args.device,
           "--warmup", str(args.warmup), "--iters", str(args.iters), "--batch", str(args.batch), "--seq",
           str(args.seq), "--stream", args.stream, "--ends", args.ends, "--micro-batch",
           str(args.micro_batch or args.batch)]
    if args.gpu_gb:
        cmd += ["--gpu-gb", str(args.gpu_gb)]
    if args.own_model:
        cmd.append("--own-model")
    if args.inject_failure:
        cmd += ["--inject-failure", args.inject_failure]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    out, err, timed_out, wall, code = run_bounded(cmd, args.timeout, env)
    rec, last = child_records(out)
    if rec is None:
        rec = {"system": system, "size": size, "device": args.device, "trains": False, "params": None,
               "expected_params": expected_params(size), **{k: v for k, v in last.items() if k != "stage"},
               "stage": last.get("stage")}
        if timed_out:
            rec.update(reason=f"timed out after {args.timeout} s", failure="timeout")
        elif code < 0:
            rec.update(reason=signal_reason(code), failure="killed")
        else:
            rec.update(reason=f"exit {code}: {last_exception_line(err or out)}", failure="error")
    rec["wall_s"] = wall
    print(json.dumps(rec), flush=True)
    return rec


def summarize(results, systems, sizes, machine, device):
    per = {}
    for system in systems:
        recs = [r for r in results if r["system"] == system]
        skipped = next((r["skipped"] for r in recs if r.get("size") is None and r.get("skipped")), None)
        trained = [r for r in recs if r.get("trains")]
        best = max(trained, key=lambda r: sizes.index(r["size"])) if trained else None
        fail = next((r for r in recs if r.get("trains") is False), None)
        per[system] = {
            "largest": best["size"] if best else None, "params": best["params"] if best else None,
            "iter_s": best["iter_s"] if best else None, "tokens_per_s": best["tokens_per_s"] if best else None,
            "peak_gpu_reserved_gb": best.get("peak_gpu_reserved_gb") if best else None,
            "peak_host_gb": best.get("peak_host_gb") if best else None,
            "first_failure": {"size": fail["size"], "reason": fail.get("reason"), "failure": fail.get("failure")}
            if fail else None,
            "ceiling_found": fail is not None, "skipped": skipped}
    out = {"machine": machine, "device": device, "sizes": sizes,
           "largest": {s: p["largest"] for s, p in per.items()},
           "largest_params": {s: p["params"] for s, p in per.items()}}
    for mine in HYTRAIN_FORMATS:  # each hytrain format's largest over every other system's
        if mine not in per:
            continue
        hy = per[mine]["params"]
        out[f"{mine}_params_vs"] = {s: round((hy or 0) / per[s]["params"], 3) if per[s]["params"] else None
                                    for s in systems if not s.startswith("hytrain")}
    out["systems"] = per
    return out


def table(summary):
    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    rows = [("system", "largest", "params", "iter_s", "tokens/s", "gpu_resv_GB", "host_GB", "first failure")]
    for system, p in summary["systems"].items():
        fail = p["first_failure"]
        note = p["skipped"] or (f"{fail['size']}: {fail['reason']}" if fail else "none (no ceiling found)")
        params = "-" if not p["params"] else (f"{p['params'] / 1e9:.2f}B" if p["params"] >= 1e8
                                               else f"{p['params'] / 1e6:.3g}M")
        rows.append((system, p["largest"] or "-", params, num(p["iter_s"], ".3f"), num(p["tokens_per_s"], ".0f"),
                     num(p["peak_gpu_reserved_gb"], ".1f"), num(p["peak_host_gb"], ".1f"), note[:100]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3b,7b,13b,20b,30b", help=f"comma-separated, of {','.join(SIZES)}")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations after the first")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations (iter_s is their median)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per (system, size) run")
    ap.add_argument("--keep-going", action="store_true", help="try larger sizes after a system failed at one")
    ap.add_argument("--own-model", action="store_true", help="hytrain's Llama model even when transformers exists")
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per step")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="sequences per forward and backward (gradient accumulation over --batch / this; "
                         "default: --batch, one micro-batch; not for the DeepSpeed systems)")
    ap.add_argument("--stream", default="auto", help="hytrain_stream*: layers streamed: auto, all or a number")
    ap.add_argument("--ends", choices=("auto", "on", "off"), default="auto",
                    help="hytrain_stream*: whether the embeddings and the head stream too (stream_model's ends=)")
    ap.add_argument("--gpu-gb", type=float, default=None,
                    help="hold each run to this much GPU memory, as a smaller card: the rest of the GPU's free "
                         "memory is taken by a ballast before the model is built (what the window plans from)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--machine-info", action="store_true", help=argparse.SUPPRESS)
    # Makes every child fail right after building its model ('memory': a MemoryError; 'kill': SIGKILL
    # itself), to test how failures are reported.
    ap.add_argument("--inject-failure", choices=("memory", "kill"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.machine_info:
        machine_info()
        return 0
    if args.warmup < 0 or args.iters < 1:
        ap.error("--warmup must be >= 0 and --iters >= 1")
    if args.micro_batch is not None and not (0 < args.micro_batch <= args.batch and args.batch % args.micro_batch == 0):
        ap.error(f"--micro-batch must divide --batch ({args.batch}), got {args.micro_batch}")
    if args.one is not None:
        if args.device is None:
            ap.error("--one needs --device")
        return run_one(args)

    sizes = [s for s in args.sizes.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            ap.error(f"unknown size {s!r} (known: {', '.join(SIZES)})")
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r} (known: {', '.join(SYSTEMS)})")
    sizes = sorted(set(sizes), key=list(SIZES).index)

    info = subprocess.run([sys.executable, os.path.abspath(__file__), "--machine-info"], capture_output=True,
                          text=True, timeout=300)
    machine = next((json.loads(ln[len("MACHINE "):]) for ln in info.stdout.splitlines()
                    if ln.startswith("MACHINE ")), None)
    if machine is None:
        raise SystemExit(f"the machine-info child failed: {info.stderr.strip()[-2000:]}")
    if args.device is None:
        args.device = "cuda" if machine["cuda"] else "cpu"
    if args.device == "cuda" and not machine["cuda"]:
        raise SystemExit("--device cuda, but torch sees no CUDA GPU")
    machine.update(host_memory_gb=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 2),
                   cpu_count=os.cpu_count(),
                   usable_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
    print(json.dumps({"machine": machine, "device": args.device, "sizes": sizes, "systems": systems}), flush=True)

    results = []
    for system in systems:
        skip = None
        if system in DEEPSPEED_SYSTEMS:
            if args.device != "cuda":
                skip = "needs CUDA"
            elif machine.get("deepspeed") is None:
                skip = "not importable"
            elif (args.micro_batch or args.batch) < args.batch:
                skip = "--micro-batch: accumulation is not wired into DeepSpeed's configuration here"
        if skip:
            rec = {"system": system, "size": None, "trains": None, "skipped": skip}
            if skip == "not importable":
                rec["detail"] = machine.get("deepspeed_error")
            print(json.dumps(rec), flush=True)
            results.append(rec)
            continue
        failed_at = None
        for size in sizes:
            if failed_at is not None and not args.keep_going:
                rec = {"system": system, "size": size, "trains": None, "params": None,
                       "expected_params": expected_params(size), "skipped": f"not tried: failed at {failed_at}"}
                print(json.dumps(rec), flush=True)
            else:
                rec = child(system, size, args)
                if not rec["trains"] and failed_at is None:
                    failed_at = size
            results.append(rec)

    summary = summarize(results, systems, sizes, machine, args.device)
    print(table(summary), flush=True)
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
