"""One writer per run directory: ``<out>/hytrain.lock``, taken by the job's main process before it
writes anything, released when it ends.

The lock holds the holder's host, pid, start time and torchrun run id. A second run on the same
``--out`` is refused at once, naming the holder. A lock whose holder is gone -- a process on this host
that no longer exists, or an earlier attempt of the same torchrun job (a restart, possibly on another
node) -- is stale: it is taken over with a message. A lock held from another host by another job is
refused with what to do if that run is over.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from .options import ConfigError
from .ranks import LAUNCHED

NAME = "hytrain.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


class RunLock:
    def __init__(self, out: Path):
        self.path = Path(out) / NAME
        launcher = os.environ.get(LAUNCHED, "")  # the `hytrain train --nproc` process, if any
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                   "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                   "launcher": int(launcher) if launcher.isdigit() else None}
        self.held = False

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_bytes()[:4096].decode("utf-8"))
            return holder if isinstance(holder, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # damaged: stale

    def _stale(self, h: dict) -> str | None:
        """Why the holder ``h`` is gone (None: it may be alive)."""
        if not h or not isinstance(h.get("pid"), int):
            return "an unreadable lock"
        if h.get("run_id") and h.get("run_id") == self.me["run_id"]:
            return f"an earlier attempt of this job (pid {h['pid']} on {h.get('host')})"
        if h.get("host") == self.me["host"] and not _alive(h["pid"]):
            return f"a run that ended without releasing it (pid {h['pid']}, no longer running)"
        return None

    def acquire(self) -> None:
        # The lock appears whole or not at all: written to a file of our own, then linked into place
        # (link fails where the name exists), so no reader ever sees an empty lock and takes it for
        # stale. Taking over a stale lock is serialised by a second file made with O_EXCL: of
        # several runs that find the same stale lock, exactly one replaces it.
        mine = self.path.with_name(f".{NAME}.{os.getpid()}")
        mine.write_bytes(json.dumps(self.me).encode())
        try:
            for _ in range(200):
                try:
                    os.link(mine, self.path)
                    self.held = True
                    return
                except FileExistsError:
                    pass
                holder = self._holder()
                if holder is None:
                    continue  # released meanwhile
                why = self._stale(holder)
                if why is None:
                    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
                    hint = ("" if holder.get("host") == self.me["host"] else
                            f"; if that run is over, delete {self.path}")
                    who = (f"launched as pid {holder['launcher']} (its rank 0 is pid {holder['pid']})"
                           if holder.get("launcher") else f"pid {holder['pid']}")
                    raise ConfigError(f"{self.path.parent} is in use by another run ({who} on "
                                      f"{holder.get('host')}, started {when}): wait for it or use another "
                                      f"--out{hint}")
                if self._take_over(mine, holder, why):
                    self.held = True
                    return
                time.sleep(0.02)  # another run is taking it over: see who holds it then
        finally:
            mine.unlink(missing_ok=True)
        raise ConfigError(f"could not take {self.path}: another run is starting on the same --out")

    def _take_over(self, mine: Path, stale: dict, why: str) -> bool:
        """Replaces the stale lock ``stale`` with ours, unless another run is doing so or did."""
        guard = self.path.with_name(f".{NAME}.takeover")
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:  # a guard left by a run killed in the middle of a takeover
                if time.time() - guard.stat().st_mtime > 30:
                    guard.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        os.close(fd)
        try:
            if self._holder() != stale:
                return False  # taken over (or released) since we looked
            print(f"hytrain train: taking over {self.path} from {why}", file=sys.stderr, flush=True)
            os.replace(mine, self.path)
            return True
        finally:
            guard.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held and self._holder() == self.me:
            try:
                self.path.unlink()
            except OSError:
                pass
        self.held = False
