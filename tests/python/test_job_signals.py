"""`hytrain train` under signals during long stretches: a first SIGTERM in a long step says when it will
end, a second ends the run at once with the last checkpoint intact and the lock released; a signal
during the end-of-run outputs waits for summary.json, a second one stops at once."""

import json
import os
import signal
import time

import pytest

from hytrain import checkpoint as ckpt
from hytrain import plots
from hytrain.job import loop, main
from hytrain.job.signals import REPEAT_S

FAST = ["--batch-size", "4", "--seq-len", "64", "--no-progress", "--device", "cpu", "--workers", "1",
        "--eval-every", "0"]


@pytest.fixture(scope="module")
def fast(corpus):
    """FAST on a small text file (read at once; the embedded default walks the standard library)."""
    return [*FAST, "--data", corpus]


def test_a_second_sigterm_in_a_long_step_stops_at_once_keeping_the_last_checkpoint(tmp_path, monkeypatch, capsys, fast):
    real, calls = loop.inputs_and_targets, {"n": 0}

    def slow(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # step 3 would take minutes (a mistaken --seq-len, say)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(REPEAT_S + 0.2)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # not waited for: the second signal ends the run
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "inputs_and_targets", slow)
    out = tmp_path / "run"
    t0 = time.time()
    assert main(["--steps", "10", "--save-every", "2", "--out", str(out), *fast]) == 128 + signal.SIGTERM
    assert time.time() - t0 < 45
    said = capsys.readouterr().out
    assert "SIGTERM: step 3 (running for" in said and "send it again to stop at once" in said, said
    assert "stopped at once by a second SIGTERM during step 3" in said and "step_00000002" in said, said
    assert ckpt.verify(ckpt.resolve(out, "latest"))["step"] == 2
    assert not (out / "hytrain.lock").exists()
    # It resumes from there.
    monkeypatch.setattr(loop, "inputs_and_targets", real)
    assert main(["--steps", "4", "--resume", "latest", "--out", str(out), *fast]) == 0


def test_one_stop_delivered_twice_at_once_still_finishes_the_step_and_saves(tmp_path, monkeypatch, capsys, fast):
    # A signal to the process group that a launcher forwards again (torchrun's agent does) arrives
    # twice within milliseconds: one request, acted on at the end of the step.
    real, calls = loop.inputs_and_targets, {"n": 0}

    def twice(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "inputs_and_targets", twice)
    out = tmp_path / "run"
    assert main(["--steps", "10", "--out", str(out), *fast]) == 128 + signal.SIGTERM
    said = capsys.readouterr().out
    assert "stopped by signal 15 (SIGTERM) after step 3" in said and "stopped at once" not in said, said
    assert ckpt.verify(ckpt.resolve(out, "latest"))["step"] == 3


def test_the_stop_notice_names_the_step_that_will_be_the_last(tmp_path, monkeypatch, capsys, fast):
    # A signal after the step's stop flag was read (under --nproc: while the rank waits for the others
    # in the step's exchange) is acted on at the end of the next step, and the notice says so.
    from hytrain.job.ranks import Ranks

    real, calls = Ranks.gather, {"n": 0}

    def late(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # step 3's flag is read: the signal comes during its exchange
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Ranks, "gather", late)
    out = tmp_path / "run"
    assert main(["--steps", "10", "--out", str(out), *fast]) == 128 + signal.SIGTERM
    said = capsys.readouterr().out
    assert "SIGTERM: step 4 (the signal came after step 3 had checked for one) finishes" in said, said
    assert "stopped by signal 15 (SIGTERM) after step 4" in said, said
    assert ckpt.verify(ckpt.resolve(out, "latest"))["step"] == 4


def test_under_several_processes_a_signal_after_the_check_names_both_steps_it_may_stop_at():
    # Under --nproc the ranks stop at the first step any of them flagged: a signal after this rank's
    # check of step 3 stops the run after step 3 where another rank saw it before its own check, else
    # after step 4. The notice must not promise step 4 (it did, and the run stopped after step 3).
    from hytrain.job.signals import Signals

    for world, expected in ((1, "SIGTERM: step 4 (the signal came after step 3 had checked for one) finishes"),
                            (2, "SIGTERM: step 3 or 4 (the signal came after this process's check of step 3; "
                                "the step the 2 processes stop at depends on when the others saw it) finishes")):
        said = []
        sig = Signals(lambda text, **_: said.append(text), world)
        sig.step_begins(3)
        sig.stop_flag()
        sig._in_loop(signal.SIGTERM, None)
        assert expected in said[0], said
        unflagged = Signals(lambda text, **_: said.append(text), world)
        unflagged.step_begins(5)
        unflagged._in_loop(signal.SIGTERM, None)
        assert "SIGTERM: step 5 (running for" in said[1], said


def test_a_signal_after_the_last_steps_check_does_not_announce_a_step_after_it():
    # After the last step's check the run ends as planned: no step N + 1 finishes (the notice said one
    # would), at any number of processes.
    from hytrain.job.signals import Signals

    for world in (1, 2):
        said = []
        sig = Signals(lambda text, **_: said.append(text), world)
        sig.step_begins(7, last=True)
        sig.stop_flag()
        sig._in_loop(signal.SIGINT, None)
        assert "SIGINT: the last step (7) has ended; the run writes its outputs and ends" in said[0], said
        assert "step 8" not in said[0]
        before_check = Signals(lambda text, **_: said.append(text), world)
        before_check.step_begins(7, last=True)
        before_check._in_loop(signal.SIGINT, None)  # during the last step: it finishes, is saved, and stops
        assert "SIGINT: step 7 (running for" in said[1], said


def test_a_signal_during_the_end_of_run_outputs_waits_for_the_summary(tmp_path, monkeypatch, capsys, fast):
    real = plots.write_all

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while the pictures are drawn
        return real(*args, **kwargs)

    monkeypatch.setattr(plots, "write_all", interrupted)
    out = tmp_path / "run"
    assert main(["--steps", "2", "--out", str(out), *fast]) == 128 + signal.SIGINT
    said = capsys.readouterr().out
    assert "SIGINT: writing summary.json first" in said and "Traceback" not in said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and os.path.isfile(summary["loss_png"])


def test_a_second_signal_during_the_outputs_stops_at_once(tmp_path, monkeypatch, capsys, fast):
    def stuck(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(REPEAT_S + 0.2)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)

    monkeypatch.setattr(plots, "write_all", stuck)
    out = tmp_path / "run"
    t0 = time.time()
    assert main(["--steps", "2", "--out", str(out), *fast]) == 128 + signal.SIGINT
    assert time.time() - t0 < 45
    said = capsys.readouterr().out
    assert "stopped at once by a second SIGINT during the end-of-run outputs" in said, said
    assert ckpt.verify(ckpt.resolve(out, "latest"))["step"] == 2 and not (out / "hytrain.lock").exists()
