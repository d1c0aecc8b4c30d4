"""The timed window's figures, as a user's run sees them: every benchmark reports these beside its
median iteration. A user pays the mean, not the median, so the wall-clock throughput is the tokens
of the window over its whole time, and the spread is the p90 and the slowest iteration."""

from __future__ import annotations

import math
import statistics


def window_figures(times, tokens_per_iteration=None) -> dict:
    """``times``: the timed iterations' seconds, in order. Returns the median, mean, p90 (nearest
    rank) and max iteration, the window's seconds and iteration count, the mean and p90 over the
    median, and, with ``tokens_per_iteration``, the wall-clock tokens/s (tokens over the window's
    total time). Empty where there are no times."""
    times = [float(t) for t in times]
    if not times:
        return {}
    ordered = sorted(times)
    total = sum(times)
    median = statistics.median(ordered)
    mean = total / len(times)
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    out = {"iter_s_median": median, "iter_s_mean": mean, "iter_s_p90": p90, "iter_s_max": ordered[-1],
           "window_s": total, "window_iterations": len(times),
           "mean_over_median": mean / median if median > 0 else None,
           "p90_over_median": p90 / median if median > 0 else None}
    if tokens_per_iteration is not None:
        out["wall_tokens_per_s"] = tokens_per_iteration * len(times) / total if total > 0 else None
    return out
