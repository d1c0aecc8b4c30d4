"""`hytrain train` on several processes (``--nproc``, which starts torchrun; gloo on the CPU): the
same losses as one process on the same global batch, rank 0's metrics with every rank's k, GPU wait
share and step time, sharded checkpoints resumed bit for bit on 2 processes and correctly on 1, a
single-process checkpoint resumed on 2, a
worker killed mid-run restarted by torchrun from the last checkpoint with the same losses, and the
launcher's options checked before anything starts."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hytrain import checkpoint as ckpt
from hytrain.job.options import ConfigError
from hytrain.job.ranks import resolve_nproc, torchrun_command
from conftest import descendants as _descendants
from test_distributed import _env

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
              pytest.mark.timeout(600)]  # each process started has its own, tighter limit

FAST = ["--batch-size", "4", "--seq-len", "32", "--no-progress", "--device", "cpu", "--workers", "1",
        "--eval-batches", "2"]


@pytest.fixture(scope="module")
def fast(corpus):
    """FAST on a small text file: the ranks read it at once instead of walking the standard library."""
    return [*FAST, "--data", corpus]


def job(*args, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "hytrain", "train", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env())
    return proc


def succeeded(proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def ok(*args, **kw):
    return succeeded(job(*args, **kw))


def metrics(out):
    return [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]


def losses(out):
    return {r["step"]: r["loss"] for r in metrics(out)}


def together(logs: Path, **runs) -> dict:
    """``hytrain train ARGS`` for each ``name=ARGS``, all started at once (a short run here spends most
    of its time starting and ending processes, which overlap well), waited for: name -> the completed
    process (stdout, stderr and exit status, for the caller to check)."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    try:
        for name, args in runs.items():
            with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
                procs[name] = subprocess.Popen([sys.executable, "-m", "hytrain", "train", *args], stdout=out,
                                               stderr=err, text=True, env=_env())
        for p in procs.values():
            p.wait(timeout=300)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return {name: subprocess.CompletedProcess(p.args, p.returncode, (logs / f"{name}.out").read_text(),
                                              (logs / f"{name}.err").read_text()) for name, p in procs.items()}


@pytest.fixture(scope="module")
def shared(tmp_path_factory, fast):
    """The runs that several tests read: one process and two on the same global batch (6 steps,
    validation and a checkpoint at 3 and 6), and one process with 8-bit states (checkpoints at 3 and 6).
    name -> (its output directory, its completed process); each test checks the runs it reads."""
    root = tmp_path_factory.mktemp("shared")
    runs = {
        "one": ["--steps", "6", "--eval-every", "3", "--save-every", "3", "--keep", "3", "--no-export"],
        "two": ["--steps", "6", "--eval-every", "3", "--save-every", "3", "--keep", "3", "--nproc", "2"],
        "one_8bit": ["--steps", "6", "--save-every", "3", "--keep", "3", "--eval-every", "0", "--no-export",
                     "--state-format", "8bit"],
    }
    done = together(root / "logs", **{name: [*args, "--out", str(root / name), *fast] for name, args in runs.items()})
    return {name: (root / name, proc) for name, proc in done.items()}


def shared_run(shared, name) -> Path:
    """The output directory of one of the shared runs, which must have succeeded."""
    out, proc = shared[name]
    succeeded(proc)
    return out


def test_two_processes_match_one_on_the_same_global_batch(shared):
    one, two = shared_run(shared, "one"), shared_run(shared, "two")
    a, b = metrics(one), metrics(two)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]),
                               rtol=1e-5, atol=1e-5)
    assert len([r for r in b if "val_loss" in r]) == 2
    torch.testing.assert_close(torch.tensor([r["val_loss"] for r in b if "val_loss" in r]),
                               torch.tensor([r["val_loss"] for r in a if "val_loss" in r]), rtol=1e-5, atol=1e-5)
    assert all(len(r["k_ranks"]) == 2 and len(r["step_s_ranks"]) == 2 and len(r["gpu_wait_frac_ranks"]) == 2
               for r in b)
    assert "k_ranks" not in a[0]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 6
    assert (two / "trace.json").is_file() and (two / "trace.rank1.json").is_file()


@pytest.fixture(scope="module")
def resumed_on_two(shared, tmp_path_factory, fast):
    """Each single-process run of ``shared`` resumed from its checkpoint at step 3 on two processes
    (both at once): format -> (the single-process run, the resumed one, its completed process)."""
    root = tmp_path_factory.mktemp("resumed")
    whole = {"fp32": shared["one"][0], "8bit": shared["one_8bit"][0]}
    done = together(root / "logs", **{
        fmt: ["--steps", "6", "--save-every", "3", "--eval-every", "0", "--out", str(root / fmt), "--resume",
              str(w / "checkpoints" / "step_00000003"), "--nproc", "2", "--no-export", *fast]
        for fmt, w in whole.items()})
    return {fmt: (whole[fmt], root / fmt, done[fmt]) for fmt in whole}


@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
def test_a_single_process_checkpoint_resumes_on_two_processes(fmt, shared, resumed_on_two):
    # Resharded on load (dist_checkpoint.load_single): the same losses as the single process going on,
    # as two processes match one on the same global batch; 8-bit m and v are quantised afresh over the
    # new shards' blocks, so close, not equal. The LR schedule goes on; the next checkpoints are sharded.
    whole = shared_run(shared, "one" if fmt == "fp32" else "one_8bit")
    ck = whole / "checkpoints" / "step_00000003"
    _, two, proc = resumed_on_two[fmt]
    succeeded(proc)
    assert "resumed from" in proc.stdout + proc.stderr
    want, got = losses(whole), losses(two)
    assert sorted(got) == [4, 5, 6]
    torch.testing.assert_close(torch.tensor([got[s] for s in got]), torch.tensor([want[s] for s in got]),
                               rtol=1e-5 if fmt == "fp32" else 2e-3, atol=1e-5)
    lr = {r["step"]: r["lr"] for r in metrics(whole)}
    assert {r["step"]: r["lr"] for r in metrics(two)} == {s: lr[s] for s in range(4, 7)}
    meta = json.loads((two / "checkpoints" / "step_00000006" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["state_format"] == fmt
    assert not list(ck.parent.glob(".*resharded*")), "the resharded copy is removed after the load"


def test_sharded_checkpoints_resume_on_two_processes_and_on_one(tmp_path, shared, fast):
    whole = shared_run(shared, "two")
    ck = whole / "checkpoints" / "step_00000003"
    assert json.loads((ck / "meta.json").read_text())["world_size"] == 2
    # `latest` names a damaged checkpoint (a flipped byte in its meta.json): the ranks fall back to the
    # one before it, said once (not by every rank), and train on as the run did. (A copy of the run,
    # resumed at the same time as the run's own checkpoint at step 3 is resumed into another directory.)
    damaged = tmp_path / "damaged"
    shutil.copytree(whole, damaged)
    meta = damaged / "checkpoints" / "step_00000006" / "meta.json"
    raw = bytearray(meta.read_bytes())
    raw[raw.index(b'"step"') + 2] ^= 1
    meta.write_bytes(bytes(raw))
    again, single = tmp_path / "again", tmp_path / "single"
    done = together(tmp_path / "logs", again=["--steps", "6", "--eval-every", "0", "--out", str(again), "--resume",
                                              str(ck), "--nproc", "2", "--no-export", *fast],
                    damaged=["--steps", "8", "--eval-every", "0", "--out", str(damaged), "--resume", "latest",
                             "--nproc", "2", "--no-export", *fast])
    succeeded(done["again"])
    ok("--steps", "6", "--eval-every", "0", "--out", str(single), "--resume", str(ck), "--no-export", *fast)
    want = losses(whole)
    assert losses(again) == {s: want[s] for s in range(4, 7)}  # same world size: bit for bit
    got = losses(single)
    assert sorted(got) == [4, 5, 6]
    torch.testing.assert_close(torch.tensor([got[s] for s in got]), torch.tensor([want[s] for s in got]),
                               rtol=1e-5, atol=1e-5)
    # The LR schedule went on from the checkpoint too.
    lr = {r["step"]: r["lr"] for r in metrics(whole)}
    assert {r["step"]: r["lr"] for r in metrics(again)} == {s: lr[s] for s in range(4, 7)}
    proc = succeeded(done["damaged"])
    assert proc.stderr.count("step_00000006, which") == 1 and "resuming from step_00000003" in proc.stderr
    assert "is damaged (meta.json was altered: its content does not match its checksum)" in proc.stderr
    assert {s: losses(damaged)[s] for s in range(4, 7)} == {s: want[s] for s in range(4, 7)}


def _is_worker(pid):
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return (b"hytrain" in cmd and b"torch.distributed.run" not in cmd and b"hytrain.job.torchrun" not in cmd
            and b"--nproc" not in cmd)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _signal_pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` waits to be delivered to ``pid`` (a stopped process keeps it pending)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return True  # gone
    masks = [int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith(("SigPnd:", "ShdPnd:"))]
    return any(m >> (signum - 1) & 1 for m in masks)


def _kill_a_worker_past_a_checkpoint(launchers, out, deadline_s=240, survivor_hangs=False):
    """SIGKILL to one worker of the last launcher once the run is a few steps past a checkpoint:
    (the worker's pid, the step saved, metrics.jsonl as it was then). ``survivor_hangs``: the other
    worker is stopped first and resumed only once its agent has sent it SIGTERM, as an NCCL rank
    stuck in a collective with the dead one is: its agent then restarts it for the other agent's
    sake (a membership change, which torchrun does not count as a restart), not for its own."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and all(p.poll() is None for p in launchers):
        latest = out / "checkpoints" / "latest"
        if latest.is_file():
            saved = int(latest.read_text().strip().split("_")[1])
            done = len((out / "metrics.jsonl").read_text().splitlines())
            workers = [[p for p in _descendants(a.pid) if _is_worker(p)] for a in launchers]
            if done >= saved + 3 and sum(map(len, workers)) == 2:  # a few steps past the checkpoint
                victim = max(workers[-1])
                survivor = next(p for ws in workers for p in ws if p != victim)
                if survivor_hangs:
                    os.kill(survivor, signal.SIGSTOP)
                before = (out / "metrics.jsonl").read_text()
                os.kill(victim, signal.SIGKILL)
                if survivor_hangs:
                    while not _signal_pending(survivor, signal.SIGTERM) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    os.kill(survivor, signal.SIGCONT)
                return victim, saved, before
        time.sleep(0.05)
    raise AssertionError("the run ended before a worker could be killed")


def _assert_rewound(out, steps, saved, before):
    """The restart went back to the checkpoint: metrics.jsonl was rewound to it, so every step is
    there once, and the steps run again log the losses they had before the kill, bit for bit."""
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    redone = 0
    for line in before.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # cut short by the kill
        if r["step"] > saved:
            assert r["loss"] == rows[r["step"] - 1]["loss"], r["step"]
            redone += 1
    assert redone >= 3
    assert json.loads((out / "summary.json").read_text())["steps"] == steps


# Runs in which a worker is killed: the first checkpoint comes after 10 steps, and some 50 steps more
# (a few seconds, and dozens of the test's looks) leave ample time to see it and kill a worker before
# the run would end.
KILL_STEPS, KILL_SAVE_EVERY = 60, 10


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_a_killed_worker_is_restarted_from_the_last_checkpoint(tmp_path, fast):
    out = tmp_path / "run"
    steps = KILL_STEPS
    proc = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--steps", str(steps), "--save-every",
                             str(KILL_SAVE_EVERY), "--eval-every", "0", "--out", str(out), "--nproc", "2",
                             "--max-restarts", "1", "--no-export", *fast],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _, saved, before = _kill_a_worker_past_a_checkpoint([proc], out)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-8000:]
    assert "resumed from" in stdout
    _assert_rewound(out, steps, saved, before)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
@pytest.mark.parametrize("target", ["group", "launcher"])
def test_a_sigkill_to_the_job_stops_the_ranks_too(tmp_path, target, fast):
    """kill -9 of the launcher's process group (the launcher and torchrun's agent; torchrun starts the
    ranks in sessions of their own): the ranks see their agent gone; of the launcher alone: the agent
    sees it gone and passes SIGTERM on. Either way the ranks finish the step, save a checkpoint,
    release the lock and exit, instead of training on unseen."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--nproc", "2", "--steps", "100000",
                             "--save-every", "1000", "--eval-every", "0", "--out", str(out), *fast],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    try:
        deadline, workers = time.monotonic() + 240, []
        while time.monotonic() < deadline and proc.poll() is None:
            m = out / "metrics.jsonl"
            workers = sorted(p for p in _descendants(proc.pid) if _is_worker(p))
            if m.exists() and len(m.read_text().splitlines()) >= 3 and len(workers) == 2:
                break
            time.sleep(0.1)
        assert len(workers) == 2, "the run ended before it could be killed"
        holder = json.loads((out / "hytrain.lock").read_text())  # names the launcher, which an operator stops
        assert holder["launcher"] == proc.pid and holder["pid"] in workers
        (os.killpg if target == "group" else os.kill)(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)  # the pipes close when the last rank has exited
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in workers:
            if os.path.exists(f"/proc/{w}") and _is_worker(w):
                os.kill(w, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{w}") and _is_worker(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}") and _is_worker(w)], stderr[-3000:]
    gone = "the torchrun agent (pid" if target == "group" else "the hytrain train --nproc launcher (pid"
    # (group: each rank's watcher looks once a second; a rank may stop with its peer, at the step the
    # peer's stop reached it, before its own watcher has looked: one line or two)
    assert stderr.count(gone) in ((1, 2) if target == "group" else (1,)), stderr[-3000:]
    assert not (out / "hytrain.lock").exists()
    saved = ckpt.resolve(out, "latest")
    assert ckpt.verify(saved)["step"] == len(metrics(out))  # the checkpoint of the step the ranks stopped after


def _two_agents(args, envs=(None, None), during=None, timeout=300):
    """Two torchrun agents on this host as two nodes of one process each (c10d rendezvous on a free
    local port) running ``hytrain train ARGS``; ``during(agents)`` while they run; both must exit 0.
    ``envs``: each agent's extra environment. (Their stdout and stderr, what ``during`` returned.)"""
    cmd = [sys.executable, "-m", "hytrain", "train", *args, "--nproc", "1", "--nnodes", "2",
           "--rdzv-endpoint", f"localhost:{_free_port()}", "--rdzv-id", "two-agents"]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**_env(), **(extra or {})}) for extra in envs]
    try:
        got = during(agents) if during else None
        outs = [a.communicate(timeout=timeout) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert all(a.returncode == 0 for a in agents), "\n".join(o[1][-3000:] for o in outs)
    return outs, got


def two_agents_one_worker_killed(tmp_path, device_args, steps=KILL_STEPS, save_every=KILL_SAVE_EVERY,
                                 envs=(None, None), survivor_hangs=False):
    """Two agents (``_two_agents``, --max-restarts 1); one worker is killed a few steps past a
    checkpoint: both agents restart their workers in a new rendezvous round, which resumes from the
    last checkpoint, and the run ends with every step logged once and the steps run again bit for
    bit as before (on GPUs ``envs`` gives each agent its CUDA_VISIBLE_DEVICES). ``survivor_hangs``:
    see ``_kill_a_worker_past_a_checkpoint``."""
    out = tmp_path / "agents"
    args = ["--steps", str(steps), "--save-every", str(save_every), "--eval-every", "0", "--out", str(out),
            "--max-restarts", "1", "--timeout", "60", *device_args]

    def during(agents):
        killed = _kill_a_worker_past_a_checkpoint(agents, out, survivor_hangs=survivor_hangs)
        return killed, _restarted_workers(agents, killed[0])

    outs, ((_, saved, before), restarted) = _two_agents(args, envs, during)
    assert "resumed from" in "".join(o[0] for o in outs)
    _assert_rewound(out, steps, saved, before)
    # One new worker per agent, met at the first try: no round lost to a timeout.
    assert sorted(a for a, _ in restarted.values()) == [0, 1], restarted
    if survivor_hangs:  # the case set up: only the killed worker's agent counted a restart
        assert sorted(c for _, c in restarted.values()) == ["0", "1"], restarted


def _restarted_workers(agents, victim) -> dict:
    """The workers the agents start after the kill, until they exit: pid -> (agent, the worker's
    TORCHELASTIC_RESTART_COUNT)."""
    first = {p for a in agents for p in _descendants(a.pid) if _is_worker(p)} | {victim}
    seen = {}
    while any(a.poll() is None for a in agents):
        for i, a in enumerate(agents):
            for p in _descendants(a.pid):
                if p in first or p in seen or not _is_worker(p):
                    continue
                try:
                    env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
                except OSError:
                    continue
                count = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"TORCHELASTIC_RESTART_COUNT=")]
                seen[p] = (i, count[0] if count else None)
        time.sleep(0.1)
    return seen


_SHORT_AGENT_WAIT = """
import sys
if "hytrain.job.torchrun" in getattr(sys, "orig_argv", []):  # torchrun's agent only
    from torch.distributed.elastic.multiprocessing import api
    _close = api.PContext.close
    def _shorter(self, death_sig=None, timeout=30):
        return _close(self, death_sig, min(timeout, 3))
    api.PContext.close = _shorter
"""


def _short_agent_wait(tmp_path) -> dict:
    """The environment for a job whose torchrun agent, stopping its workers, sends SIGKILL to those
    still there 3 s after its SIGTERM instead of torch's 30 s (the same sequence, sooner): a stopped
    or hung rank, whose SIGTERM stays pending or unheard, is then gone in 3 s."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SHORT_AGENT_WAIT)
    return {"PYTHONPATH": str(site) + os.pathsep + _env().get("PYTHONPATH", "")}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
@pytest.mark.parametrize("survivor", ["fails", "hangs"])
def test_two_agents_restart_a_killed_worker_from_the_last_checkpoint(tmp_path, survivor, fast):
    # "hangs": the other worker neither fails nor exits when its peer dies (an NCCL rank waits in its
    # collective), so only the killed worker's agent counts a restart; the other agent restarts its
    # worker for the membership change. Both new workers must still meet and resume. (The survivor
    # resumed after its agent's SIGTERM now and then stays blocked until the SIGKILL that follows.)
    env = _short_agent_wait(tmp_path)
    two_agents_one_worker_killed(tmp_path, [*fast, "--no-export"], envs=(env, env),
                                 survivor_hangs=survivor == "hangs")


def test_launcher_options(tmp_path, capsys):
    import argparse

    from hytrain.job.options import add_arguments, resolve_options

    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--nproc", "2", "--steps", "3", "--max-restarts=2", "--out", "x", "--rdzv-id", "a", "--device", "cpu"]
    cmd = torchrun_command(resolve_options(p, argv), argv, resolve_nproc("2", "cpu"))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--max-restarts") + 1] == "2"
    assert cmd[cmd.index("-m", 3):] == ["-m", "hytrain", "train", "--steps", "3", "--out", "x", "--device", "cpu"]
    # One node: each launch has a run id of its own, so that the run lock takes another launch on the
    # same --out for another job (refused), and only torchrun's restarts of this one for itself.
    again = torchrun_command(resolve_options(p, argv), argv, 2)
    ids = [c[c.index("--rdzv-id") + 1] for c in (cmd, again)]
    assert ids[0] != ids[1] and "hytrain" not in ids
    multi = ["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--device", "cpu"]
    cmd = torchrun_command(resolve_options(p, multi), multi, 2)
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "node0:29500" and cmd[cmd.index("--nnodes") + 1] == "2"
    with pytest.raises(ConfigError, match="rdzv-endpoint"):
        bad = ["--nproc", "2", "--nnodes", "2", "--device", "cpu"]
        torchrun_command(resolve_options(p, bad), bad, 2)
    with pytest.raises(ConfigError, match="--nproc"):
        resolve_nproc("0", "cpu")
    assert resolve_nproc("auto", "cpu") == 1
    from hytrain.job import main

    # Refused by the launcher itself, before torchrun starts (in this process: nothing is started).
    capsys.readouterr()
    assert main(["--nproc", "3", "--batch-size", "4", "--out", str(tmp_path / "r"), "--device", "cpu"]) == 2
    assert "multiple of the number of processes (3)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_numa_placement_of_ranks():
    from hytrain.distributed import parse_cpulist, rank_cpus

    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    nodes = {0: list(range(0, 8)), 1: list(range(8, 16))}
    every = set(range(16))
    # GPUs 0, 1 on node 0 and 2, 3 on node 1: each rank gets half of its GPU's node.
    got = [rank_cpus(r, 4, nodes, every, [0, 0, 1, 1]) for r in range(4)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    # GPU nodes unknown: ranks are spread over the nodes in order.
    assert [rank_cpus(r, 2, nodes, every, [None, None]) for r in range(2)] == [nodes[0], nodes[1]]
    # Only CPUs the process may use; one node (or one usable node): everything allowed, unchanged.
    assert rank_cpus(0, 2, nodes, set(range(2, 16)), [0, 1]) == list(range(2, 8))
    assert rank_cpus(1, 2, {0: list(range(16))}, every, [0, 0]) == sorted(every)
    assert rank_cpus(0, 2, nodes, set(range(8)), [1, 1]) == sorted(range(8))


def test_two_agents_rendezvous_as_two_nodes(tmp_path, shared, fast):
    # Two torchrun agents on this host, as two nodes of one process each (--nnodes 2, c10d rendezvous
    # on a local port): one job of world size 2, the same training as one process (the shared run).
    one, two = shared_run(shared, "one"), tmp_path / "two"
    _two_agents(["--steps", "6", "--eval-every", "3", "--out", str(two), *fast], timeout=240)
    b = metrics(two)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6] and all(len(r["k_ranks"]) == 2 for r in b)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in metrics(one)]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_sigterm_to_the_launcher_stops_every_rank_after_the_same_step(tmp_path, fast):
    """A scheduler that signals only the launcher: torchrun and every rank hear it, every rank stops
    after the same step and saves, nothing is left running, the exit status says the run did not
    finish, and --resume latest continues it."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--nproc", "2", "--steps", "100000",
                             "--eval-every", "0", "--out", str(out), *fast], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            m = out / "metrics.jsonl"
            if m.exists() and len(m.read_text().splitlines()) >= 2:
                break
            time.sleep(0.1)
        family = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stdout[-3000:] + stderr[-6000:]
    assert "stopped by signal" in stdout
    time.sleep(0.5)
    assert not [p for p in family if os.path.exists(f"/proc/{p}") and _is_worker(p)]  # no orphans
    last = metrics(out)[-1]["step"]
    assert int((out / "checkpoints" / "latest").read_text().split("_")[1]) == last
    more = ok("--nproc", "2", "--steps", str(last + 2), "--eval-every", "0", "--out", str(out), "--resume",
              "latest", "--no-export", *fast)
    assert f"at step {last}" in more.stdout


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
@pytest.mark.parametrize("to", ["launcher", "every_process"])
def test_sigusr1_saves_and_goes_on_then_sighup_saves_and_stops(tmp_path, to, fast):
    """Slurm's early warning (``--signal=USR1@120``) to the launcher or to every process of the job:
    every rank saves at the end of the same step and training goes on; a hang-up then stops the run
    as SIGTERM does (exit 128 + SIGHUP), saved."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--nproc", "2", "--steps", "100000",
                             "--eval-every", "0", "--out", str(out), *fast], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())

    def send(signum):
        targets = [proc.pid] if to == "launcher" else [proc.pid, *_descendants(proc.pid)]
        for pid in targets:
            try:
                os.kill(pid, signum)
            except OSError:
                pass

    def steps_done():
        m = out / "metrics.jsonl"
        return len(m.read_text().splitlines()) if m.exists() else 0

    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and steps_done() < 2:
            time.sleep(0.1)
        send(signal.SIGUSR1)
        while time.monotonic() < deadline and proc.poll() is None and not (out / "checkpoints" / "latest").exists():
            time.sleep(0.1)
        saved = int((out / "checkpoints" / "latest").read_text().split("_")[1])
        at = steps_done()
        while time.monotonic() < deadline and proc.poll() is None and steps_done() < at + 2:
            time.sleep(0.1)
        assert proc.poll() is None and steps_done() >= at + 2  # still training
        send(signal.SIGHUP)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGHUP, stdout[-3000:] + stderr[-6000:]
    # The signal named is the one sent (not the SIGTERM a launcher may pass on after it), as is the status.
    assert "SIGUSR1" in stdout and f"stopped by signal {int(signal.SIGHUP)} (SIGHUP) after step" in stdout, stdout[-2000:]
    assert f"exit status {128 + signal.SIGHUP}" in stdout
    last = metrics(out)[-1]["step"]
    assert saved < last and int((out / "checkpoints" / "latest").read_text().split("_")[1]) == last


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_sigterm_to_one_rank_is_a_clean_stop_not_a_failure(tmp_path, fast):
    """A signal that reaches one rank only: every rank saves after the same step and stops, and the
    launcher says no rank failed (exit 128 + N, no error line)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--nproc", "2", "--steps", "100000",
                             "--eval-every", "0", "--out", str(out), *fast], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            m = out / "metrics.jsonl"
            if m.exists() and len(m.read_text().splitlines()) >= 2:
                break
            time.sleep(0.1)
        rank1 = [p for p in _descendants(proc.pid) if _is_worker(p) and _rank_of(p) == "1"]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stdout[-3000:] + stderr[-6000:]
    assert "error" not in stderr.lower(), stderr[-3000:]
    last = metrics(out)[-1]["step"]
    assert int((out / "checkpoints" / "latest").read_text().split("_")[1]) == last


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_a_hung_rank_is_named_as_such(tmp_path, fast):
    """A rank that stops answering (SIGSTOP: alive, not dying) is reported as hung past --timeout, by
    the rank that waited for it, in one line with its own exit status (124), not as a rank killed by
    the agent's SIGKILL afterwards."""
    out = tmp_path / "run"
    # (The agent's SIGTERM to the stopped rank stays pending; its SIGKILL comes after the shorter wait.)
    env = {**_env(), **_short_agent_wait(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--nproc", "2", "--steps", "100000",
                             "--eval-every", "0", "--timeout", "5", "--out", str(out), *fast],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            m = out / "metrics.jsonl"
            if m.exists() and len(m.read_text().splitlines()) >= 2:
                break
            time.sleep(0.1)
        rank1 = [p for p in _descendants(proc.pid) if _is_worker(p) and _rank_of(p) == "1"]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGSTOP)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 124, stdout[-3000:] + stderr[-6000:]
    lines = [ln for ln in stderr.splitlines() if "error" in ln]
    assert len(lines) == 1 and "rank(s) 1 hung" in lines[0] and "waited past --timeout" in lines[0], stderr
    assert re.search(r"step \d+", lines[0]) and "SIGKILL" not in stderr


def _rank_of(pid):
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return item[5:].decode()
    return None


def _one_error_line(stderr: str, *words) -> str:
    """The launcher's stderr holds exactly one error line (no rank's traceback, no torchrun report)."""
    lines = [ln for ln in stderr.splitlines() if "error" in ln.lower() or "Traceback" in ln]
    assert len(lines) == 1 and "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr[-6000:]
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def test_an_error_every_rank_hits_is_shown_once_without_torchrun_report(tmp_path, fast):
    proc = job("--nproc", "2", "--steps", "2", "--out", str(tmp_path / "x"), "--resume", str(tmp_path / "none"), *fast)
    assert proc.returncode == 2, proc.stderr[-4000:]
    _one_error_line(proc.stderr, "hytrain train: error:", "does not exist")
    assert "OMP_NUM_THREADS" not in proc.stderr


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_a_rank_killed_without_restarts_is_named_once_and_the_others_stop(tmp_path, fast):
    """kill -9 of one rank: the launcher names that rank and its signal in one line (not the peer's
    gloo error, not torchrun's report), exits 128 + 9, and nothing is left running."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--nproc", "2", "--steps", "100000",
                             "--eval-every", "0", "--out", str(out), *fast], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline, victim = time.monotonic() + 240, None
        while time.monotonic() < deadline and proc.poll() is None and victim is None:
            m = out / "metrics.jsonl"
            workers = sorted(p for p in _descendants(proc.pid) if _is_worker(p))
            if m.exists() and len(m.read_text().splitlines()) >= 2 and len(workers) == 2:
                victim = workers[-1]
                os.kill(victim, signal.SIGKILL)
            time.sleep(0.1)
        family = _descendants(proc.pid)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert victim is not None
    assert proc.returncode == 128 + signal.SIGKILL, stderr[-4000:]
    line = _one_error_line(stderr, f"(pid {victim}) was killed by signal 9 (SIGKILL)")
    assert "Connection" not in stderr, line
    time.sleep(0.5)
    assert not [p for p in family if os.path.exists(f"/proc/{p}") and _is_worker(p)]


def test_the_failure_shown_is_the_killed_rank_not_one_torchrun_stopped_after_it():
    """kill -9 of rank 1: torchrun then stops rank 0 with SIGTERM, and the two failures' timestamps can
    tie (or rank 0's come first). The one shown is the rank the signal came from outside for; where
    every rank died of SIGTERM, the earliest; a rank's own report before any signal."""
    import types

    from hytrain.job.torchrun import describe, first_failure

    def failure(sig=None, at=100.0, report=None, pid=1000):
        return types.SimpleNamespace(exitcode=-sig if sig else 1, timestamp=at, pid=pid,
                                     error_file_data={"hytrain": report} if report else {},
                                     signal_name=lambda: signal.Signals(sig).name if sig else "")
    for at0 in (100.0, 99.0):
        rank, f = first_failure({0: failure(signal.SIGTERM, at0, pid=10), 1: failure(signal.SIGKILL, 100.0, pid=11)})
        assert rank == 1 and describe(rank, f) == (
            "hytrain train: error: rank 1 (pid 11) was killed by signal 9 (SIGKILL)", 128 + 9)
    assert first_failure({0: failure(signal.SIGTERM, 101.0), 1: failure(signal.SIGTERM, 100.0)})[0] == 1
    own = {"kind": "bug", "line": "hytrain train: error: boom", "time": 100.5}
    assert first_failure({0: failure(report=own), 1: failure(signal.SIGKILL, 100.0)})[0] == 0


def test_a_lost_peer_in_a_collective_of_torch_is_a_peer_failure():
    from hytrain.job.ranks import PeerFailure, as_peer_failure

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:51858. This is typically caused by a remote worker crashing.")
    peer = as_peer_failure(gloo, 1)
    assert isinstance(peer, PeerFailure) and "rank 1" in str(peer) and "Connection closed by peer" in str(peer)
    assert "\n" not in str(peer)
    assert as_peer_failure(ValueError("a bad option"), 0) is None
    assert as_peer_failure(RuntimeError("size mismatch"), 0) is None
    if hasattr(torch.distributed, "DistBackendError"):
        assert isinstance(as_peer_failure(torch.distributed.DistBackendError("x"), 0), PeerFailure)


_FULL_DISK = """
import errno, os, torch
_real = torch.save
def _save(obj, f, *a, **k):  # a disk that fills up once the flag file exists (rank 1 only)
    if os.environ.get("RANK") == "1" and os.path.exists(os.environ["FULL_DISK_FLAG"]):
        raise OSError(errno.ENOSPC, "No space left on device", str(getattr(f, "name", f)))
    return _real(obj, f, *a, **k)
torch.save = _save
"""


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _run_until_disk_full(out: Path, fill, fast, extra_env=None):
    proc = subprocess.Popen([sys.executable, "-m", "hytrain", "train", "--nproc", "2", "--steps", "100000",
                             "--save-every", "3", "--keep", "1", "--eval-every", "0", "--out", str(out), *fast],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**_env(), **(extra_env or {})})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "checkpoints" / "latest").is_file():
                fill()
                break
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stdout, stderr


def _after_full_disk(out: Path, rc: int, stderr: str, *words):
    assert rc == 2, stderr[-4000:]
    _one_error_line(stderr, "hytrain train: error:", *words)
    root = out / "checkpoints"
    assert not list(root.glob(".step_*")), list(root.iterdir())  # no partial directory fills the disk
    last = ckpt.resolve(out, "latest")
    ckpt.verify(last)  # the last good checkpoint is intact
    return last


def test_a_disk_that_fills_under_torchrun_stops_every_rank_with_the_last_checkpoint_intact(tmp_path, fast):
    """A write that fails on one rank (an injected ENOSPC inside DCP's save on rank 1): every rank
    stops, one line names the checkpoint and the bytes, the partial directory is gone, and the last
    good checkpoint verifies and resumes."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FULL_DISK)
    flag = tmp_path / "full"
    env = _env()
    env = {"PYTHONPATH": str(site) + os.pathsep + env.get("PYTHONPATH", ""), "FULL_DISK_FLAG": str(flag)}
    out = tmp_path / "run"
    rc, _, stderr = _run_until_disk_full(out, flag.touch, fast, env)
    last = _after_full_disk(out, rc, stderr, "No space left on device", "GB needed")
    flag.unlink()
    step = int(last.name.split("_")[1])
    more = ok("--nproc", "2", "--steps", str(step + 1), "--eval-every", "0", "--out", str(out), "--resume",
              "latest", "--no-export", *fast)
    assert f"at step {step}" in more.stdout


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounts a small tmpfs")
def test_a_real_small_disk_under_torchrun(tmp_path, fast):
    """The same on a real file system that fills: a 48 MB tmpfs (where this machine lets a test mount
    one), filled by another writer once the first checkpoint is there."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "48m"):
        pytest.skip("this machine does not allow mounting a tmpfs")
    try:
        out = disk / "run"

        def fill():
            free = shutil.disk_usage(disk).free
            try:
                with open(disk / "ballast", "wb") as f:
                    f.write(b"\0" * max(0, free - (1 << 20)))
            except OSError as e:  # the run wrote meanwhile: the disk is full all the same
                if e.errno != errno.ENOSPC:
                    raise

        rc, _, stderr = _run_until_disk_full(out, fill, fast)
        _after_full_disk(out, rc, stderr, "GB free")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=20)


def test_default_workers_leave_one_core_and_take_at_most_32_a_numa_node(monkeypatch):
    # The update draws the node's memory bandwidth with 16-32 threads; more only wait on memory (and,
    # on a virtual machine, are what the hypervisor takes away): at most 32 for each node spanned.
    import os

    from hytrain import distributed

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for cpus, nodes, expected in ((16, {0: list(range(16))}, 15), (64, {0: list(range(64))}, 32),
                                  (128, {0: list(range(64)), 1: list(range(64, 128))}, 64),
                                  (64, {}, 32),  # the kernel names no node: one
                                  (33, {0: list(range(33))}, 32), (4, {0: [0, 1, 2, 3]}, 3)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        monkeypatch.setattr(os, "cpu_count", lambda n=cpus: n)
        assert distributed.default_workers(nodes) == expected, (cpus, nodes)
    # Two ranks of a 128-core host of two nodes, each bound to its node: 32 each, not 63.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64, 128)))
    assert distributed.default_workers({0: list(range(64)), 1: list(range(64, 128))}) == 32
