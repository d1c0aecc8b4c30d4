"""Command line: ``hytrain info`` (also ``python -m hytrain info``).

Prints what the native build contains, the devices it sees, and a quick measurement of the two rates
that bound an offloaded optimizer step: the CPU AdamW rate and host memory bandwidth, plus the
host-device copy bandwidth from pinned pool memory when a GPU is usable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from . import early_signals


def _time(fn, repeats=3):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(params: int, threads: int) -> dict:
    import hytrain

    from . import host_rate

    out = {}
    # In pool memory, placed as the optimizer's is; then, on several NUMA nodes, one process per node
    # at once (what the host can do: one process should reach ~all of it).
    t = host_rate.update_seconds(params, 3, threads) / 3
    out["cpu_adamw_gparams_per_s"] = params / t / 1e9
    out["cpu_adamw_gbps"] = host_rate.BYTES_PER_PARAM * params / t / 1e9
    nodes = hytrain.pool.page_placement()["nodes"]
    if len(nodes) > 1:
        per_node = host_rate.processes_rate(len(nodes), params, 3)
        out["cpu_adamw_gparams_per_s_one_process_per_node"] = per_node["gparams_per_s"]
    bw = hytrain.native().measure_host_bandwidth(params, threads, 3)
    out["host_triad_gbps"] = bw["triad_gbps"]
    out["host_update_gbps"] = bw["update_gbps"]
    if hytrain.cuda_available() and torch.cuda.is_available():
        pool = hytrain.PinnedPool(4 * params * 2 + (64 << 20))
        host = pool.empty(params, torch.float32)
        dev = torch.empty(params, dtype=torch.float32, device="cuda")
        nbytes = 4 * params

        def h2d():
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        def d2h():
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()

        out["h2d_gbps"] = nbytes / _time(h2d) / 1e9
        out["d2h_gbps"] = nbytes / _time(d2h) / 1e9
    return out


def cmd_info(args) -> int:
    import hytrain
    from hytrain.distributed import default_workers
    from hytrain.state_formats import FORMATS

    info = hytrain.build_info()
    if not info.get("cuda_driver"):  # ("": the CUDA build found no driver; None: a build without CUDA)
        info["cuda_driver"] = None if args.json else (
            "none (no NVIDIA driver)" if info.get("cuda") else "none (a build without CUDA)")
    info["torch"] = torch.__version__
    info["torch_cuda_devices"] = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [])
    info["cpu_count"] = os.cpu_count()
    info["update_workers"] = default_workers()  # HybridAdamW's default workers= here
    info["simd"] = hytrain.simd_paths()
    info["page_placement"] = hytrain.pool.page_placement()
    # The optimizer-state formats (state_format=, --state-format): state bytes a parameter, master included.
    info["state_formats"] = {f.name: round(4 + f.bytes_per_parameter(), 2) for f in FORMATS.values()}
    if not args.no_measure:
        info["measured"] = measure(args.params, args.threads or default_workers())
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(len(k) for k in info)
    for k, val in info.items():
        if isinstance(val, dict):
            val = ", ".join(f"{a}={b:.2f}" if isinstance(b, float) else f"{a}={b}" for a, b in val.items())
        print(f"{k:<{width}}  {val}")
    return 0


def cmd_verify(args) -> int:
    """Checks a checkpoint offline: its sealed manifest and every file's size and SHA-256."""
    from pathlib import Path

    from . import checkpoint as ckpt

    path = Path(args.path)
    try:
        if not path.exists():
            raise ckpt.CheckpointError(f"{path} does not exist")
        if not path.is_dir():
            raise ckpt.CheckpointError(f"{path} is not a directory")
        if not (path / "meta.json").exists():
            run_files = ("checkpoints", "metrics.jsonl", "config.json", "hytrain.lock")
            if (path / "checkpoints").is_dir():  # a run's directory: its newest checkpoint
                found = ckpt.checkpoint_dirs(path)
                if not found:
                    raise ckpt.CheckpointError(f"{path}: no checkpoint under {path / 'checkpoints'}")
                path = found[-1]
            elif any((path / f).exists() for f in run_files):
                raise ckpt.CheckpointError(f"{path} is a run directory without checkpoints (no {path / 'checkpoints'})")
            elif not any(path.iterdir()):
                raise ckpt.CheckpointError(f"{path} is empty: neither a checkpoint nor a run directory")
            elif not _checkpoint_like(path):  # (a checkpoint without meta.json: verify says it is incomplete)
                raise ckpt.CheckpointError(f"{path} is neither a checkpoint (no meta.json) nor a run directory (no "
                                           "checkpoints/): pass a checkpoint directory (step_N) or a run's --out")
        t0 = time.perf_counter()
        meta = ckpt.verify(path)
    except ckpt.CheckpointError as e:
        from .job.options import to_stderr

        hint = ckpt.after_damage(path) if path.name.startswith("step_") else ""  # a damaged checkpoint
        to_stderr(f"hytrain verify: {e}{hint}")  # (exit 2 with stderr closed too)
        return 2
    secs = time.perf_counter() - t0
    total = sum(f["bytes"] for f in meta["files"].values())
    kind = "sharded" if meta["format"] != ckpt.FORMAT and str(meta["format"]).startswith("dcp") else "single-process"
    n = len(meta["files"])
    print(f"{path}: OK, {kind} checkpoint of step {meta['step']}, {n} file{'' if n == 1 else 's'}, "
          f"{total / 1e9:.3f} GB verified in {secs:.2f} s")
    return 0


def _checkpoint_like(path) -> bool:
    """Whether a directory without meta.json is a checkpoint still: named as one (step_N), or holding
    a checkpoint's files (single-process, or sharded: .metadata and .distcp shards)."""
    from . import checkpoint as ckpt

    return (path.name.startswith("step_") or any((path / f).exists() for f in (*ckpt.FILES, ".metadata"))
            or any(path.glob("*.distcp")))


def cmd_export(args) -> int:
    """A run's checkpoint as a Hugging Face model directory (``from_pretrained`` loads it)."""
    from .checkpoint import CheckpointError
    from .job.hf import export_run, parameter_count
    from .job.options import ConfigError, to_stderr

    try:
        out, source = export_run(args.run, args.to, checkpoint=args.checkpoint, with_source=True)
        n = parameter_count(out)
    except (ConfigError, CheckpointError, OSError) as e:  # (a full disk or I/O error: ConfigError, one line)
        to_stderr(f"hytrain export: error: {e}")
        return 2
    print(f"{out}: a Hugging Face model directory of {n / 1e6:.2f} M parameters, from {source}")
    return 0


_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def count(text: str) -> int:
    """A count such as ``--params``': a number, or one with K, M or G in powers of 2 (``16M`` is
    16 * 2**20, ``1.5K`` 1536); a fraction of one is refused."""
    import argparse
    import re

    m = re.fullmatch(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([KMG]?)\s*", text, re.IGNORECASE)
    value = float(m.group(1)) * _SUFFIXES[m.group(2).upper()] if m else None
    if value is None or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number, optionally with K, M or G (powers of 2: 16M is "
                                         f"16*2**20), got {text!r}")
    return int(value)


def main(argv=None) -> int:
    from .job.options import Parser  # (bad flags in one line, as the job's)

    ap = Parser(prog="hytrain", description="hytrain: CPU+GPU training engine")
    sub = ap.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="build info, devices, CPU AdamW rate and copy bandwidth",
                            description="Prints what the native build contains (CUDA or not, its architectures, "
                            "SIMD paths, OpenMP), the devices torch sees, and a quick measurement of the CPU "
                            "AdamW rate, host memory bandwidth and, with a usable GPU, the host-device copy "
                            "bandwidth from pinned memory.")
    p_info.add_argument("--params", type=count, default=16 * 2**20,
                        help="parameters in the quick AdamW measurement: a number, or one with K, M or G, in "
                        "powers of 2 (1K = 1024, 1M = 2**20, 1G = 2**30); default 16M")
    p_info.add_argument("--threads", type=int, default=0,
                        help="threads (default: the optimizer's default update workers here)")
    p_info.add_argument("--no-measure", action="store_true", help="skip the measurements")
    p_info.add_argument("--json", action="store_true", help="print one JSON object")
    p_info.set_defaults(fn=cmd_info)
    p_verify = sub.add_parser("verify", help="check a checkpoint (single-process or sharded) offline: its "
                              "manifest and every file's size and SHA-256; exit 2 if anything is wrong",
                              description="Checks a checkpoint offline, without loading it: its sealed manifest, "
                              "then every file's size and SHA-256 against it. path is a checkpoint directory "
                              "(step_N, single-process or sharded) or a run's --out, whose newest checkpoint is "
                              "checked. Prints one line: OK, the step, the files and bytes verified (exit 0); or "
                              "what is wrong, with the newest complete checkpoint before a damaged one where "
                              "there is one (exit 2).")
    p_verify.add_argument("path", help="a checkpoint directory, or a run's --out (its newest checkpoint)")
    p_verify.set_defaults(fn=cmd_verify)
    p_export = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory "
                              "(config, safetensors, tokenizer) that transformers' from_pretrained loads",
                              description="Writes a checkpoint of a run (hytrain train's --out) as a Hugging Face "
                              "model directory: config.json, safetensors weights and the tokenizer's files, which "
                              "AutoModelForCausalLM.from_pretrained loads. Any checkpoint of the run, of a run "
                              "still training too (the checkpoint read is held against the run's pruning). The "
                              "directory is written beside --to and renamed into place: a failed export (exit 2, "
                              "one line) leaves nothing behind.")
    p_export.add_argument("run", help="the run's directory (its --out)")
    p_export.add_argument("--to", required=True, help="the directory to write (new, or empty); written beside "
                          "it, then renamed into place: a failed export (exit 2) leaves nothing")
    p_export.add_argument("--checkpoint", default="latest",
                          help="latest (the default), a checkpoint's name (step_N) in the run, or its path")
    p_export.set_defaults(fn=cmd_export)
    sub.add_parser("train", help="train a model (embedded default: a tiny Llama on the Python stdlib "
                   "sources); see hytrain train --help", add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        from .job import main as train_main

        try:
            return train_main(argv[1:])
        finally:
            early_signals.after_run()
    args = ap.parse_args(argv)
    if getattr(args, "params", 1) <= 0:
        ap.error("--params must be > 0")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
