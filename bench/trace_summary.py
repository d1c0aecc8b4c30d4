"""Summarises a hytrain timeline (``HybridAdamW(trace=N)`` / ``train_bench.py --trace``) per iteration:
the compute span (first forward mark to the last backward mark), the CPU block updates (how many,
the first three in the order they started, the median, the slowest, and their sum), and the queueing
(an update's start less its submission: time a block waited for free workers).

    python bench/trace_summary.py TRACE.json [TRACE2.json ...]

One line per iteration, so a slow and a fast iteration read side by side."""

from __future__ import annotations

import collections
import json
import statistics
import sys


def summarise(path: str) -> list[dict]:
    events = json.load(open(path))["traceEvents"]
    compute = collections.defaultdict(list)
    updates = collections.defaultdict(list)
    for ev in events:
        if ev.get("ph") != "X":
            continue
        it = ev.get("args", {}).get("iteration")
        if ev["pid"] == 1 and ev["tid"] == 1:
            compute[it].append((ev["ts"], ev["ts"] + ev["dur"]))
        elif ev["pid"] == 2:
            a = ev["args"]
            updates[it].append((ev["ts"], ev["dur"], a.get("queued_us", 0.0), a.get("workers"), a.get("busy_ms")))
    rows = []
    for it in sorted(set(compute) | set(updates), key=lambda i: (i is None, i)):
        c, u = compute.get(it, []), sorted(updates.get(it, []))
        row = {"iteration": it, "updates": len(u)}
        if c:
            row["compute_ms"] = (max(e for _, e in c) - min(s for s, _ in c)) / 1e3
        if u:
            durs = [d / 1e3 for _, d, *_ in u]
            row.update(first_ms=[round(d, 1) for d in durs[:3]], median_ms=statistics.median(durs),
                       max_ms=max(durs), sum_ms=sum(durs), queued_max_ms=max(x[2] for x in u) / 1e3,
                       span_ms=(max(x[0] + x[1] for x in u) - min(x[0] for x in u)) / 1e3,
                       slow=sum(d > 2.5 * statistics.median(durs) for d in durs))
            if u[0][3] is not None:
                # per block: the workers that ran its slices, and the share of span x workers they spent inside them
                # (near 1: every one of them was busy with it throughout, so its slices ran slowly)
                row["first_team"] = [(x[3], round(x[4] / (x[1] / 1e3 * x[3]), 2) if x[3] and x[1] else None)
                                     for x in u[:3]]
                row["median_workers"] = statistics.median(x[3] for x in u)
        rows.append(row)
    return rows


def main(argv):
    for path in argv:
        print(f"== {path}")
        for row in summarise(path):
            print("  " + " ".join(f"{k}={round(v, 1) if isinstance(v, float) else v}" for k, v in row.items()))


if __name__ == "__main__":
    main(sys.argv[1:] or sys.exit(__doc__))
