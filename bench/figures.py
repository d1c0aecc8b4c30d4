"""The figures the README quotes, from the result files under bench/results/ (each one benchmark
invocation's records, as bench/device.sh's stages print them, with the command and the machine).

    python bench/figures.py            # prints the README's tables rendered from the result files
    python bench/figures.py --check    # fails where README.md does not carry them exactly

tests/python/test_figures.py runs the check in CI, so a quoted figure cannot drift from its file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

SYSTEMS = {  # the run's mode -> what the table calls it
    "deepspeed_offload": "DeepSpeed 0.19.8 ZeRO-Offload (ZeRO-2, DeepSpeedCPUAdam)",
    "hytrain_k0": "hytrain, fp32 states, every state on the host (k = 0)",
    "hytrain_k0_bf16": "hytrain, bf16 states, k = 0",
    "hytrain_k0_8bit": "hytrain, 8-bit states, k = 0",
}


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def l3b_vs_deepspeed() -> str:
    """The README's first table: wall-clock tokens/s over each run's timed window, the ratio to
    DeepSpeed's, the median and p90 iteration, the peak GPU memory reserved."""
    res = load("l3b_vs_deepspeed")
    runs = [r for r in res["runs"] if "wall_tokens_per_s" in r]
    ref = next(r for r in runs if r["mode"] == "deepspeed_offload")
    lines = ["| L3B (3.14 B), 2 x 2048 tokens a step, " + res["device"] + " | wall-clock tokens/s | vs DeepSpeed "
             "| s/iteration: median (p90) | peak GPU reserved |", "|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: r["wall_tokens_per_s"]):
        ratio = "1" if r is ref else f"{r['wall_tokens_per_s'] / ref['wall_tokens_per_s']:.2f}x"
        held = f" (limit {r['cap_gb']:.1f})" if r.get("cap_gb") else ""
        lines.append(f"| {SYSTEMS[r['mode']]} | {r['wall_tokens_per_s']:.0f} | {ratio} | "
                     f"{r['iter_s_median']:.3f} ({r['iter_s_p90']:.3f}) | {r['peak_gpu_reserved_gb']:.1f} GB{held} |")
    return "\n".join(lines)


def megatrain_160() -> str:
    """The streamed weights against MegaTrain at its own tokens per step: wall-clock tokens/s, the
    ratio to MegaTrain's, the median and p90 iteration, model TFLOPS (6 N T over the mean
    iteration), peak GPU reserved and host memory, whether the loss stayed finite."""
    res = load("megatrain_160")
    ref = next(r for r in res["runs"] if r["system"] == "megatrain")
    names = {"megatrain": "MegaTrain 919520f: one forward and backward of 160, DeepSpeed's CPU Adam, no fp32 master",
             "hytrain_stream": "hytrain, every layer streamed, fp32 states and masters, 10 micro-batches of 16"}
    lines = ["| 7 B, 160 x 1024 tokens a step (MegaTrain's configuration), " + res["device"] + " | wall-clock "
             "tokens/s | vs MegaTrain | s/iteration: median (p90) | model TFLOPS | peak GPU reserved | peak host "
             "| loss finite |", "|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        ratio = "1" if r is ref else f"{r['wall_tokens_per_s'] / ref['wall_tokens_per_s']:.2f}x"
        tflops = 6 * r["params"] * r["wall_tokens_per_s"] / 1e12
        lines.append(f"| {names[r['system']]} | {r['wall_tokens_per_s']:.0f} | {ratio} | {r['iter_s_median']:.2f} "
                     f"({r['iter_s_p90']:.2f}) | {tflops:.0f} | {r['peak_gpu_reserved_gb']:.1f} GB | "
                     f"{r['peak_host_gb']:.1f} GB | {'yes' if r['finite_loss'] else 'no'} |")
    return "\n".join(lines)


TABLES = {"l3b_vs_deepspeed": l3b_vs_deepspeed, "megatrain_160": megatrain_160}


def check(text: str) -> list[str]:
    """The tables (by name) that ``text`` does not carry exactly as rendered."""
    return [name for name, render in TABLES.items() if render() not in text]


def main(argv) -> int:
    if argv == ["--check"]:
        missing = check((ROOT / "README.md").read_text())
        for name in missing:
            print(f"README.md does not carry the table {name} as bench/results/ gives it:\n{TABLES[name]()}\n")
        return 1 if missing else 0
    for name, render in TABLES.items():
        print(f"<!-- {name}: python bench/figures.py -->\n{render()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
