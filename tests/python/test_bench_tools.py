"""The benchmark readers that need no GPU: bench/trace_summary.py on a timeline of the CPU path, and
bench/summarise_runs.py on a log of records as train_bench.py prints them."""

import json
import sys
from pathlib import Path

import hytrain

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import summarise_runs  # noqa: E402
import trace_summary  # noqa: E402
from test_hybrid_adam import batches, pair, train  # noqa: E402


def test_trace_summary_gives_each_iteration_its_updates(tmp_path):
    model, _ = pair()
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, workers=2, trace=3)
    train(model, opt, batches(4))
    path = opt.export_trace(tmp_path / "t.json")
    events = json.load(open(path))["traceEvents"]
    updates = [e for e in events if e["ph"] == "X" and e["pid"] == 2]
    assert all("queued_us" in e["args"] and e["args"]["queued_us"] >= 0 for e in updates)
    rows = trace_summary.summarise(path)
    n = len(opt.blocks)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for r in rows:
        durs = sorted(e["dur"] / 1e3 for e in updates if e["args"]["iteration"] == r["iteration"])
        assert r["updates"] == n and len(r["first_ms"]) == 3 and r["max_ms"] == max(durs)
        assert abs(r["sum_ms"] - sum(durs)) < 1e-6 and r["compute_ms"] > 0 and 0 <= r["slow"] < n
        # each block's team: 1 or 2 of the 2 workers ran its slices, busy for at most span x workers
        assert all(1 <= w <= 2 and 0 < share <= 1.05 for w, share in r["first_team"]), r["first_team"]
    for e in updates:
        assert 1 <= e["args"]["workers"] <= 2 and 0 < e["args"]["busy_ms"] <= 2 * e["dur"] / 1e3 * 1.05 + 0.01


def test_summarise_runs_reads_records_and_ratios(tmp_path, capsys):
    base = {"workload": "l3b", "tokens_per_step": 4096, "iter_s_median": 1.0, "iter_s_mean": 1.1,
            "iter_s_p90": 1.2, "iter_s_max": 1.3, "warmup": 5, "k": 0, "peak_gpu_reserved_gb": 27.1,
            "iter_times_s": [5.0, 1.0, 1.1], "thread_cpu": {"hytrain-update": {"cores": 14.3}}}
    log = tmp_path / "run.log"
    log.write_text("noise\n" + json.dumps({**base, "mode": "deepspeed_offload", "wall_tokens_per_s": 1000.0}) + "\n"
                   + json.dumps({**base, "mode": "hytrain_k0", "wall_tokens_per_s": 2500.0,
                                 "step_call_s": [0.01, 0.02]}) + "\n"
                   + json.dumps({"mode": "hytrain_auto", "error": "timed out after 400 s"}) + "\n")
    recs = summarise_runs.records(log)
    assert [r["mode"] for r in recs] == ["deepspeed_offload", "hytrain_k0", "hytrain_auto"]
    summarise_runs.main([str(log)])
    out = capsys.readouterr().out
    assert "wall 2500 tok/s (2.50x)" in out and "update threads 14.3 cores" in out
    assert "step() [0.01, 0.02]" in out and "hytrain_auto: timed out after 400 s" in out


def test_the_shadows_pool_work_is_set_beside_the_iterations_it_overlapped():
    import train_bench
    spans = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    work = [("ahead", -0.5, 0.25, 1 << 30), ("lock", 0.75, 1.5, 1 << 28), ("trim", 2.9, 3.4, 1 << 28),
            ("lock", 1.25, 1.5, 1 << 28)]
    assert train_bench.work_per_iteration(work, spans) == [
        {"ahead": 0.25, "lock": 0.25}, {"lock": 0.75}, {"trim": 0.1}]
    assert train_bench.work_per_iteration([], spans) == [{}, {}, {}]
