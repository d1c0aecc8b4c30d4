import json
import subprocess
import sys


def test_info_runs_and_measures():
    out = subprocess.run([sys.executable, "-m", "hytrain", "info", "--json", "--params", "200000"],
                         check=True, capture_output=True, text=True).stdout
    info = json.loads(out)
    assert info["simd_selected"] in info["simd_compiled"]
    from hytrain.distributed import default_workers

    assert info["update_workers"] == default_workers() >= 1  # the optimizer's default workers= here
    assert info["measured"]["cpu_adamw_gparams_per_s"] > 0
    assert info["measured"]["host_triad_gbps"] > 0


def test_bad_flag_exits_nonzero():
    r = subprocess.run([sys.executable, "-m", "hytrain", "info", "--params", "-3"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "--params must be > 0" in r.stderr


def test_a_bad_flag_or_value_is_one_line():
    # argparse's own refusals (an unknown choice, a value its type refuses, a missing argument) say
    # what is wrong in one line, as every other refusal does, without the usage block before it.
    for argv in (["train", "--stream", "abc"], ["train", "--state-format", "xyz"], ["train", "--no-such-flag"],
                 ["verify"], ["info", "--params", "x"], ["bogus"]):
        r = subprocess.run([sys.executable, "-m", "hytrain", *argv], capture_output=True, text=True)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (argv, r.stderr)
        assert lines[0].startswith("hytrain") and ": error: " in lines[0] and "--help" in lines[0], argv
