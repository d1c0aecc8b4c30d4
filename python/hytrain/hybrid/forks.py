"""HybridAdamW across ``fork()``: a child process (``os.fork``, multiprocessing's "fork" start method,
a DataLoader's workers) inherits the optimizer -- its Python objects, its native engine, and the
pinned host memory of its master weights and states, the child's copy-on-write copy.

* Before each ``os.fork()`` (``os.register_at_fork``'s ``before``), the native engine of every
  optimizer on the CPU finishes the updates in flight (``quiesce``): the child's copy of the
  memory holds no update half done. (With ``model=`` the updates outlive ``step()``.)
* In the child, the native ``UpdateEngine`` starts its worker threads and queue again at its first
  use (the parent's do not exist there: see core's update_engine.h), so an inherited optimizer whose
  parameters are on the CPU keeps working, as torch's AdamW does.
* Parameters on CUDA: CUDA cannot be used in a forked child at all. An inherited optimizer whose
  state exists there raises :data:`FORKED_CUDA` at its first use instead of waiting for copies that
  nothing will ever make, and its parts are kept alive until the child exits, so that no native
  destructor waits for the parent's copy threads either.
"""

from __future__ import annotations

import ctypes
import os
import weakref

FORKED_CUDA = ("this HybridAdamW was created in the parent of this forked process, with its state on CUDA, "
               "and CUDA cannot be used in a forked child: create the optimizer (and the model on the GPU) "
               "in the child, or start the child with the 'spawn' (or 'forkserver') start method "
               "(multiprocessing.set_start_method('spawn'); DataLoader(multiprocessing_context='spawn'))")

_launchers = weakref.WeakSet()  # every Launcher of this process with a native engine


def watch(launcher) -> None:
    """A launcher whose native engine was just made (``Launcher.start``)."""
    _launchers.add(launcher)


def check(launcher) -> None:
    """Raises RuntimeError where the launcher's state is on CUDA and was made in a parent process."""
    engine = launcher.engine
    if engine is not None and launcher.store.cuda and engine.inherited:
        raise RuntimeError(FORKED_CUDA)


def _before_fork() -> None:
    for launcher in list(_launchers):
        engine = launcher.engine
        if engine is not None and not launcher.store.cuda:
            try:
                engine.quiesce()  # (the GIL held: nothing submits meanwhile)
            except Exception:  # noqa: BLE001 -- a fork hook cannot report; the child's wait() would
                pass


def _after_fork_in_child() -> None:
    for launcher in list(_launchers):
        if launcher.engine is not None and launcher.store.cuda:
            # One reference that is never dropped: the native pipeline and copy streams are not
            # destroyed in this process (their destructors would join threads that are not here).
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(launcher))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
