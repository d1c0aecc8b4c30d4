"""The job's signals: what SIGTERM, SIGINT, SIGHUP (a scheduler's or a user's stop) and SIGUSR1 (Slurm's
early warning, ``--signal=USR1@120``) do at each stage of a run.

- Before the training loop (building the model): SIGTERM, SIGHUP and SIGINT end the run at once (:class:`Stopped`,
  exit 128 + N, the lock released); a SIGUSR1 is kept for the first step (saved there), one that came
  while the process was still importing too (``hytrain.early_signals``).
- In the training loop: the first stopping signal is acted on at the end of the step in progress, by
  every rank at the same step (saved, exit 128 + N), and says when that will be; a second one (at
  least ``REPEAT_S`` later: sooner, it is the first one delivered twice) ends the run at once (the last checkpoint stays as it was; a save it interrupts leaves only a temporary
  directory, swept by the next run). SIGUSR1 saves at the end of the step and training goes on.
- During the end-of-run outputs (the model's export, trace, pictures, ``summary.json``): the first
  stopping signal is held until they are written; a second one ends the run at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

from .. import early_signals

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A second stopping signal within this many seconds of the first is the same request delivered twice
# (to the process group and again by a launcher forwarding it, as torchrun's agent does), not a second
# request: it is ignored.
REPEAT_S = 2.0


class Stopped(BaseException):
    """A signal that ends the run now (a BaseException: no ``except Exception`` swallows it).
    ``now``: a second signal, during a step or the end-of-run outputs."""

    def __init__(self, signum, now=False, step=None):
        super().__init__(signum)
        self.signum, self.now, self.step = signum, now, step


def name(signum) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Signals:
    """One run's handlers (main thread only: elsewhere Python delivers no signals). ``say``: the
    main process's messages (a no-op on the other ranks)."""

    def __init__(self, say, world=1):
        self.say, self.world = say, world
        self.signal = None  # the stopping signal the loop acts on at the end of the step
        self.save = False  # SIGUSR1: save at the end of the step
        self.late = None  # a stopping signal held during the end-of-run outputs
        self._first_at = None  # when the first stopping signal came
        self._step, self._began, self._last_s, self._is_last = 0, None, None, False
        self._told = False  # this step's stop flag has gone to the ranks' exchange (stop_flag)

    @contextlib.contextmanager
    def _handlers(self, handler, signums):
        if threading.current_thread() is not threading.main_thread():  # (no signals are delivered there)
            yield self
            return
        old = {s: signal.signal(s, handler) for s in signums}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def outside(self):
        """Around the whole run: SIGTERM, SIGHUP and SIGINT end it now (one line, not a traceback);
        SIGUSR1 is kept for the first step (and so is one that came while the process was starting:
        ``early_signals``)."""
        self.save = early_signals.take()

        def handler(signum, _frame):
            if signum == signal.SIGUSR1:
                self.save = True
            else:
                raise Stopped(signum)

        return self._handlers(handler, (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1))

    def loop(self):
        """The training loop's handlers (see the module's docstring), installed now; returns what
        puts the ones before back."""
        handlers = self._handlers(self._in_loop, (*STOPPING, signal.SIGUSR1))
        handlers.__enter__()
        return lambda: handlers.__exit__(None, None, None)

    def step_begins(self, step, last=False) -> None:
        """Step ``step`` (1-based) starts now; the one before it, if any, has ended (``last``: it is
        the run's last step)."""
        now = time.perf_counter()
        if self._began is not None:
            self._last_s = now - self._began
        self._step, self._began, self._told, self._is_last = step, now, False, last

    def stop_flag(self) -> float:
        """What this rank tells the others at the end of the step (the signal to stop at, or 0): a
        signal that comes after this is acted on at the end of the next step."""
        self._told = True
        return float(self.signal or 0)

    def _in_loop(self, signum, _frame):
        if signum == signal.SIGUSR1:
            self.save = True
            return
        if self.signal is not None:
            if self._again():
                raise Stopped(signum, now=True, step=self._step)
            return
        self.signal, self._first_at = signum, time.monotonic()
        running = time.perf_counter() - self._began if self._began is not None else 0.0
        last = f"; the last one took {self._last_s:.0f} s" if self._last_s is not None else ""
        if self._told and self._is_last:  # no step after it: the run ends as planned
            self.say(f"\nhytrain train: {name(signum)}: the last step ({self._step}) has ended; the run writes its "
                     "outputs and ends; send it again to stop at once", flush=True)
            return
        if not self._told:
            which = f"step {self._step} (running for {running:.0f} s{last})"
        elif self.world == 1:
            which = f"step {self._step + 1} (the signal came after step {self._step} had checked for one)"
        else:  # the ranks stop at the first step any of them flagged, and another may have flagged this one
            which = (f"step {self._step} or {self._step + 1} (the signal came after this process's check of step "
                     f"{self._step}; the step the {self.world} processes stop at depends on when the others saw it)")
        self.say(f"\nhytrain train: {name(signum)}: {which} finishes, is saved, and the run stops; send it again "
                 f"to stop at once (the last checkpoint stays)", flush=True)

    def _again(self) -> bool:
        return self._first_at is not None and time.monotonic() - self._first_at >= REPEAT_S

    def held(self):
        """Around the end-of-run outputs: a first stopping signal waits for them (``late``)."""
        def handler(signum, _frame):
            if self.late is not None or self.signal is not None:
                if self._again():
                    raise Stopped(signum, now=True)
                return
            self.late, self._first_at = signum, time.monotonic()
            self.say(f"\nhytrain train: {name(signum)}: writing summary.json first, then the run stops; send it "
                     "again to stop at once", flush=True)

        return self._handlers(handler, STOPPING)
