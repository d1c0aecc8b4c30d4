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
    """Fingerprints of ``params`` (the watched parameters, in a fixed order), as of the optimizer's
    last write (:meth:`note`), compared with the weights of now (:meth:`written`)."""

    def __init__(self, params, device):
        self.params = list(params)
        self.slot = {id(p): i for i, p in enumerate(self.params)}
        self.cuda = device.type == "cuda"
        self.device = device
        n = len(self.params)
        if self.cuda:
            self._ref = torch.zeros(n, dtype=torch.int64, device=device)
            self._idx = {}  # slots -> their index tensor on the device
        else:
            self._ref = [0] * n
        self._noted = [False] * n
        self._groups = {}  # ((id, address, bytes) of each parameter) -> (native group, the tensors)

    def __contains__(self, p) -> bool:
        return id(p) in self.slot

    def _spans(self, ps):
        return tuple((id(p), local(p).data_ptr(), local(p).numel() * local(p).element_size()) for p in ps)

    def _compute(self, ps, out):
        """Enqueues the fingerprints of ``ps`` into ``out`` (a device int64 tensor of len(ps)) on the
        current stream. The group records addresses: a parameter whose storage changed gets a new one."""
        key = self._spans(ps)
        entry = self._groups.get(key)
        if entry is None:
            if len(self._groups) > 4 * len(self.params) + 64:  # storage replaced many times over
                self._groups.clear()
            group = native().CudaFingerprintGroup([(a, n) for _, a, n in key], self.device.index)
            entry = self._groups[key] = (group, [local(p).detach() for p in ps])
        stream = torch.cuda.current_stream(self.device)
        entry[0].compute(out.data_ptr(), stream.cuda_stream)

    def _index(self, slots):
        key = tuple(slots)
        idx = self._idx.get(key)
        if idx is None:
            if len(self._idx) > 256:
                self._idx.clear()
            idx = self._idx[key] = torch.tensor(slots, device=self.device)
        return idx

    def note(self, params) -> None:
        """The weights of ``params`` (those watched) are as the optimizer wrote them: their fingerprints
        become the reference (on CUDA, enqueued on the current stream: in order with what follows)."""
        ps = [p for p in params if id(p) in self.slot]
        if not ps:
            return
        slots = [self.slot[id(p)] for p in ps]
        with torch._C.DisableTorchFunction():  # not an operation of the loop's (the fence passes it)
            if self.cuda:
                lo = slots[0]
                if slots == list(range(lo, lo + len(slots))):
                    self._compute(ps, self._ref[lo:lo + len(slots)])
                else:
                    out = torch.empty(len(ps), dtype=torch.int64, device=self.device)
                    self._compute(ps, out)
                    self._ref.index_copy_(0, self._index(slots), out)
            else:
                for p, i in zip(ps, slots):
                    w = local(p)
                    self._ref[i] = native().fingerprint(w.data_ptr(), w.numel() * w.element_size())
        for i in slots:
            self._noted[i] = True

    def written(self, params) -> list:
        """Those of ``params`` (watched, with a reference, and nothing of the optimizer's writing
        them now) whose weights differ from the reference."""
        ps = [p for p in params if id(p) in self.slot and self._noted[self.slot[id(p)]]]
        if not ps:
            return []
        slots = [self.slot[id(p)] for p in ps]
        with torch._C.DisableTorchFunction():
            if self.cuda:
                idx = self._index(slots)
                now = torch.empty(len(ps), dtype=torch.int64, device=self.device)
                self._compute(ps, now)
                changed = (now != self._ref.index_select(0, idx)).nonzero().flatten().tolist()  # one sync
                return [ps[j] for j in changed]
            out = []
            for p, i in zip(ps, slots):
                w = local(p)
                if native().fingerprint(w.data_ptr(), w.numel() * w.element_size()) != self._ref[i]:
                    out.append(p)
            return out
