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


def test_info_params_take_k_m_g_in_powers_of_2_as_the_16m_default_does(capsys):
    import pytest

    from hytrain.__main__ import count, main

    assert [count(v) for v in ("1000", "1K", "64k", "1M", "16M", "1.5K", "2G")] == \
        [1000, 1024, 65536, 2**20, 16 * 2**20, 1536, 2 * 2**30]
    assert main(["info", "--json", "--params", "64K"]) == 0
    assert json.loads(capsys.readouterr().out)["measured"]["cpu_adamw_gparams_per_s"] > 0
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "K, M or G, in powers of 2 (1K = 1024, 1M = 2**20, 1G = 2**30); default 16M" in said, said
    for bad in ("1.5", "1Q", "16 MB", "1e6"):
        with pytest.raises(SystemExit) as e:
            main(["info", "--params", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, (bad, err)
        assert err.startswith("hytrain info: error: argument --params: expected a whole number, optionally with K, "
                              f"M or G (powers of 2: 16M is 16*2**20), got {bad!r}"), err


def test_info_says_plainly_that_there_is_no_cuda_driver(capsys, monkeypatch):
    # A CUDA build on a machine without a GPU's driver showed an empty cuda_driver field.
    import hytrain
    from hytrain.__main__ import main

    built = hytrain.build_info()
    for cuda, driver, said in (("13.0", "", "none (no NVIDIA driver)"), (None, None, "none (a build without CUDA)"),
                               ("13.0", "13.0", "13.0")):
        monkeypatch.setattr(hytrain, "build_info", lambda: dict(built, cuda=cuda, cuda_driver=driver))
        assert main(["info", "--no-measure"]) == 0
        fields = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
        assert fields["cuda_driver"] == said, fields
        assert main(["info", "--no-measure", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["cuda_driver"] == (driver or None)  # (JSON: null, not "")


def test_a_refusal_exits_2_with_stderr_closed(tmp_path, capsys, monkeypatch):
    # `hytrain train --lr -1 2>&-` exited 1 where the interpreter found a descriptor 2 it cannot write
    # (a launcher script's, left open read-only, as pyenv's shims do): writing the refusal's line raised
    # EBADF, which replaced the status. Where none is open (stderr None), the line went to stdout. The
    # line is lost now, on stdout too; the status (2) is not.
    import os

    def unwritable():
        os.close(2)
        os.open(os.devnull, os.O_RDONLY)  # (the lowest free descriptor: 2)

    r = subprocess.run([sys.executable, "-m", "hytrain", "train", "--lr", "-1"], stdout=subprocess.PIPE, text=True,
                       preexec_fn=unwritable)  # (the whole process: the interpreter's exit included)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    from hytrain.__main__ import main

    with open(os.devnull) as read_only:  # (in this process: no stderr, or one that cannot be written)
        for argv in (["verify", str(tmp_path / "none")], ["train", "--lr", "-1"],
                     ["export", str(tmp_path / "none"), "--to", str(tmp_path / "x")]):
            for stderr in (None, read_only):
                monkeypatch.setattr(sys, "stderr", stderr)
                assert main(argv) == 2, argv
                assert capsys.readouterr().out == "", argv
