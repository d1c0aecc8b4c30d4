"""The processes of a ``--nproc`` job, as the launcher's torchrun agent and each rank see them: a
process's children (from /proc: the agent passes a scheduler's signal on to its ranks), and the
stop of a process whose parent has gone (a rank whose agent, or an agent whose launcher, was killed)."""

from __future__ import annotations

import os
import signal
import sys
import time


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc; none where it cannot be read)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(name))
    return out


def stop_when_orphaned(what: str, interval_s: float = 1.0) -> None:
    """SIGTERM to this process once its parent has gone (it was reparented): the ranks when their
    torchrun agent is killed by SIGKILL (torchrun starts each rank in a session of its own, so a kill
    of the job's process group misses them: they went on training, unseen, holding the lock and the
    GPUs), and the agent when the ``--nproc`` launcher is. The SIGTERM takes the way a scheduler's stop
    takes: the ranks finish the step together, save a checkpoint, release the lock and exit."""
    import threading

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(interval_s)
        print(f"hytrain train: {what} (pid {parent}) is gone; stopping (pid {os.getpid()})", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="hytrain-orphan-watch", daemon=True).start()
