"""Which weights the loop wrote between steps, whatever path it wrote them by.

torch's AdamW steps from whatever the weights are; HybridAdamW steps from an fp32 master beside
them, so a write to the bf16/fp16 (or CUDA fp32) weights must reach the master before the next update.
Two witnesses, both read at ``step()`` (``StateStore.written_weights``):

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
