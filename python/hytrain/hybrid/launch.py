"""Launches: how a block's update starts on each path -- the CPU engine (CPU parameters), the offload
pipeline (gradients to pinned memory, CPU update, weights back) or the fused CUDA AdamW (GPU-resident
blocks) -- from the parameters' handles in the native ``ParamTable``; hand-offs during backward, the
waits before a block is used, and what a step not taken undoes."""

from __future__ import annotations

import torch

from .._native import native
from ..cuda_adam import CudaAdamW
from .common import local


class Launch:
    """How blocks' updates start, are waited for, and are undone."""

    def _early_handoff(self) -> bool:
        """On CUDA after the first step, without loss scaling: each block's gradients leave the GPU
        during backward (with the block's share of the squared norm when the gradients are
        released); the updates wait for step(), or run speculatively beside the state and are
        checked there."""
        return self._cuda and self.overlap and self._steps_taken > 0 and not self._loss_scaling

    def _sq_norm(self, grads):
        """The squared 2-norm of some gradients as a 0-d float64 device tensor (no fp32 copies)."""
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return torch.stack(norms).double().square().sum()

    def _hand_off(self, b):
        """Early hand-off of block b (see _early_handoff): offloaded blocks are staged on hold (or
        speculate), GPU-resident blocks copy their gradients into their update buffers. ``.grad`` is
        released (``release_grads``), or kept for the caller with its version noted, so that step()
        can tell whether the caller changed it (clip_grad_norm_, unscaling) and redo the block."""
        try:
            pairs = self._grads(b)
        except (RuntimeError, TypeError, ValueError):
            return  # not handed off: step() refuses the step before anything is applied
        if self.release_grads:
            if pairs:
                self._sq_parts[b] = self._sq_norm([g for _, g in pairs])
        else:
            for p in self._blocks[b]:
                if p.grad is not None:
                    g = local(p.grad)
                    self._handed[id(p)] = (g, g._version)
        if self._rt.on_gpu(b):
            for p, g in pairs:
                self._dev_state[id(p)]["grad"].copy_(g)
            self._rt.hold(b, [self._index_of[id(p)] for p, _ in pairs])
            if self.release_grads:
                for p, _ in pairs:
                    p.grad = None
        else:
            spec = (self._spec_from is not None and b >= self._spec_from and not self._last_clipped
                    and self._has_shadows(b))
            self._launch(b, 1.0, release=self.release_grads, hold=not spec, speculative=spec)

    def _grads(self, b):
        """The block's (parameter, gradient) pairs, gradients validated and contiguous: for
        the local shards of sharded (FSDP2) parameters; a parameter whose shard on this rank is empty
        has nothing to update here."""
        out = []
        for p in self._blocks[b]:
            if p.grad is None:
                continue
            g, w = local(p.grad), local(p)
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError(f"HybridAdamW does not support sparse gradients (shape {tuple(p.shape)})")
            self._check_bound(p)
            if g.dtype != w.dtype or g.shape != w.shape or g.device != w.device:
                raise RuntimeError(f"gradient of a parameter of shape {tuple(w.shape)} has dtype {g.dtype}, "
                                   f"shape {tuple(g.shape)}, device {g.device}: it must match the parameter "
                                   f"({w.dtype}, {w.device})")
            if w.numel():
                out.append((p, g if g.is_contiguous() else g.contiguous()))
        return out

    def _launch(self, b, grad_scale, *, release, hold=False, speculative=False, pairs=None):
        """Starts block b's update with gradient multiplier ``grad_scale``. ``release`` drops the
        parameters' ``.grad`` (the GPU memory returns once the gradient copy has landed). ``hold``
        (offloaded blocks): copy the gradients out now, update on OffloadPipeline.release.
        ``speculative`` (offloaded blocks): the new state goes to the block's shadows and the new
        weights come from the shadow staging; the gradients stay in staging (see _adopt, _redo).
        The parameters are stepped by their handles in the native table; what crosses is the
        multiplier and the gradients' and weights' addresses of the moment."""
        if pairs is None:
            pairs = self._grads(b)
        rt = self._rt
        if self.timeline is not None:
            self._pass_owner[b] = self.timeline.current
        if self._meter is not None and self._cuda and not rt.on_gpu(b):
            self._meter_owner[b] = self._meter.current
        handles = [self._index_of[id(p)] for p, _ in pairs]
        if pairs and not rt.on_gpu(b):
            self._sync_groups()
        if not self._cuda:
            self._engine.submit(b, self._table, handles, [g.data_ptr() for _, g in pairs],
                                [local(p).data_ptr() for p, _ in pairs], float(grad_scale))
            # The workers read the gradients and write the weights: both stay alive until waited for.
            self._alive[b] = [t for p, g in pairs for t in (g, local(p).detach())]
            self._fence.watch(b, [g for _, g in pairs])
            rt.set_in_flight(b)
        elif rt.on_gpu(b):
            self._gpu_update(b, pairs, grad_scale)
        elif pairs:
            self._migration_done(b, host=True)  # states that came down from the GPU have landed
            self._pipeline.stage(b, self._table, handles, [g.data_ptr() for _, g in pairs],
                                 [local(p).data_ptr() for p, _ in pairs], float(grad_scale),
                                 torch.cuda.current_stream(self.device).cuda_stream, hold=hold,
                                 speculative=speculative)
            self._landing.append((self._pipeline.d2h_issued, [g for _, g in pairs]))
            # The H2D copies write these weights: their storage stays alive until the pass is waited
            # for, even if the caller replaces the parameters' data meanwhile.
            self._alive[b] = [local(p).detach() for p, _ in pairs]
            self._fence.watch(b, [g for _, g in pairs])  # the gradient copies still read them
            rt.set_in_flight(b)
        if pairs and hold:
            rt.hold(b, handles)
        elif pairs and speculative:
            rt.speculate(b, handles)
        else:
            rt.launch(b)
        if release and self._cuda:
            for p, _ in pairs:
                p.grad = None

    def _gpu_update(self, b, pairs, grad_scale):
        """pairs: (parameter, gradient), or (parameter, None) when the gradient is already in the
        parameter's update buffer (early hand-off)."""
        self._migration_done(b, host=False)  # states that went up: the compute stream waits for them
        groups = {}
        for p, g in pairs:
            d = self._dev_state[id(p)]
            if g is not None:
                d["grad"].copy_(g)
            st = self.state[p]
            st["step"] += 1
            groups.setdefault((self._group_index[id(p)], p.dtype, int(st["step"].item())), []).append(p)
        timed = self.timeline is not None or self._meter is not None
        first = False
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
        for (gi, dtype, step), ps in groups.items():
            # The fused kernel's tables hold the weights' addresses: a parameter whose storage was
            # replaced gets a new group.
            key = tuple((id(p), local(p).data_ptr()) for p in ps)
            fused = self._gpu_groups.get(key)
            if fused is None:
                first = True  # building the group's tables is not the update's cost: not measured
                self._drop_gpu_groups({id(p) for p in ps})
                ds = [self._dev_state[id(p)] for p in ps]
                half = dtype != torch.float32
                amsgrad = bool(self.param_groups[gi]["amsgrad"])
                fused = CudaAdamW([d["master"] for d in ds], [d["exp_avg"] for d in ds],
                                  [d["exp_avg_sq"] for d in ds], [d["grad"] for d in ds],
                                  weights=[local(p) for p in ps] if half else None, amsgrad=amsgrad,
                                  max_exp_avg_sqs=[d["max_exp_avg_sq"] for d in ds] if amsgrad else None)
                self._gpu_groups[key] = fused
            group = self.param_groups[gi]
            sign = -1.0 if group.get("maximize", False) else 1.0  # maximize: ascend
            fused.step(step=step, lr=float(group["lr"]), betas=tuple(float(x) for x in group["betas"]),
                       eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                       grad_scale=sign * float(grad_scale))
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            if self.timeline is not None:
                self.timeline.gpu_update(b, start, end)
            if self._meter is not None and not first:
                self._meter.gpu_update(b, start, end)

    def _drop_gpu_groups(self, ids):
        self._gpu_groups = {key: g for key, g in self._gpu_groups.items()
                            if not any(i in ids for i, _ in key)}

    def _drop_held(self):
        """A step that cannot be taken: held updates are cancelled, speculative ones dropped (their
        blocks get back the weights of their untouched state), and step counts restored, so that the
        states and weights are as before the backward."""
        rt, phases = self._rt, native().BlockPhase
        for b in rt.in_phase(phases.held):
            if not rt.on_gpu(b):
                self._pipeline.cancel(b)
                self._table.retreat(rt.handed(b))
            rt.drop(b)
        for b in rt.in_phase(phases.speculated):
            self._wait_blocks([b])  # the compute stream now follows the speculative weight copies
            for h in rt.handed(b):
                p = self._params[h]
                local(p).copy_(self.state[p]["master"], non_blocking=True)  # the weights are its rounding
            self._note_weight_versions([self._params[h] for h in rt.handed(b)])
            self._table.retreat(rt.handed(b))
            rt.drop(b)

    def _changed_blocks(self) -> set:
        """Blocks handed off during backward that cannot be released as they are: the caller changed
        their gradients since (``clip_grad_norm_``, unscaling, replacing or dropping ``.grad``; seen by
        the gradients' identity and version counters), or replaced their parameters' storage (which the
        staged weight copies would write). Parameters moved to another device or dtype are refused."""
        out = set()
        rt, phases = self._rt, native().BlockPhase
        for b in (*rt.in_phase(phases.held), *rt.in_phase(phases.speculated)):
            ps = [self._params[h] for h in rt.handed(b)]
            for p in self._blocks[b]:
                self._check_bound(p)
            staged = self._alive.get(b) if not rt.on_gpu(b) else None
            if staged and any(w.data_ptr() != local(p).data_ptr() for w, p in zip(staged, ps)):
                if self.release_grads:
                    raise RuntimeError(f"the parameters of block {b} were given new storage between backward "
                                       "and step(): their update was staged for the old storage, and their "
                                       "gradients are released (release_grads=True)")
                out.add(b)
                continue
            if self.release_grads:
                continue
            for p in self._blocks[b]:
                seen, g = self._handed.get(id(p)), (local(p.grad) if p.grad is not None else None)
                if (seen is None) != (g is None) or (g is not None and (g is not seen[0] or g._version != seen[1])):
                    out.add(b)
                    break
        return out

    def _restage(self, b, mult, pairs=None):
        """Block b's gradients changed after its hand-off: its held pass is cancelled, or its
        speculative one dropped (it wrote only the shadows), and the block is updated from the
        gradients there now (the new copies wait for the old pass on the device)."""
        rt = self._rt
        if pairs is None:
            pairs = self._grads(b)
        if rt.on_gpu(b):
            self._gpu_update(b, pairs, mult)
            rt.launch(b)
            return
        if rt.phase(b) == native().BlockPhase.held:
            self._pipeline.cancel(b)
        self._table.retreat(rt.handed(b))
        self._launch(b, mult, release=False, pairs=pairs)

    def _release_landed(self):
        if not self._landing:
            return
        done = self._pipeline.d2h_completed
        while self._landing and self._landing[0][0] <= done:
            self._landing.popleft()

    def _wait_blocks(self, ids):
        rt, up = self._rt, []
        for b in ids:
            if not rt.in_flight(b):
                continue
            try:
                if self._cuda:
                    self._pipeline.wait_ready(b, torch.cuda.current_stream(self.device).cuda_stream)
                else:
                    self._engine.wait(b)
            finally:
                self._alive.pop(b, None)
                self._fence.forget(b)
                if rt.landed(b):  # k rose while its pass was in flight: its states go up now
                    up.append(b)
            owner = self._pass_owner.pop(b, None)
            info = None
            if owner is not None:
                info = self._pipeline.last_pass(b) if self._cuda else self._engine.timing(b)
                owner.passes[b] = info
            metered = self._meter_owner.pop(b, None)
            if metered is not None:
                metered.passes[b] = info if info is not None else self._pipeline.last_pass(b)
        for b in up:
            self._to_gpu(b)
        self._release_landed()
