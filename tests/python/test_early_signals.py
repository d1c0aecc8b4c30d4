"""A SIGUSR1 that reaches a job's process while it is still importing (before the job's handlers are
in) is noted and saved at the first step, instead of ending the process silently (the signal's
default action); other programs that import hytrain keep their handlers."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from hytrain import early_signals


@pytest.mark.parametrize("argv, job", [
    (["python", "-m", "hytrain", "train", "--steps", "3"], True),
    (["python", "-X", "faulthandler", "-m", "hytrain", "train"], True),
    (["/venv/bin/python", "/venv/bin/hytrain", "train", "--out", "x"], True),
    (["python", "-m", "hytrain.job.torchrun", "--nproc-per-node", "2"], True),
    (["python", "-m", "hytrain", "info"], False),
    (["/venv/bin/python", "/venv/bin/hytrain", "export", "run"], False),
    (["python", "-m", "pytest", "tests"], False),
    (["python", "train.py", "train"], False),
    (["python", "-c", "import hytrain"], False),
    (["python", "-mhytrain", "train"], True),
    (["python", "-X", "dev", "-W", "ignore", "-m", "hytrain", "train"], True),
    (["python", "-W", "ignore", "/venv/bin/hytrain", "train"], True),
    (["python", "myscript.py", "-m", "hytrain", "train"], False),
    (["python", "-c", "pass", "-m", "hytrain", "train"], False),
])
def test_only_a_jobs_processes_are_jobs(argv, job):
    assert early_signals.is_job(argv) is job


def _child(argv, body):
    code = textwrap.dedent(f"""
        import os, signal, sys
        from hytrain import early_signals
        installed = early_signals.install({argv!r})
        {body}
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)


def test_a_sigusr1_during_the_start_is_noted_not_fatal_and_taken_once():
    r = _child(["python", "-m", "hytrain", "train"], """
        os.kill(os.getpid(), signal.SIGUSR1)
        print(installed, early_signals.take(), early_signals.take())
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "False"]


def test_a_ctrl_c_while_a_job_starts_ends_it_in_one_line_and_elsewhere_pythons_traceback_stays():
    # A SIGINT before the job's handlers are in raises KeyboardInterrupt wherever the process is (an
    # import of torch, most of the time): a job's process ends as Python's does, by SIGINT, but says
    # so in one line instead of the interrupted import's traceback.
    body = """
        os.kill(os.getpid(), signal.SIGINT)
        import time
        time.sleep(30)
    """
    r = _child(["python", "-m", "hytrain", "train"], body)
    assert r.returncode == -signal.SIGINT, (r.returncode, r.stderr)
    assert r.stderr.strip() == ("hytrain train: SIGINT while starting: stopped before training began "
                                "(nothing to save)"), r.stderr
    r = _child(["python", "-m", "pytest"], body)
    assert r.returncode == -signal.SIGINT and "Traceback" in r.stderr and "KeyboardInterrupt" in r.stderr


def test_elsewhere_the_default_action_and_a_programs_own_handler_stay():
    r = _child(["python", "-m", "pytest"], "print(installed, signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL)")
    assert r.stdout.split() == ["False", "True"], r.stderr
    r = _child(["python", "-m", "pytest"], """
        mine = lambda *a: None
        signal.signal(signal.SIGUSR1, mine)
        print(early_signals.install(["python", "-m", "hytrain", "train"]), signal.getsignal(signal.SIGUSR1) is mine)
    """)
    assert r.stdout.split() == ["False", "True"], r.stderr


def test_the_launcher_passes_an_early_note_to_the_ranks_it_starts(monkeypatch):
    monkeypatch.delenv(early_signals.PASSED, raising=False)
    early_signals.take()
    os.environ.pop(early_signals.PASSED, None)
    early_signals.pass_on()  # nothing noted: nothing passed
    assert early_signals.PASSED not in os.environ
    early_signals.note()
    early_signals.pass_on()
    assert os.environ[early_signals.PASSED] == "1"
    assert early_signals.take() is True  # (a rank: read once, and gone from its environment)
    assert early_signals.PASSED not in os.environ and early_signals.take() is False


def test_the_job_saves_at_its_first_step_for_a_sigusr1_noted_while_it_started(tmp_path):
    # The job's process as it starts: the note made (as install's handler would), then the run.
    code = textwrap.dedent(f"""
        import sys
        from hytrain import early_signals
        from hytrain.__main__ import main
        early_signals.note()
        sys.exit(main(["train", "--out", {str(tmp_path / "run")!r}, "--steps", "2", "--model", "tiny",
                       "--batch-size", "2", "--seq-len", "32", "--no-progress"]))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SIGUSR1 (a scheduler's warning): saving at step 1" in r.stdout + r.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_00000001").is_dir()


def test_after_the_run_a_sigusr1_is_ignored_in_a_jobs_process_only():
    # While the interpreter exits it puts back SIGUSR1's default action, which would end a finished
    # run with status 138 during torch's teardown: a job's process ignores it once the run is over.
    r = _child(["python", "-m", "hytrain", "train"], """
        early_signals.after_run()
        os.kill(os.getpid(), signal.SIGUSR1)
        print(signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN)
    """)
    assert r.returncode == 0 and r.stdout.split() == ["True"], r.stderr
    r = _child(["python", "-m", "pytest"],
               "early_signals.after_run(); print(signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL)")
    assert r.stdout.split() == ["True"], r.stderr


def test_the_launchers_agent_keeps_a_sigusr1_for_ranks_it_has_not_started_yet():
    code = textwrap.dedent("""
        import os
        from hytrain import early_signals
        from hytrain.job import torchrun
        torchrun._pass_to_ranks(10, None)  # no rank yet (this process has no children)
        print(os.environ.get(early_signals.PASSED))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop(early_signals.PASSED, None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.stdout.split() == ["1"], r.stderr


def test_a_sigusr1_for_a_child_still_starting_waits_for_its_handler():
    # What the launcher and torchrun's agent do for the processes they start: a SIGUSR1 sent in the
    # child's first moments (before `import hytrain`) would end it; it is sent once the child catches it.
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import signal, time
        time.sleep(0.5)  # (the child still starting)
        got = []
        signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        print("noted" if got else "never came", flush=True)
    """)], stdout=subprocess.PIPE, text=True)
    early_signals.send_when_ready(child.pid, signal.SIGUSR1)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and out.split() == ["noted"]


def test_a_child_started_with_sigusr1_held_notes_it_once_its_handler_is_in():
    # The launcher starts torchrun's agent with SIGUSR1 blocked (pending, not acted on); install()
    # unblocks it once the note is in place, and one sent meanwhile is noted, not fatal.
    code = textwrap.dedent("""
        import os, signal
        os.kill(os.getpid(), signal.SIGUSR1)  # (held: blocked since before exec)
        from hytrain import early_signals
        print(early_signals.install(["python", "-m", "hytrain.job.torchrun"]), early_signals.take(),
              signal.SIGUSR1 in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1}))
    assert r.returncode == 0 and r.stdout.split() == ["True", "True", "False"], r.stderr
