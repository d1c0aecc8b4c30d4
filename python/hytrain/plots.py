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


def timeline_png(trace_path, png: Path, plt) -> str | None:
    """One iteration of a Chrome trace (the last complete one) as horizontal bars, one row per track."""
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
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(rows) + 1.2))
    colors = {"forward": "tab:blue", "backward": "tab:orange", "d2h": "tab:red", "h2d": "tab:green",
              "AdamW": "tab:purple"}
    for y, row in enumerate(rows):
        for e in (e for e in spans if (e["pid"], e["tid"]) == row):
            c = next((v for k, v in colors.items() if e["name"].startswith(k)), "tab:gray")
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 1e-3))], (y - 0.4, 0.8), color=c,
                           edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([names.get(r, str(r)) for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"iteration {pick}: compute, copies and updates per block")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return str(png)
