import ctypes
import os
import signal
import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # Decided at run time, not at import: collecting the tests never touches a GPU.
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    have_gpu = None
    for item in items:
        if "gpu" in item.keywords:
            if have_gpu is None:
                import hytrain

                have_gpu = hytrain.cuda_available() and torch.cuda.is_available()
            if not have_gpu:
                item.add_marker(skip_gpu)


# Processes a test leaves behind -- torchrun's workers, which run in sessions of their own, after a
# test timed out and killed their agent -- would hold GPUs and ports for the tests after it. pytest
# adopts every orphan of its descendants (a child subreaper) and kills what is left after each test.
_SUBREAPER = sys.platform == "linux" and ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in os.listdir(f"/proc/{p}/task") for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    yield
    if not _SUBREAPER:
        return
    left = [p for p in descendants(os.getpid()) if _ours(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    while True:  # reap the adopted ones (and the killed)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    assert not left, f"processes left running by this test were killed: {left}"


def _ours(pid: int) -> bool:
    """A live process of the job, torchrun or a distributed test script (not a helper that torch
    keeps for the session, such as inductor's compile workers)."""
    try:
        if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            return False
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    modules = {b"hytrain", b"hytrain.job.torchrun", b"torch.distributed.run"}
    return any(a in modules or a.endswith((b"/hytrain", b"/dist_train.py", b"/scale_bench.py", b"/capacity_bench.py"))
               for a in argv)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small plain-text corpus for the job's tests (a module's own ``corpus`` takes precedence)."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 500)
    return str(path)
