"""The job on several processes: ``hytrain train --nproc N`` starts torchrun on this node (with
the rendezvous options for several nodes passed through), and a job started by torchrun
(``torchrun --nproc-per-node N -m hytrain train ...``) joins the process group, shards the model with
FSDP2 (``fully_shard`` per repeated layer and at the root), trains each rank on its slice of the
global batch, and agrees with the other ranks on what must agree: the step's loss, when to stop, and
the figures rank 0 records for every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
import uuid

import torch

from .. import cuda_available, early_signals
from ..blocks import repeated_layers
from .options import ConfigError, to_stderr
from .processes import stop_when_orphaned


class PeerFailure(RuntimeError):
    """A collective of the job failed: another rank died, or hung past ``--timeout`` (``hung``: the
    collective timed out, so the peers were alive but did not come)."""

    def __init__(self, message, hung=False):
        super().__init__(message)
        self.hung = hung


def _timed_out(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "timed out" in text or "timeout" in type(e).__name__.lower() or "deadline" in text


# Set by ``hytrain train --nproc`` for its ranks: a failure goes to torchrun's error file, and the
# launcher prints the first one once (``hytrain.job.torchrun``).
LAUNCHED = "HYTRAIN_LAUNCHER"


# What gloo and NCCL say when a peer process is gone or a collective timed out.
_PEER_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout",
               "Timed out", "timed out", "NCCL communicator was aborted", "ProcessGroupGloo", "ProcessGroupNCCL",
               "gloo/transport")


def as_peer_failure(e: BaseException, rank: int) -> PeerFailure | None:
    """The job's PeerFailure for an error of the process group raised outside the job's own
    collectives (FSDP's all-gathers in forward and backward, the checkpoints' barriers), else None."""
    if isinstance(e, PeerFailure):
        return e
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", ())
    if isinstance(e, dist_error) or (isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_SIGNS)):
        first = (str(e).strip().splitlines() or [""])[0][:200]
        if _timed_out(e):
            return PeerFailure(f"rank {rank} waited past --timeout in a collective for a peer that did not "
                               f"come (hung: stopped, deadlocked or swapping; {type(e).__name__}: {first[:160]})",
                               hung=True)
        return PeerFailure(f"rank {rank}: the process group failed -- a peer process died or hung past "
                           f"--timeout ({type(e).__name__}: {first})")
    return None


def tell_launcher(line: str, kind: str, rank: int, callstack: str = "") -> bool:
    """Under ``hytrain train --nproc``: writes this rank's failure (``kind``: user, peer or bug) to
    torchrun's error file, for the launcher to print once. Returns whether this rank should print it
    as well: outside that launcher, or while torchrun has restarts left (the group goes on, so the
    launcher would say nothing), where rank 0 speaks for a user's error and every rank for its own."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not (path and os.environ.get(LAUNCHED)):
        return True
    # (Imported here: hytrain.job imports this module, and ``python -m hytrain.job.torchrun`` must find
    # that module not yet imported, or runpy warns that it runs a second copy of it.)
    from .torchrun import error_file_payload

    try:
        with open(path, "w") as f:
            f.write(error_file_payload(line, kind, callstack, time.time()))
    except OSError:
        return True
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return restarts_left and (kind != "user" or rank == 0)


def report_failure(line: str, kind: str, exc: BaseException | None = None) -> None:
    """A rank's (or a plain job's) failure: to the launcher (see :func:`tell_launcher`) and/or stderr."""
    rank = int(os.environ.get("RANK", "0"))
    callstack = "".join(traceback.format_exception(exc)) if kind == "bug" and exc is not None else ""
    if tell_launcher(line, kind, rank, callstack):
        to_stderr(callstack.rstrip() if callstack else line)  # (a closed stderr: the status stays)


def _collective(what, fn, rank):
    try:
        return fn()
    except Exception as e:  # gloo and NCCL raise several kinds when a peer is gone or times out
        first = (str(e).strip().splitlines() or [""])[0]
        if _timed_out(e):
            raise PeerFailure(f"rank {rank} waited past --timeout in the {what} for a peer that did not come "
                              f"(hung: stopped, deadlocked or swapping; {type(e).__name__}: {first[:160]})",
                              hung=True) from e
        raise PeerFailure(f"rank {rank}: the {what} with the other ranks failed -- a peer process died or "
                          f"hung past --timeout ({type(e).__name__}: {first}); with --max-restarts, torchrun "
                          "restarts the group from the latest checkpoint") from e


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def resolve_nproc(spec, device: str) -> int:
    """``--nproc``: an integer >= 1, or ``auto``: one process per visible GPU (one on a CPU)."""
    if spec == "auto":
        if device != "cpu" and torch.cuda.is_available():
            return max(1, torch.cuda.device_count())
        return 1
    try:
        n = int(spec)
    except (TypeError, ValueError):
        raise ConfigError(f"--nproc must be an integer >= 1 or 'auto', got {spec!r}") from None
    if n < 1:
        raise ConfigError(f"--nproc must be an integer >= 1 or 'auto', got {spec!r}")
    if device != "cpu" and torch.cuda.is_available() and n > torch.cuda.device_count():
        raise ConfigError(f"--nproc {n}: this node has {torch.cuda.device_count()} GPU(s); "
                          "start at most one process per GPU (or train on the CPU with --device cpu)")
    return n


def torchrun_command(process, argv: list[str], nproc: int) -> list[str]:
    """The torchrun command that runs this job on ``nproc`` processes of this node (``process``: a
    ProcessPlan): the job's own flags are passed on without the launcher's."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--max-restarts", str(process.max_restarts)]
    if process.rdzv_endpoint:
        cmd += ["--nnodes", str(process.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", process.rdzv_endpoint,
                "--rdzv-id", process.rdzv_id]
    elif process.nnodes != "1":
        raise ConfigError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (a node every agent reaches)")
    else:  # one node: a rendezvous on a free local port, so that two jobs on one machine do not collide,
        # and a run id of this launch's own (the run lock tells a restart of this job, which keeps it,
        # from another job on the same --out)
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", uuid.uuid4().hex]
    return cmd + ["-m", "hytrain", "train", *_strip_launcher_flags(argv)]


def _torchrun_wrapper(cmd: list[str]) -> list[str]:
    """The same command through ``hytrain.job.torchrun``, which prints the ranks' first failure once."""
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    return [cmd[0], "-m", "hytrain.job.torchrun", *cmd[3:]]


LAUNCHER_FLAGS = {"--nproc", "--nnodes", "--rdzv-endpoint", "--rdzv-id", "--max-restarts"}  # each takes a value


def _strip_launcher_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in LAUNCHER_FLAGS:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def launch(process, batch_size: int, argv: list[str]) -> int:
    """Runs the job under torchrun (``process``: a ProcessPlan; ``batch_size``: the global batch);
    returns torchrun's exit status."""
    nproc = resolve_nproc(process.nproc, process.device)
    if not process.rdzv_endpoint and batch_size % nproc:  # several nodes: each rank checks the world
        raise ConfigError(f"--batch-size {batch_size} (the global batch) must be a multiple of the "
                          f"number of processes ({nproc})")
    cmd = torchrun_command(process, argv, nproc)
    if process.verbose:  # (not by default: a command the ranks refuse says one line)
        print("hytrain train: " + " ".join(cmd[1:]), flush=True)
    # OMP_NUM_THREADS=1 is what torchrun gives each rank anyway (the job sets its own thread counts);
    # setting it here spares its four-line banner saying so.
    # A fresh rendezvous store for every round of the group (torch's documented opt-out of the agent's
    # shared one), so that a restarted group never reads what the dead round left in it: see
    # ``hytrain.distributed.init_process_group``.
    early_signals.pass_on()  # a SIGUSR1 noted while this process started: to the agent, and on to the ranks
    env = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **os.environ,
           LAUNCHED: str(os.getpid())}  # named by the run lock
    # SIGUSR1 held pending from here until forward() is in place (the child starts with it held too,
    # until its own handler is: early_signals.install), so that none is lost or kills the agent.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        child = subprocess.Popen(_torchrun_wrapper(cmd), env=env)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        raise
    forwarded = []

    def forward(signum, _frame):  # a scheduler signals the launcher: every rank must hear it
        if signum == signal.SIGUSR1:  # (saves and goes on: not a stop)
            early_signals.send_when_ready(child.pid, signum)
            return
        forwarded.append(signum)
        try:
            child.send_signal(signum)  # torchrun passes it to the ranks and waits for them
        except OSError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    try:
        while True:
            try:
                rc = child.wait()
                break
            except KeyboardInterrupt:
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if forwarded and rc != 0:
        return 128 + forwarded[0]  # stopped by the signal (the ranks saved): not finished
    return 128 - rc if rc < 0 else rc


def set_up(process) -> "Ranks":
    """The set-up-ranks phase (``process``: a ProcessPlan): a job torchrun started joins its process
    group; a plain job is one process."""
    return Ranks.join(process.device, process.timeout) if under_torchrun() else Ranks()


def place(ranks: "Ranks", process, batch_size: int) -> torch.device:
    """This rank's device (its local GPU under torchrun, else ``--device``), once the global batch
    (``batch_size``) is known to split evenly between the ranks."""
    device = ranks.device(process.device) or pick_device(process.device)
    if batch_size % ranks.world:
        raise ConfigError(f"--batch-size {batch_size} (the global batch) must be a multiple of the "
                          f"number of processes ({ranks.world})")
    return device


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and cuda_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not (torch.cuda.is_available() and cuda_available()):
            raise ConfigError("--device cuda: no usable GPU (or hytrain was built without CUDA)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigError(f"--device must be auto, cpu or cuda[:N], got {spec!r}")
    return dev


class Ranks:
    """This process's place in a job started by torchrun (or the one process of a plain job)."""

    def __init__(self, rank=0, world=1, local_rank=0, group=None):
        self.rank, self.world, self.local_rank, self.group = rank, world, local_rank, group

    @property
    def distributed(self) -> bool:
        return self.group is not None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, device_spec: str, timeout_s: float) -> "Ranks":
        """Joins torchrun's process group (NCCL for GPUs, gloo on the CPU), with ``timeout_s`` on
        every collective, so that a rank that hangs makes the others fail instead of waiting."""
        import torch.distributed as dist

        from ..distributed import bind_to_numa_node, init_process_group

        cuda = device_spec != "cpu" and torch.cuda.is_available()
        if device_spec.startswith("cuda") and not cuda:
            raise ConfigError("--device cuda: no usable GPU")
        local_rank = int(os.environ["LOCAL_RANK"])
        stop_when_orphaned("the torchrun agent")
        if cuda:
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(f"local rank {local_rank} has no GPU (this node has "
                                  f"{torch.cuda.device_count()}): start at most one process per GPU")
            torch.cuda.set_device(local_rank)
        rank, world = init_process_group("nccl" if cuda else "gloo", timeout_s=timeout_s)
        bind_to_numa_node(local_rank)  # a no-op on one NUMA node
        return cls(rank, world, local_rank, dist.group.WORLD)

    def device(self, spec: str) -> torch.device | None:
        """The rank's device: its local GPU, or the CPU (None outside torchrun: the job picks)."""
        if not self.distributed:
            return None
        if spec != "cpu" and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def shard(self, model: torch.nn.Module, device: torch.device) -> None:
        """FSDP2: each repeated layer is a unit, the root holds the rest, over a mesh of the ranks'
        devices (FSDP2's default mesh is a CUDA one wherever CUDA is, even for a CPU run)."""
        if not self.distributed:
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (self.world,))
        layers = repeated_layers(model)
        for layer in layers if layers is not None else []:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the global batch (the batch size is a multiple of the world size)."""
        if not self.distributed:
            return batch
        n = batch.shape[0] // self.world
        return batch[self.rank * n:(self.rank + 1) * n]

    def restarted(self, device) -> bool:
        """Whether torchrun restarted the group after a failure, on any rank. After a failure on one
        node, the agents of the others restart their workers for the membership change, which
        torchrun does not count: their TORCHELASTIC_RESTART_COUNT stays as it was (an NCCL rank
        waiting in a collective with the dead one neither fails nor exits until its agent stops it)."""
        mine = float(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)
        return self.total(mine, device) > 0

    def gather(self, values: list[float], device, what="step's all-gather") -> list[list[float]]:
        """Every rank's values (one small all-gather); ``[values]`` in a plain job."""
        if not self.distributed:
            return [list(values)]
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.float64, device=device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        _collective(what, lambda: dist.all_gather(out, mine, group=self.group), self.rank)
        return [t.tolist() for t in out]

    def total(self, value: float, device) -> float:
        if not self.distributed:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=device)
        _collective("all-reduce", lambda: dist.all_reduce(t, group=self.group), self.rank)
        return float(t[0])

    def close(self):
        """Leaves the process group once every rank is done (a barrier, then the group's teardown
        while every peer is still there)."""
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.group)
            dist.destroy_process_group()
