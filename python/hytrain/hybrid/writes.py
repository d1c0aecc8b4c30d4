"""Which weights the loop wrote between steps, whatever path it wrote them by.

torch's AdamW steps from whatever the weights are; HybridAdamW steps from an fp32 master beside
them, so a write to the bf16/fp16 (or CUDA fp32) weights must reach the master before the next update.
Two witnesses, both read at ``step()`` (``WeightWrites.written``):

* the version counter and address of each parameter: writes through the parameter itself (in-place
  operations, ``copy_``, a detached view, ``model.load_state_dict``) and storage replaced
  (``p.data = t``);
* a fingerprint of each parameter's weights (``fingerprint.h``: a position-sensitive sum of a
  bijective mix of each 16-bit word, so any one changed word is always seen), for writes that leave
  the counter alone: through ``p.data`` (a tensor with a counter of its own), raw pointers, other
  threads. It is taken each time the optimizer has written the weights -- when a block's update is
  waited for (a forward hook, the fence, ``synchronize()``), on the stream that then reads them,
  before any operation of the loop can touch them; after a GPU-resident block's update; when a
  master is made or refreshed -- and taken again at ``step()``, for the blocks with no update in
  flight. On CUDA that is two reads of the weights per step on the compute stream (2 bytes per
  bf16 parameter each) and one device-to-host copy of the mismatches; on the CPU a host pass.

A parameter seen written gets its master refreshed from its weights (``Engine._follow_weight_writes``).
Not watched: fp32 CPU parameters (they are their own master, so a write is the master's), FSDP2
shards (FSDP2 owns their storage) and empty ones.
"""

from __future__ import annotations

import torch

from .._native import native
from .common import local


class WeightWatch:
    """Fingerprints of the watched parameters of each of the plan's blocks (``blocks[b]``: the watched
    parameters of block b, possibly none), as of the optimizer's last write (:meth:`note`), compared
    with the weights of now (:meth:`written`). On CUDA each block has one native group (its spans'
    addresses; a parameter whose storage changed gets a new one) and one launch per call."""

    def __init__(self, blocks, device):
        self.blocks = [list(b) for b in blocks]
        self.params = [p for b in self.blocks for p in b]  # slots in block order: a block is a slice
        self.slot = {id(p): i for i, p in enumerate(self.params)}
        self.block_of = {id(p): b for b, ps in enumerate(self.blocks) for p in ps}
        self.lo = [0]
        for b in self.blocks:
            self.lo.append(self.lo[-1] + len(b))
        self.cuda = device.type == "cuda"
        self.device = device
        n = len(self.params)
        if self.cuda:
            self._ref = torch.zeros(n, dtype=torch.int64, device=device)
            self._now = torch.zeros(n, dtype=torch.int64, device=device)
        else:
            self._ref = [0] * n
        self._noted = [False] * n
        self._groups = {}  # block -> (its spans, native group, the tensors it reads)

    def _compute(self, b, out):
        """Enqueues block b's fingerprints into ``out`` (its slice of a device int64 tensor) on the
        current stream."""
        ps = self.blocks[b]
        key = tuple((local(p).data_ptr(), local(p).numel() * local(p).element_size()) for p in ps)
        entry = self._groups.get(b)
        if entry is None or entry[0] != key:
            group = native().CudaFingerprintGroup(list(key), self.device.index)
            entry = self._groups[b] = (key, group, [local(p).detach() for p in ps])
        entry[1].compute(out.data_ptr(), torch.cuda.current_stream(self.device).cuda_stream)

    @staticmethod
    def _host(p) -> int:
        w = local(p)
        return native().fingerprint(w.data_ptr(), w.numel() * w.element_size())

    def note(self, params) -> None:
        """The weights of ``params`` (those watched) are as the optimizer wrote them: their fingerprints
        become the reference (on CUDA, enqueued on the current stream: in order with what follows)."""
        ps = [p for p in params if id(p) in self.slot]
        if not ps:
            return
        with torch._C.DisableTorchFunction():  # not an operation of the loop's (the fence passes it)
            if self.cuda:
                ids = {id(p) for p in ps}
                for b in sorted({self.block_of[id(p)] for p in ps}):
                    lo, hi = self.lo[b], self.lo[b + 1]
                    if all(id(q) in ids for q in self.blocks[b]):
                        self._compute(b, self._ref[lo:hi])
                    else:  # part of a block: its new fingerprints, the others' references kept
                        self._compute(b, self._now[lo:hi])
                        for q in self.blocks[b]:
                            if id(q) in ids:
                                i = self.slot[id(q)]
                                self._ref[i:i + 1].copy_(self._now[i:i + 1])
            else:
                for p in ps:
                    self._ref[self.slot[id(p)]] = self._host(p)
        for p in ps:
            self._noted[self.slot[id(p)]] = True

    def written(self, quiet) -> list:
        """The watched parameters of blocks ``quiet`` (nothing of the optimizer's writing their weights
        now) whose weights differ from the reference."""
        quiet = [b for b in quiet if self.blocks[b]]
        if not quiet:
            return []
        with torch._C.DisableTorchFunction():
            if self.cuda:
                for b in quiet:
                    self._compute(b, self._now[self.lo[b]:self.lo[b + 1]])
                hits = (self._now != self._ref).nonzero().flatten().tolist()  # one synchronisation
                wanted = set(quiet)
                return [self.params[i] for i in hits if self._noted[i] and self.block_of[id(self.params[i])] in wanted]
            return [p for b in quiet for p in self.blocks[b]
                    if self._noted[self.slot[id(p)]] and self._host(p) != self._ref[self.slot[id(p)]]]


class WeightWrites:
    """The weights as the optimizer last wrote them, per parameter with a master: the address and
    version counter of each, the masters loaded since (``loaded_masters``: checked against the
    weights at the next step) and their fingerprints (``watch``: a WeightWatch, or None).
    ``state``: the optimizer's state dict (whose masters :meth:`refresh` writes)."""

    def __init__(self, plan, rt, state, watch=None, homes=lambda p: None):
        self.plan, self.rt, self.state, self.watch = plan, rt, state, watch
        # A streamed parameter's training copy is its home on the host (window.py), whose only writer
        # is the optimizer: not watched (its device storage exists only while its layer runs), but a
        # master loaded is checked against it.
        self.homes = homes
        self._versions = {}  # id(p) -> (address, version) of the weights after our last write
        self.loaded_masters = set()  # ids of parameters whose master was loaded since the last step

    def rebind(self, state) -> None:
        """``optimizer.state`` is another dict now (see ``StateStore.rebind``)."""
        self.state = state

    def note(self, params=None, *, sharded=False):
        """The weights as the optimizer wrote them: their version counters -- our own updates write
        them without counting (copies and kernels on their memory), so a counter that moved later
        means the loop wrote the weights (``model.load_state_dict``, an in-place edit) -- and their
        fingerprints, for writes that leave the counter alone (``p.data``). Not for FSDP2 shards
        (``sharded``), whose storage FSDP2 manages itself."""
        if sharded:
            return
        params = self.plan.params if params is None else params
        for p in params:
            if "master" in self.state[p] and self.homes(p) is None:
                self._versions[id(p)] = (local(p).data_ptr(), local(p)._version)
        if self.watch is not None:
            self.watch.note(params)

    def masters_loaded(self, params) -> None:
        """These parameters' masters were loaded: checked against their weights at the next step."""
        self.loaded_masters.update(id(p) for p in params)

    def written(self, *, sharded=False) -> list:
        """The parameters whose weights the loop wrote since :meth:`note`, of the blocks whose
        weights no pass of the optimizer is writing now."""
        if sharded:
            return []
        out = []
        for p in self.plan.params:
            seen = self._versions.get(id(p))
            w = local(p)
            if seen is not None and seen != (w.data_ptr(), w._version):
                out.append(p)
        # Blocks whose weights a pass of the optimizer may be writing now are not compared: those in
        # flight, speculated ones included (their speculative weights are copied in during backward).
        rt, phases = self.rt, native().BlockPhase
        quiet = [b for b in range(len(self.plan)) if not rt.in_flight(b) or rt.phase(b) == phases.held]
        if self.loaded_masters:  # masters loaded since: checked against the weights
            seen = {id(p) for p in out}
            out += [p for b in quiet for p in self.plan.blocks[b] if id(p) in self.loaded_masters and id(p) not in seen]
        if self.watch is not None:
            seen = {id(p) for p in out}
            out += [p for p in self.watch.written(quiet) if id(p) not in seen]
        return out

    def refresh(self, params) -> list:
        """The weights are what the next update starts from, as with torch's optimizers; the fp32
        master (on the host, or on the GPU for a resident block) only adds the precision below their
        rounding. So each element whose weight is not its master's rounding (written by the loop, or a
        master loaded that the weights do not match) takes the weight's value; the others keep their
        master. Returns the parameters whose master changed (nothing in flight may read them)."""
        changed = []
        with torch.no_grad():
            for p in params:
                home = self.homes(p)
                m, w = self.state[p]["master"], (local(p) if home is None else home).detach()
                w = w.to(m.device, non_blocking=False) if w.device != m.device else w
                differs = w != m.to(w.dtype)  # (NaN weights always differ: the master becomes NaN)
                if bool(differs.any()):
                    m.copy_(torch.where(differs, w.to(m.dtype), m))
                    changed.append(p)
        self.loaded_masters.difference_update(id(p) for p in params)
        self.note(params)
        return changed
