"""A SIGUSR1 (a scheduler's early warning: Slurm's ``--signal=USR1@120``) that reaches a job's process
while it is still starting -- importing torch, a second or more before the job's own handlers are in --
would end it at once and silently (the signal's default action), where the job promises to save at its
first step and go on. So the job's processes (``hytrain train``, its ``--nproc`` launcher and ranks) note
the signal from the first thing ``import hytrain`` does for them (:func:`install`), and the job's
handlers take the note over (``job/signals.py``: saved at the first step; the launcher passes it on to
its ranks). A program that only imports hytrain keeps its own handlers: nothing is installed there."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

_noted = False
_installed = False  # install() put the note in place (this process is a job's)
PASSED = "HYTRAIN_USR1_BEFORE_START"  # the launcher's note to its ranks (pass_on)


def note(_signum=signal.SIGUSR1, _frame=None) -> None:
    """A SIGUSR1 came (the handler :func:`install` puts in place; the launcher's, before its ranks exist)."""
    global _noted
    _noted = True


def is_job(argv) -> bool:
    """Whether ``argv`` (the interpreter's own, ``sys.orig_argv``) starts a hytrain job process:
    ``python -m hytrain train``, the ``hytrain train`` script, or ``python -m hytrain.job.torchrun``
    (the interpreter's options before them read as the interpreter reads them)."""
    argv = list(argv)
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            module = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else arg[2:]
            rest = argv[i + 2:i + 3] if arg == "-m" else argv[i + 1:i + 2]
            return (module == "hytrain.job.torchrun"
                    or (module in ("hytrain", "hytrain.__main__") and rest == ["train"]))
        if arg in ("-X", "-W", "--check-hash-based-pycs"):
            i += 2
            continue
        if arg == "-c" or arg == "-" or not arg.startswith("-"):  # a command, stdin or a script: what runs
            return arg != "-c" and os.path.basename(arg) == "hytrain" and argv[i + 1:i + 2] == ["train"]
        i += 1
    return False


def install(argv=None) -> bool:
    """Notes SIGUSR1 from now on where this process is a job's (``argv``: default ``sys.orig_argv``)
    and nothing else handles it yet; returns whether it did."""
    argv = getattr(sys, "orig_argv", sys.argv) if argv is None else argv
    if threading.current_thread() is not threading.main_thread() or not is_job(argv):
        return False
    if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
        return False
    global _installed
    signal.signal(signal.SIGUSR1, note)
    # The launcher starts its child with SIGUSR1 blocked (held pending, not acted on) until now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _interrupted_while_starting
    _installed = True
    return True


def _interrupted_while_starting(kind, value, tb) -> None:
    """A Ctrl-C (SIGINT) that reaches a job's process before the job's own handlers are in (importing
    torch, reading the command line) ends it, as Python's does, in one line rather than a traceback
    of whatever import it interrupted: nothing has been trained, so nothing is lost. The interpreter
    still exits as a process ended by SIGINT (status 130 to a shell)."""
    if issubclass(kind, KeyboardInterrupt):
        print("hytrain train: SIGINT while starting: stopped before training began (nothing to save)",
              file=sys.stderr, flush=True)
        return
    sys.__excepthook__(kind, value, tb)


def _ready_for(pid: int, signum: int) -> bool:
    """Whether process ``pid`` would not die of ``signum`` now: it catches, blocks or ignores it (or
    /proc cannot tell)."""
    bit = 1 << (signum - 1)
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = {k: int(v, 16) for k, v in (line.split(":", 1) for line in f)
                     if k in ("SigCgt", "SigBlk", "SigIgn")}
    except (OSError, ValueError):
        return True
    return any(m & bit for m in masks.values())


def send_when_ready(pid: int, signum: int = signal.SIGUSR1, wait_s: float = 60.0) -> None:
    """``signum`` to process ``pid`` (a launcher's child), once it has its handler in place: a process
    just started dies of SIGUSR1 until ``import hytrain`` has run :func:`install` (tens of ms). Waits
    on a thread of its own where it must (every 5 ms, at most ``wait_s``)."""
    def send():
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    if _ready_for(pid, signum):
        send()
        return

    def later():
        deadline = time.monotonic() + wait_s
        while not _ready_for(pid, signum) and time.monotonic() < deadline:
            time.sleep(0.005)
        send()

    threading.Thread(target=later, name="hytrain-usr1", daemon=True).start()


def after_run() -> None:
    """The run is over (its outputs written): a SIGUSR1 from now on is ignored. While the interpreter
    exits it puts back the signal's default action, which would end a finished run with status 138
    (torch's teardown takes seconds)."""
    if _installed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def take() -> bool:
    """Whether a SIGUSR1 was noted since the last call, or passed on by the launcher that started this
    process (:func:`pass_on`); the note is cleared."""
    global _noted
    passed = os.environ.pop(PASSED, None) == "1"  # (read once: not handed on to this process's own children)
    noted, _noted = _noted or passed, False
    return noted


def pass_on() -> None:
    """The ``--nproc`` launcher, before it starts its ranks: a SIGUSR1 it noted while starting goes to
    them (in their environment: they do not exist yet)."""
    if take():
        os.environ[PASSED] = "1"
