"""bench/figures.py: the README's results table is the one rendered from bench/results/, and the
check fails on a figure that differs from its file."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import figures  # noqa: E402


def test_the_readme_carries_the_tables_of_the_result_files():
    assert figures.check((ROOT / "README.md").read_text()) == []


def test_a_figure_changed_in_the_page_or_in_its_file_fails_the_check(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    table = figures.l3b_vs_deepspeed()
    row = next(line for line in table.splitlines() if line.startswith("| hytrain, fp32"))
    tokens = row.split(" | ")[1]
    assert figures.check(readme.replace(row, row.replace(tokens, str(int(tokens) + 1)))) == ["l3b_vs_deepspeed"]
    # The same page against a result file whose hytrain run was slower.
    res = json.loads((figures.RESULTS / "l3b_vs_deepspeed.json").read_text())
    for r in res["runs"]:
        if r["mode"] == "hytrain_k0":
            r["wall_tokens_per_s"] *= 0.9
    for other in figures.RESULTS.glob("*.json"):
        (tmp_path / other.name).write_text(other.read_text())
    (tmp_path / "l3b_vs_deepspeed.json").write_text(json.dumps(res))
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    assert figures.check(readme) == ["l3b_vs_deepspeed"]


def test_the_ratios_are_wall_clock_against_deepspeed_of_the_same_file():
    res = json.loads((figures.RESULTS / "l3b_vs_deepspeed.json").read_text())
    by = {r["mode"]: r for r in res["runs"]}
    ds = by["deepspeed_offload"]
    for r in res["runs"]:  # wall-clock: the window's tokens over its time, i.e. tokens / mean iteration
        assert abs(r["wall_tokens_per_s"] - r["tokens_per_step"] / r["iter_s_mean"]) < 1e-6 * r["wall_tokens_per_s"]
    table = figures.l3b_vs_deepspeed()
    want = by["hytrain_k0_bf16"]["wall_tokens_per_s"] / ds["wall_tokens_per_s"]
    assert f"| {want:.2f}x |" in table


def test_the_megatrain_table_is_wall_clock_against_megatrain_of_the_same_file():
    res = json.loads((figures.RESULTS / "megatrain_160.json").read_text())
    by = {r["system"]: r for r in res["runs"]}
    for r in res["runs"]:  # the same tokens a step, the wall-clock rate over the timed window
        assert r["tokens"] == 160 * 1024
        assert abs(r["wall_tokens_per_s"] - r["tokens"] / r["iter_s_mean"]) < 1e-6 * r["wall_tokens_per_s"]
    want = by["hytrain_stream"]["wall_tokens_per_s"] / by["megatrain"]["wall_tokens_per_s"]
    assert f"| {want:.2f}x |" in figures.megatrain_160()
