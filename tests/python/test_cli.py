import json
import subprocess
import sys


def test_info_runs_and_measures():
    out = subprocess.run([sys.executable, "-m", "hytrain", "info", "--json", "--params", "200000"],
                         check=True, capture_output=True, text=True).stdout
    info = json.loads(out)
    assert info["simd_selected"] in info["simd_compiled"]
    assert info["measured"]["cpu_adamw_gparams_per_s"] > 0
    assert info["measured"]["host_triad_gbps"] > 0


def test_bad_flag_exits_nonzero():
    r = subprocess.run([sys.executable, "-m", "hytrain", "info", "--params", "-3"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "--params must be > 0" in r.stderr
