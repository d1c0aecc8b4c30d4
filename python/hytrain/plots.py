"""Pictures of a run: loss curves and one iteration's timeline (matplotlib, when installed)."""

from __future__ import annotations

import json
from pathlib import Path


def write_all(out: Path, history: list[dict], trace_path) -> dict:
    """Writes loss.png and timeline.png into ``out``; returns their paths (empty without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    pictures = {}
    if history:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in history], [r["loss"] for r in history], lw=1, label="train")
        vals = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
        if vals:
            ax.plot(*zip(*vals), "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=120)
        plt.close(fig)
        pictures["loss_png"] = str(out / "loss.png")
    timeline = timeline_png(trace_path, out / "timeline.png", plt)
    if timeline:
        pictures["timeline_png"] = timeline
    return pictures


COLORS = {"forward": "tab:blue", "backward": "tab:orange", "d2h": "tab:red", "h2d": "tab:green",
          "GPU AdamW": "indigo", "CPU AdamW": "tab:purple"}
LABELS = {"forward": "forward", "backward": "backward",
          "d2h": "gradients to host (D2H)", "h2d": "weights to GPU (H2D)", "GPU AdamW": "AdamW on the GPU (k blocks)",
          "CPU AdamW": "AdamW on the CPU workers"}


def _kind(span_name: str, row_name: str) -> str:
    first = span_name.split(" ")[0]
    if first == "AdamW":
        return "GPU AdamW" if "GPU" in row_name else "CPU AdamW"
    return first if first in COLORS else "other"


def timeline_png(trace_path, png: Path, plt) -> str | None:
    """One iteration of a Chrome trace (the last complete one) as horizontal bars, one row per track:
    a colour per kind of work (legend), each bar labelled with its block where it is wide enough, and
    the iteration's k in the title."""
    from matplotlib.patches import Patch

    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    if not spans:
        return None
    its = sorted({e["args"]["iteration"] for e in spans})
    pick = its[-2] if len(its) > 1 else its[-1]  # the last iteration whose updates have all landed
    spans = [e for e in spans if e["args"]["iteration"] == pick]
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    t0 = min(e["ts"] for e in spans)
    width = (max(e["ts"] + e["dur"] for e in spans) - t0) / 1e3
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(rows) + 1.9))
    seen = set()
    for y, row in enumerate(rows):
        for e in (e for e in spans if (e["pid"], e["tid"]) == row):
            kind = _kind(e["name"], names.get(row, ""))
            seen.add(kind)
            x, w = (e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 1e-3)
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), color=COLORS.get(kind, "tab:gray"), edgecolor="white",
                           linewidth=0.3)
            block = e["name"].rsplit(" ", 1)[-1]
            if block.isdigit() and w > 0.025 * width:
                ax.text(x + w / 2, y, block, ha="center", va="center", fontsize=7, color="white")
    ks = [e["args"]["k"] for e in events if e["ph"] == "C" and "k" in e.get("args", {})
          and abs(e["ts"] - t0) < 1.0]
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([names.get(r, str(r)) for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the iteration's first forward")
    k_text = f", k = {ks[0]} block(s) updated on the GPU" if ks else ""
    ax.set_title(f"iteration {pick}: compute, copies and updates per block (numbers: blocks){k_text}")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in seen]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.3 / max(1, len(rows))),
              ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return str(png)
