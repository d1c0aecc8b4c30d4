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


def thread_cpu() -> dict:
    """This process's threads now: {tid: (name, CPU seconds so far)}, from /proc (Linux; {} elsewhere).
    The main thread is named "main"."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = ("main" if int(tid) == os.getpid() else name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_cpu_figures(before: dict, after: dict, window_s: float) -> dict:
    """Where the CPU went between two :func:`thread_cpu` readings, by thread name: the threads of
    that name that ran, the cores they kept busy on average over ``window_s`` and the busiest one's
    share of a core. Threads started in between count from zero."""
    groups = {}
    for tid, (name, seconds) in after.items():
        used = seconds - before.get(tid, (name, 0.0))[1]
        g = groups.setdefault(name, {"threads": 0, "cpu_s": 0.0, "busiest_s": 0.0})
        g["threads"] += used > 0
        g["cpu_s"] += used
        g["busiest_s"] = max(g["busiest_s"], used)
    if window_s <= 0:
        return {}
    return {name: {"threads": g["threads"], "cores": round(g["cpu_s"] / window_s, 3),
                   "busiest_core": round(g["busiest_s"] / window_s, 3)}
            for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["cpu_s"]) if g["cpu_s"] > 0}


def counters(thread_name: str = "hytrain-update") -> dict:
    """What the kernel has counted so far that may make one iteration slower than another: this
    process's minor and major page faults, the CPU seconds and involuntary context switches (a
    runnable thread taken off its core) of its threads named ``thread_name``, and the machine's
    steal and iowait seconds (a virtual machine's vCPUs not run by its host; from /proc/stat).
    Differences of two readings (:func:`counter_deltas`) belong to what ran between them. Linux; {}
    elsewhere."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out["minflt"], out["majflt"] = int(fields[7]), int(fields[9])
        with open("/proc/stat") as f:
            cpu = f.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
        out["iowait_s"], out["steal_s"] = int(cpu[5]) / tick, int(cpu[8]) / tick
    except (OSError, IndexError, ValueError):
        return {}
    mine = {tid: seconds for tid, (name, seconds) in thread_cpu().items() if name == thread_name}
    nvcsw = 0
    for tid in mine:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                nvcsw += next(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt_switches"))
        except (OSError, StopIteration, ValueError):  # the thread ended
            continue
    cpu_s = sum(mine.values())
    out["workers_cpu_s"], out["workers_preempted"] = cpu_s, nvcsw
    return out


def counter_deltas(readings) -> list:
    """The differences of consecutive :func:`counters` readings (one dict per interval, rounded)."""
    deltas = []
    for a, b in zip(readings, readings[1:]):
        deltas.append({k: round(b[k] - a[k], 3) for k in b if k in a})
    return deltas
