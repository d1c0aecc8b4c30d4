"""MegaTrain on capacity_bench.py's workload: a baseline for the streamed-weights benchmark, where it is
installed (nothing of it is part of this project).

MegaTrain (arXiv 2604.05091, Apache-2.0; `pip install` puts its `infinity` package on the path) keeps
the model in host memory and runs each decoder layer on the GPU from a double-buffered pair of layer
templates, the weights copied in from pinned host memory as the layers come; after backward the CPU
clips, steps DeepSpeed's CPU Adam and refreshes the pinned copies. This script drives it through its
own entry points, as its examples/sft/train.py does: `CPUMasterConfig`, `CPUMasterModel(hf_model,
config)`, `DeepSpeedCPUAdam(model.get_parameters(), ..., adamw_mode=True)`, then per step
`model.forward_and_backward(input_ids, attention_mask, labels)`,
`torch.nn.utils.clip_grad_norm_(model.get_parameters(), max_grad_norm)`, `optimizer.step()`,
`model._sync_params_to_gpu()`, `model.zero_grad()`, `optimizer.zero_grad()` -- that loop, step for
step, with its `expandable_segments` allocator setting.

Workload, as capacity_bench.py's: transformers' LlamaForCausalLM of a capacity_bench.SIZES shape
(untied embeddings, vocab 32000, no GQA), built with its parameters on the meta device, materialised
in bf16 on the CPU and initialised there as capacity_bench's streamed runs are (no download, no
network); --batch x --seq synthetic tokens, the same tokens every step (capacity_bench's generator
and seed); lr 1e-4, weight decay 0.01, clipping at 1.0 (train_bench.py's constants; MegaTrain's
configs: lr 1e-5 to 2e-5, the same decay and clipping); bf16; an iteration ends when the GPU has
drained (MegaTrain's step is synchronous anyway).

Where it differs from hytrain's runs, by MegaTrain's design or this machine's image:
  - No fp32 master: the bf16 weights in host memory are the ones DeepSpeedCPUAdam updates (its
    moments in fp32, betas 0.9/0.999, eps 1e-8, AdamW mode, as MegaTrain's configs); hytrain keeps
    fp32 masters beside its fp32, bf16 or 8-bit moments and rounds to bf16 once per step.
  - Clipping: torch's clip_grad_norm_ over the bf16 gradients in host memory, on the CPU, before
    the step (the norm in bf16); the optimizer step and the weight refresh follow it, nothing of
    them overlaps the GPU's next forward.
  - Activation checkpointing is MegaTrain's own: a hidden state kept every --checkpoint-interval
    layers (4 in all its configs), the block recomputed before its backward, and each layer run once
    more with gradients: three forwards and one backward a layer (hytrain's runs: two and one), and
    each layer's weights cross to the GPU three times a step. transformers' own checkpointing is left
    off (it would add a fourth forward).
  - Attention: flash-attn is not installed on the GPU image, so the model uses transformers' sdpa
    (MegaTrain's configs ask for flash_attention_2; its README names sdpa as the fallback). Its
    single-GPU path hands the attention_mask it is given to every layer; a 2-D padding mask of
    ones, meant for flash-attn, is refused by sdpa ("Expected attn_mask dtype to be bool or float").
    --mask none (the default) gives it no mask tensor, so sdpa runs causal with is_causal, the
    kernel transformers picks for an unpadded batch in hytrain's runs; --mask 4d gives it the
    additive causal mask MegaTrain's own multi-GPU worker builds for non-flash attention
    (CPUMasterModel._prepare_4d_causal_mask), which keeps sdpa off its flash kernel. The loss is
    MegaTrain's own, cross-entropy in torch (flash-attn's is absent) over 128-token chunks, each
    chunk's sum rounded to bf16: loss_first / loss_last move in steps of a few hundredths.
  - Tokens per step: MegaTrain's single-GPU SFT configs (examples/sft/configs) take 64-158
    sequences of 1024 tokens a step (llama3_8b.yaml and qwen_7b.yaml 148, qwen_7b_1gpu.yaml 158,
    glm4_flash.yaml 128, gpt_oss_20b.yaml 96, qwen3_5_27b.yaml 64; the VLM and 80 B MoE ones 16 x 2-4
    accumulated), i.e. 65-162 K tokens, over which its per-step CPU work (clip, step, refresh) is
    spread; here --batch x --seq (16 x 1024 in bench/device_baselines.sh: hytrain's streamed runs).
  - Host memory: about 14 bytes a parameter: the bf16 weights (the model as built), their pinned
    flat copies (decoder layers), bf16 gradients (allocated afresh every step: the loop's
    optimizer.zero_grad() drops them) and fp32 Adam moments, plus MegaTrain's pinned gradient slabs
    (peak_host_bytes_per_param is the measured figure).
  - Its CUDA extension (cuda_pipeline) is not used on this path (only its own tests import it);
    whether it was built is recorded.

Run in a child process bounded by --timeout; one `RESULT {json}` line: system "megatrain", size,
trains, params, expected_params, build_s (model construction, materialisation and initialisation,
and CPUMasterModel's construction: wrap_s), first_step_s (from the optimizer's construction to the
end of the first iteration), iter_s (median of --iters timed iterations after --warmup untimed ones),
tokens_per_s, timed_window.window_figures (wall_tokens_per_s, iter_s_p90, ...), iter_times_s,
phases_s (medians over the timed iterations: forward_backward, clip, optimizer, sync_params),
loss_first / loss_last, peak_gpu_reserved_gb / peak_gpu_allocated_gb (torch's caching allocator),
gpu_used_at_end_gb, peak_host_gb (the child's peak resident set, pinned memory included), the
attention used, MegaTrain's version and source archive (with the commit its name carries); or
trains false with a one-line reason, its kind (not_installed, no_cuda, gpu_oom, host_memory,
killed, timeout, error) and the stage. --log FILE keeps the child's whole output.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
import resource
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import capacity_bench  # noqa: E402  -- the workload: shapes, model construction, initialisation
from timed_window import window_figures  # noqa: E402

SIZES, LR, WD, CLIP = capacity_bench.SIZES, capacity_bench.LR, capacity_bench.WD, capacity_bench.CLIP
BETAS, EPS = (0.9, 0.999), 1e-8  # MegaTrain's configs (and torch's AdamW defaults)


class NoMask:
    """The attention_mask given to forward_and_backward under --mask none: MegaTrain moves the mask it is
    given to the GPU (`.to(device)`) and passes the result to every layer; None there makes sdpa causal."""

    def to(self, device):
        return None


def megatrain_provenance():
    """Version of the installed distribution, and the archive it was installed from (pip's
    direct_url.json), with the commit its name carries."""
    from importlib.metadata import PackageNotFoundError, distribution

    out = {"megatrain_version": None, "megatrain_source": None, "megatrain_commit": None,
           "megatrain_sha256": None}
    try:
        dist = distribution("megatrain")
    except PackageNotFoundError:
        return out
    out["megatrain_version"] = dist.version
    with contextlib.suppress(Exception):
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        name = os.path.basename(direct.get("url", "")) or None
        out["megatrain_source"] = name
        found = re.search(r"megatrain-([0-9a-f]{7,40})\b", name or "")
        out["megatrain_commit"] = found.group(1) if found else None
        out["megatrain_sha256"] = direct.get("archive_info", {}).get("hashes", {}).get("sha256")
    return out


class Unavailable(Exception):
    """Something the run needs is not there; `kind` names what."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


def import_megatrain():
    try:
        infinity = importlib.import_module("infinity")
    except ImportError as exc:
        if exc.name == "infinity":
            raise Unavailable("not_installed", "megatrain not installed (no module named 'infinity')") from exc
        raise Unavailable("not_installed", f"megatrain not importable: {capacity_bench.one_line(exc)}") from exc
    if not hasattr(infinity, "CPUMasterModel"):
        raise Unavailable("not_installed", f"megatrain not installed (an 'infinity' module without "
                                           f"CPUMasterModel is on the path: {getattr(infinity, '__file__', None)})")
    return infinity


def build_llama(size, seq):
    """LlamaForCausalLM of the shape, sdpa attention, bf16 on the CPU, initialised as capacity_bench's
    streamed runs are; transformers' activation checkpointing off (MegaTrain recomputes by itself)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SIZES[size]
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with capacity_bench.params_on_meta():
            cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden_size"],
                              intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
                              num_attention_heads=s["num_heads"], num_key_value_heads=capacity_bench.kv_heads(s),
                              max_position_embeddings=seq, tie_word_embeddings=False, attn_implementation="sdpa")
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    capacity_bench.materialize_cpu(model, torch.bfloat16)
    capacity_bench.init_params(list(model.parameters()))
    model.config.use_cache = False
    return model


def run_one(args):
    """Builds, wraps, constructs the optimizer, trains; prints one RESULT line, whatever happens."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as MegaTrain's train.py
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(name)s: %(message)s")
    rec = {"system": "megatrain", "size": args.size, "trains": False, "params": None,
           "expected_params": capacity_bench.expected_params(args.size), "batch": args.batch, "seq": args.seq,
           "tokens": args.batch * args.seq, "checkpoint_interval": args.checkpoint_interval,
           "num_grad_slabs": args.grad_slabs, "mask": args.mask,
           "caching_allocator": os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") != "1"}
    state = {"stage": "setup"}
    cuda = False
    try:
        infinity = import_megatrain()
        import torch

        rec.update(megatrain_provenance(), infinity_version=getattr(infinity, "__version__", None),
                   cuda_pipeline=importlib.util.find_spec("cuda_pipeline") is not None, torch=torch.__version__)
        with contextlib.suppress(Exception):
            rec["transformers"] = importlib.import_module("transformers").__version__
        if not torch.cuda.is_available():
            raise Unavailable("no_cuda", "CUDA not available (MegaTrain's CPUMasterModel runs on a GPU)")
        cuda = True
        torch.cuda.set_device(0)
        rec["gpu"] = torch.cuda.get_device_properties(0).name
        opt_class = torch.optim.AdamW
        if args.optimizer == "deepspeed_adam":
            try:
                from deepspeed.ops.adam import DeepSpeedCPUAdam
            except Exception as exc:  # noqa: BLE001 -- not importable, for whatever reason
                raise Unavailable("not_installed", f"deepspeed not importable (MegaTrain's configs step "
                                                   f"DeepSpeedCPUAdam): {capacity_bench.one_line(exc)}") from exc
            opt_class = DeepSpeedCPUAdam
            rec["deepspeed"] = importlib.import_module("deepspeed").__version__
        from infinity import CPUMasterConfig, CPUMasterModel
        from infinity.model import cpu_master

        rec["cross_entropy"] = "flash-attn" if getattr(cpu_master, "FLASH_CE_AVAILABLE", False) else "torch"

        state["stage"] = "build"
        capacity_bench.progress(stage="build")
        t0 = time.perf_counter()
        hf_model = build_llama(args.size, args.seq)
        rec["params"] = sum(p.numel() for p in hf_model.parameters())
        rec["attn_implementation"] = hf_model.config._attn_implementation
        config = CPUMasterConfig(
            model_name=f"llama-{args.size} (random, capacity_bench shape)", device=0, dtype=torch.bfloat16,
            attn_implementation="sdpa", dataset_path="synthetic tokens (not read)", max_seq_len=args.seq,
            batch_size=args.batch, gradient_accumulation_steps=1, num_steps=1 + args.warmup + args.iters,
            learning_rate=LR, weight_decay=WD, max_grad_norm=CLIP, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
            checkpoint_interval=args.checkpoint_interval, num_grad_slabs=args.grad_slabs, seed=0)
        t_wrap = time.perf_counter()
        model = CPUMasterModel(hf_model, config)
        del hf_model
        torch.cuda.synchronize()
        rec["wrap_s"] = round(time.perf_counter() - t_wrap, 3)
        rec["build_s"] = round(time.perf_counter() - t0, 3)

        state["stage"] = "optimizer"
        capacity_bench.progress(stage="optimizer", build_s=rec["build_s"], params=rec["params"])
        t1 = time.perf_counter()
        params = model.get_parameters()
        if opt_class is torch.optim.AdamW:
            opt = opt_class(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
            rec["optimizer"] = "torch.optim.AdamW (CPU, bf16 weights and moments)"
        else:
            opt = opt_class(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
            rec["optimizer"] = "DeepSpeedCPUAdam (adamw_mode, fp32 moments, bf16 weights: no fp32 master)"

        g = torch.Generator(device="cuda").manual_seed(0)  # capacity_bench's tokens
        tokens = torch.randint(0, SIZES[args.size]["vocab"], (args.batch, args.seq), device="cuda", generator=g).cpu()
        if args.mask == "none":
            mask = NoMask()
            rec["attention"] = "sdpa, no mask tensor (is_causal)"
        else:
            mask = CPUMasterModel._prepare_4d_causal_mask(torch.ones(args.batch, args.seq, device="cuda"),
                                                          torch.bfloat16, args.seq)
            rec["attention"] = "sdpa, additive 4-D causal mask (MegaTrain's non-flash mask)"

        def iteration():
            t = time.perf_counter()
            loss, _, _ = model.forward_and_backward(tokens, mask, tokens)
            t_fb = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            t_clip = time.perf_counter()
            opt.step()
            t_opt = time.perf_counter()
            model._sync_params_to_gpu()  # noqa: SLF001 -- MegaTrain's train.py calls it so after every step
            model.zero_grad()
            opt.zero_grad()
            torch.cuda.synchronize()
            t_end = time.perf_counter()
            return loss, {"forward_backward": t_fb - t, "clip": t_clip - t_fb, "optimizer": t_opt - t_clip,
                          "sync_params": t_end - t_opt}

        state["stage"] = "first_step"
        loss, _ = iteration()
        losses = [loss]
        rec["first_step_s"] = round(time.perf_counter() - t1, 3)

        state["stage"] = "iterations"
        capacity_bench.progress(stage="iterations", build_s=rec["build_s"], params=rec["params"],
                                first_step_s=rec["first_step_s"])
        times, phases = [], []
        for _ in range(args.warmup + args.iters):
            t = time.perf_counter()
            loss, phase = iteration()
            times.append(time.perf_counter() - t)
            losses.append(loss)
            phases.append(phase)
        timed = times[args.warmup:]
        iter_s = statistics.median(timed)
        losses = [float(v) for v in losses]
        rec.update(trains=True, iter_s=iter_s, tokens_per_s=args.batch * args.seq / iter_s,
                   **window_figures(timed, args.batch * args.seq), iter_times_s=[round(t, 4) for t in times],
                   phases_s={k: round(statistics.median(p[k] for p in phases[args.warmup:]), 4) for k in phases[0]},
                   loss_first=losses[0], loss_last=losses[-1],
                   finite_loss=all(v == v and abs(v) != float("inf") for v in losses))
    except Exception as exc:  # noqa: BLE001 -- reported, whatever it is
        if not isinstance(exc, Unavailable):
            traceback.print_exc()
        kind = exc.kind if isinstance(exc, Unavailable) else capacity_bench.failure_kind(exc)
        rec.update(trains=False, reason=str(exc) if isinstance(exc, Unavailable) else capacity_bench.one_line(exc),
                   failure=kind, stage=state["stage"])
    if cuda:
        import torch

        rec.update(peak_gpu_reserved_gb=torch.cuda.max_memory_reserved() / 1e9,
                   peak_gpu_allocated_gb=torch.cuda.max_memory_allocated() / 1e9)
        with contextlib.suppress(Exception):
            free, total = torch.cuda.mem_get_info()
            rec["gpu_used_at_end_gb"] = (total - free) / 1e9
    else:
        rec.update(peak_gpu_reserved_gb=None, peak_gpu_allocated_gb=None)
    rec["peak_host_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    if rec["params"]:
        rec["peak_host_bytes_per_param"] = round(rec["peak_host_gb"] * 1e9 / rec["params"], 2)
    print("RESULT " + json.dumps(rec), flush=True)
    # No teardown (MegaTrain's gradient thread, DeepSpeed's optimizer): the record is out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if rec["trains"] else 1)


# ---- the driver -----------------------------------------------------------------------------------

def child(args, argv):
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--one"]
    out, err, timed_out, wall, code = capacity_bench.run_bounded(cmd, args.timeout)
    if args.log:
        with open(args.log, "w") as f:
            f.write(out + "\n---- stderr ----\n" + err)
    rec, last = capacity_bench.child_records(out)
    if rec is None:
        rec = {"system": "megatrain", "size": args.size, "trains": False, "params": None,
               "expected_params": capacity_bench.expected_params(args.size), "batch": args.batch, "seq": args.seq,
               **{k: v for k, v in last.items() if k != "stage"}, "stage": last.get("stage")}
        if timed_out:
            rec.update(reason=f"timed out after {args.timeout} s", failure="timeout")
        elif code < 0:
            rec.update(reason=capacity_bench.signal_reason(code), failure="killed")
        else:
            rec.update(reason=f"exit {code}: {capacity_bench.last_exception_line(err or out)}",
                       failure="error")
    if not rec["trains"] and err.strip():
        sys.stderr.write("\n".join(err.strip().splitlines()[-15:]) + "\n")
    rec["wall_s"] = wall
    return rec


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", required=True, choices=list(SIZES), help="a capacity_bench.py shape")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations after the first")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations (iter_s is their median)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds for the whole run")
    ap.add_argument("--mask", choices=("none", "4d"), default="none",
                    help="attention mask handed to MegaTrain: none (sdpa is_causal) or its 4-D additive one")
    ap.add_argument("--checkpoint-interval", type=int, default=4, help="MegaTrain's: layers between checkpoints")
    ap.add_argument("--grad-slabs", type=int, default=12, help="MegaTrain's num_grad_slabs")
    ap.add_argument("--optimizer", choices=("deepspeed_adam", "adamw"), default="deepspeed_adam",
                    help="MegaTrain's optimizer.type (its configs: deepspeed_adam)")
    ap.add_argument("--log", default=None, help="file for the child's whole output")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, low in (("batch", 1), ("seq", 2), ("warmup", 0), ("iters", 1), ("timeout", 1),
                      ("checkpoint_interval", 1), ("grad_slabs", 1)):
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.one:
        return run_one(args)
    rec = child(args, argv)
    print("RESULT " + json.dumps(rec), flush=True)
    return 0 if rec["trains"] else 1


if __name__ == "__main__":
    sys.exit(main())
