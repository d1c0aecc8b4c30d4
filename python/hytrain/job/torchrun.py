"""torchrun as ``hytrain train --nproc`` starts it: ``python -m hytrain.job.torchrun ARGS`` takes
torchrun's arguments, runs its agent, and when the ranks fail prints the first failure once, in one
line (a traceback only for an unexpected error), instead of every rank's message followed by
torchrun's ``ChildFailedError`` report. Its exit status is the failed rank's (2 for an error a user
caused, 1 otherwise, 128 + N for a rank killed by signal N)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from .. import early_signals
from .options import to_stderr
from .processes import children, stop_when_orphaned


def _report(failure) -> dict:
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    return data.get("hytrain") if isinstance(data.get("hytrain"), dict) else {}


def first_failure(failures: dict) -> tuple[int, object]:
    """The failure to show: a user's error as the lowest rank words it (every rank usually meets the
    same one, and rank 0 knows the most), else the earliest failure a rank reported itself that is not
    a lost peer (a rank that saw another die reports later, as a peer failure), else a rank killed by
    a signal -- one not killed by SIGTERM first, which is how torchrun stops the others once one has
    failed (their timestamps can tie with it, or come first) -- else the earliest of all."""
    def when(item):
        rank, f = item
        return (_report(f).get("time", float(f.timestamp)), rank)

    def stopped_last(item):
        return (item[1].exitcode == -signal.SIGTERM, *when(item))

    user = [(r, f) for r, f in failures.items() if _report(f).get("kind") == "user"]
    if user:
        return min(user, key=lambda item: item[0])
    own = [(r, f) for r, f in failures.items()
           if _report(f) and _report(f).get("kind") not in ("peer", "hung", "stopped")]
    killed = [(r, f) for r, f in failures.items() if f.exitcode < 0]
    if own:
        return min(own, key=when)
    if killed:
        return min(killed, key=stopped_last)
    return min(failures.items(), key=when)
    raise ValueError("no failure")


def describe(rank: int, failure) -> tuple[str, int]:
    """The line (or traceback) to print and the exit status for one rank's failure."""
    rep = _report(failure)
    if rep:
        text = rep.get("line", "")
        if rep.get("kind") == "bug" and rep.get("callstack"):
            text = f"hytrain train: rank {rank} failed:\n{rep['callstack'].rstrip()}"
        return text, int(failure.exitcode)
    if failure.exitcode < 0:
        return (f"hytrain train: error: rank {rank} (pid {failure.pid}) was killed by signal "
                f"{-failure.exitcode} ({failure.signal_name()})"), 128 - failure.exitcode
    return (f"hytrain train: error: rank {rank} (pid {failure.pid}) exited with status {failure.exitcode} "
            "without a message"), int(failure.exitcode)


def _pass_to_ranks(signum, _frame):
    ranks = children(os.getpid())
    if not ranks:  # not started yet: they read it from the environment they start with
        early_signals.note(signum)
        early_signals.pass_on()
    for pid in ranks:
        early_signals.send_when_ready(pid, signum)  # (a rank just started would die of it)


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent's own report of each failed rank: replaced by the one line below.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    stop_when_orphaned("the hytrain train --nproc launcher")  # torchrun passes SIGTERM on to the ranks
    # SIGUSR1 (a scheduler's warning, to the launcher or to every process): the agent passes it to its
    # ranks, which save at the end of the step and go on; torch's agent would die of it (default action).
    signal.signal(signal.SIGUSR1, _pass_to_ranks)
    early_signals.pass_on()  # one that came while this process was starting: to the ranks it starts
    try:
        run(parse_args(argv))
        early_signals.after_run()
    except ChildFailedError as e:
        # Every rank stopped by a signal after the checkpoint they saved together (rank 0 said so), or
        # was stopped by the agent once a peer had (a rank's "stopped" comes after the collective save):
        # a clean stop, not an error.
        stopped = [f for f in e.failures.values() if _report(f).get("kind") == "stopped"]
        if stopped and all(_report(f).get("kind") == "stopped" or f.exitcode == -signal.SIGTERM
                           for f in e.failures.values()):
            return int(stopped[0].exitcode)
        hung = [(r, f) for r, f in sorted(e.failures.items()) if _report(f).get("kind") == "hung"]
        if hung:  # a rank timed out waiting: the ranks the agent then had to kill are the hung ones
            gone = [r for r, f in sorted(e.failures.items()) if not _report(f) and f.exitcode < 0]
            who = f"rank(s) {', '.join(map(str, gone))} hung, " if gone else ""
            to_stderr(f"hytrain train: error: {who}{_report(hung[0][1]).get('line', '').split('error: ', 1)[-1]}")
            return 124
        rank, failure = first_failure(e.failures)
        text, code = describe(rank, failure)
        others = len(e.failures) - 1
        if others and _report(failure).get("kind") != "user":
            text += f" ({others} other rank(s) stopped with it)"
        to_stderr(text)
        return code if 0 < code < 256 else 1
    except SignalException as e:  # the launcher forwarded SIGTERM/SIGINT and the ranks were stopped
        return 128 + int(e.sigval)
    return 0


def error_file_payload(line: str, kind: str, callstack: str, when: float) -> str:
    """What a rank writes to torchrun's error file: torchrun's own fields (so that its report and
    ``first failure`` still work) and hytrain's (the line, its kind: user, peer or bug)."""
    return json.dumps({"message": {"message": line, "extraInfo": {"py_callstack": callstack or line,
                                                                  "timestamp": str(int(when))}},
                       "hytrain": {"line": line, "kind": kind, "callstack": callstack, "time": when}})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
