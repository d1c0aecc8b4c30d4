"""Streamed weights: the GPU holds a window of a model's repeated layers, not the whole model.

A *streamed* layer's training copy (its bf16/fp16 weights) lives in pinned host memory, its *home*;
the parameter keeps its shape, dtype and device, but its storage is empty (``resize_(0)``) except
while the layer runs. The window copies a layer's home into freshly allocated storage on a copy stream
of its own ahead of the layer's forward, and again ahead of its backward (an activation-checkpointed
recomputation included), and lets the storage go once the forward has run (when no backward follows,
or before it, as FSDP2 reshards) and once the layer's gradients have all been accumulated. The tensors
autograd saved for the backward share the parameter's storage, so they see the weights again when
they are copied back in.

HybridAdamW (``model=``) finds the window of its model: the CPU AdamW writes a streamed block's new
weights straight into its home (nothing is copied to the GPU at the update), the GPU-updated blocks
(k) stay below the first streamed one, and the window's read-ahead waits for a layer's update to have
finished. Without the optimizer the window works alone (a frozen or inference model).

Which layers stream: the last ones, as few as leave the GPU room for the resident layers, a window
of ``depth`` layers, and ``reserve_bytes`` for activations, gradients in flight and the optimizer's
GPU side (:func:`plan_window`). A model that cannot fit even with every layer streamed is refused
before anything is allocated, naming the bytes on each side.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .pool import CapacityError, PinnedPool, available_memory_bytes, format_bytes
from .streamed_params import StreamedParameter
from .window_plan import Unit, choose_streamed, layout, materialize_meta, tensors_in
from .window_plan import plan_window  # noqa: F401 -- hytrain.window.plan_window, as before

_WINDOWS: "weakref.WeakKeyDictionary[nn.Module, WeightWindow]" = weakref.WeakKeyDictionary()
_OWNERS: dict = {}  # id(parameter) -> (weak parameter, weak window); by identity (tensors compare by value)


def window_of(model) -> "WeightWindow | None":
    """The window :func:`stream_model` set up for ``model`` (or its compiled wrapper), if any."""
    if model is None:
        return None
    return _WINDOWS.get(getattr(model, "_orig_mod", model))


def window_for(params) -> "WeightWindow | None":
    """The window that streams some of ``params``, if any (at most one may)."""
    found = {}
    for p in params:
        refs = _OWNERS.get(id(p))
        if refs is not None and refs[0]() is p and refs[1]() is not None:
            found[id(refs[1]())] = refs[1]()
    if len(found) > 1:
        raise ValueError("these parameters belong to more than one streamed model (stream_model)")
    return next(iter(found.values()), None)


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class WeightWindow:
    """The streamed layers of one model (made by :func:`stream_model`). ``streamed``: the indices of
    the streamed layers among ``layers``; ``weights(p)``: a streamed parameter's weights now (its
    optimizer's updates waited for); ``home(p)``: its pinned host buffer as it is (an update may be
    writing it, or gradients be staged there)."""

    def __init__(self, model, layers, streamed, device, depth, pool, measure=False):
        self.model, self.layers, self.device, self.depth, self.pool = model, layers, device, depth, pool
        self.streamed = list(streamed)
        self.cuda = device.type == "cuda"
        # ``measure``: the second forward's peak decides which streamed layers stay on the device from
        # the third on (kept: their homes still stage their gradients and take their updates, whose
        # new weights are then copied to the device, as for any resident block).
        self._measure = measure and self.cuda
        # Whether the optimizer may make the first streamed layers resident (make_resident): the
        # window was planned, not asked for (stream="auto").
        self.adjustable = False
        self._forwards = 0
        self._kept = set()  # layers kept on the device
        self._keep = set()  # layers to keep from their next forward on
        # (Parameters on the meta device become real ones first, uninitialised: see below.)
        self._unread = materialize_meta(model, [layers[i] for i in self.streamed], device)
        self._params = {i: [p for p in layers[i].parameters()] for i in self.streamed}
        self._trainable = {i: [p for p in ps if p.requires_grad] for i, ps in self._params.items()}
        self._homes = {}  # id(p) -> pinned host tensor
        self._layer_of = {id(p): i for i, ps in self._params.items() for p in ps}
        self._loaded = {}  # layer -> the copy's event not yet waited for on the compute stream (or None)
        self._arrived = {i: 0 for i in self.streamed}
        self._ready = None  # layer -> whether its home may be read now (the optimizer's updates)
        self._current = None  # parameter -> its weights where its home does not hold them now, else None
        self._in_use = None  # () -> whether an optimizer's state uses the homes
        self._hooks = []
        self._stream = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.stats = {"loads": 0, "prefetched": 0, "max_loaded": 0, "bytes_in": 0, "kept": 0, "made_resident": 0}
        # Tensor by tensor (a model built on the CPU never has two copies of much at once): the
        # streamed layers' weights to their homes, everything else to the device. A parameter that
        # was on the meta device gets its place uninitialised, for a checkpoint to be read into
        # (``home(p)`` where it streams, the parameter itself where it does not: job/reads.py).
        stream_ids = {id(p) for i in self.streamed for p in self._params[i]}
        for i, layer in enumerate(layers):
            if i in self._arrived:
                self._place(i)
                for b in layer.buffers(recurse=True):
                    b.data = b.data.to(device)
        with torch.no_grad():
            for p in model.parameters():
                if id(p) not in stream_ids and p.device != device:
                    p.data = p.data.to(device)
            for b in model.buffers():
                if b.device != device:
                    b.data = b.data.to(device)
        self._unread = set()
        self._install()

    # -- what the optimizer asks ----------------------------------------------------------------------

    def streams(self, p) -> bool:
        """Whether p belongs to a layer of the window (its home holds its weights and stages its
        gradients), kept on the device or not."""
        return id(p) in self._layer_of

    def kept(self, p) -> bool:
        """Whether p's layer stays on the device (its updates copy the new weights there)."""
        return self._layer_of.get(id(p)) in self._kept

    @property
    def kept_layers(self) -> list:
        return sorted(self._kept)

    def home(self, p) -> torch.Tensor:
        """p's home: the pinned host tensor that holds its weights (ValueError where p does not stream)."""
        home = self._homes.get(id(p))
        if home is None:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} that this window does not stream has no home "
                             "(window.streams(p) says which do)")
        return home

    def layer_of(self, p) -> int:
        return self._layer_of[id(p)]

    @property
    def params(self) -> list:
        return [p for i in self.streamed for p in self._params[i]]

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._homes.values())

    def layer_bytes(self, i) -> int:
        return sum(p.numel() * p.element_size() for p in self._params[i])

    def attach(self, ready=None, current=None, in_use=None) -> None:
        """The optimizer's answers (None: no optimizer, the homes are always final).
        ``ready(layer) -> bool``: whether the layer's home holds its final weights now (no update of
        it in flight, its gradients not staged there); ``current(p)``: the parameter's weights where
        its home does not hold them now, else None; ``in_use()``: whether its state uses the homes."""
        self._ready, self._current, self._in_use = ready, current, in_use

    def weights(self, p) -> torch.Tensor:
        """A streamed parameter's weights as of now, on the host (its home, or what the optimizer says
        they are while its home stages gradients)."""
        if id(p) not in self._homes:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} that this window does not stream")
        now = self._current(p) if self._current is not None else None
        return self._homes[id(p)] if now is None else now

    def invalidate(self, layer) -> None:
        """The layer's home is about to be written (an update, a restore): a copy on the GPU is stale
        (a kept layer's gets the update's own copy)."""
        if layer in self._loaded and layer not in self._kept:
            self._free(layer)

    def make_resident(self, i) -> None:
        """Streamed layer i stays on the device for good, as if it had never streamed, and its home is
        given back: what the optimizer asks where the host cannot hold the states of every streamed
        block and the GPU can hold the first ones' (their states then live there too). Only before an
        optimizer's state uses the homes (they stage its gradients from then on)."""
        if self._in_use is not None and self._in_use():
            raise RuntimeError("this window's homes stage the gradients of an optimizer's state: its layers can "
                               "be made resident only before that optimizer's first step")
        if i not in self._arrived:
            raise ValueError(f"layer {i} does not stream (window.streamed: {self.streamed})")
        with torch._C.DisableTorchFunction():
            if i in self._loaded:  # its weights are on the device already (or on their way)
                done = self._loaded.pop(i)
                if done is not None:
                    done.synchronize()
            else:
                for p in self._params[i]:
                    p.untyped_storage().resize_(p.numel() * p.element_size())
                    p.data.copy_(self.weights(p))  # (not non_blocking: the home is given back below)
        for p in self._params[i]:
            p.__class__ = nn.Parameter
            _OWNERS.pop(id(p), None)
            del self._homes[id(p)], self._layer_of[id(p)]
        self.streamed.remove(i)
        for table in (self._params, self._trainable, self._arrived):
            del table[i]
        self._keep.discard(i)
        self._kept.discard(i)
        self.stats.update(made_resident=self.stats["made_resident"] + 1, kept=len(self._kept))
        self.pool.trim()  # its slabs back to the system where nothing else is in them

    # -- placement ------------------------------------------------------------------------------------

    def _place(self, i) -> None:
        """Layer i's weights move to their homes; the parameters keep an empty storage on the device."""
        for p in self._params[i]:
            with torch.no_grad():
                home = self.pool.empty(p.shape, p.dtype) if id(p) in self._unread else self.pool.copy_of(p.detach())
                gpu = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                gpu.untyped_storage().resize_(0)
                p.data = gpu
            self._homes[id(p)] = home
            _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(self))
            p.__class__ = StreamedParameter

    # -- loads and frees ------------------------------------------------------------------------------

    def _load(self, i) -> None:
        # What each parameter holds now, as the optimizer says (weights()): a layer called outside the
        # model's forward (the embeddings, to make inputs_embeds) has not had the optimizer's wait for
        # its block, and its home may still be written by an update, or stage gradients until step().
        sources = [self.weights(p) for p in self._params[i]]
        with torch._C.DisableTorchFunction():
            ps = self._params[i]
            if not self.cuda:
                for p, src in zip(ps, sources):
                    p.untyped_storage().resize_(p.numel() * p.element_size())
                    p.data.copy_(src)
                self._loaded[i] = None
            else:
                compute = torch.cuda.current_stream(self.device)
                for p in ps:
                    p.untyped_storage().resize_(p.numel() * p.element_size())
                allocated = torch.cuda.Event()
                allocated.record(compute)  # the memory's last user on the compute stream is done first
                self._stream.wait_event(allocated)
                with torch.cuda.stream(self._stream):
                    for p, src in zip(ps, sources):  # (a source not in a home is pageable: copied at once)
                        p.data.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
                self._loaded[i] = done
        self.stats["loads"] += 1
        self.stats["bytes_in"] += self.layer_bytes(i)
        self.stats["max_loaded"] = max(self.stats["max_loaded"], self._in_window())

    def _in_window(self) -> int:
        """Streamed layers on the device now (kept ones not counted)."""
        return sum(1 for i in self._loaded if i not in self._kept)

    def _use(self, i) -> None:
        """Layer i is about to run: loaded, and the compute stream after its copy."""
        if i not in self._loaded:
            self._load(i)
        done = self._loaded[i]
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
            self._loaded[i] = None

    def _free(self, i) -> None:
        done = self._loaded.pop(i)
        with torch._C.DisableTorchFunction():
            if done is not None:  # read ahead and never used: the copy ends before the memory is reused
                torch.cuda.current_stream(self.device).wait_event(done)
            for p in self._params[i]:
                p.untyped_storage().resize_(0)

    def _read_ahead(self, i, step) -> None:
        """Loads the next streamed layers after i in this direction (``step`` +1 forward, -1 backward),
        keeping at most ``depth`` loaded, only where their homes are final."""
        if not self.cuda:
            return
        j = i + step
        while 0 <= j < len(self.layers) and self._in_window() < self.depth:
            if j in self._arrived and j not in self._loaded:
                if self._ready is not None and not self._ready(j):
                    return
                self._load(j)
                self.stats["prefetched"] += 1
            j += step
            if abs(j - i) >= self.depth:
                return

    # -- hooks ----------------------------------------------------------------------------------------

    def _pre_forward(self, i, member=0) -> None:
        backward = _in_backward()
        if i == 0 and member == 0 and not backward and torch.is_grad_enabled():
            self._count_forward()
        if i in self._arrived:
            self._use(i)
        self._read_ahead(i, -1 if backward else 1)

    def _post_forward(self, i, last, output) -> None:
        """After a forward of layer i (of one member of a :class:`Unit`; ``last``: its last member,
        whose forward ends the unit's)."""
        if _in_backward():
            return  # a recomputation: the layer's backward follows and needs the weights
        if i in self._arrived:
            self._arrived[i] = 0
        outs = [t for t in tensors_in(output) if t.requires_grad]
        if torch.is_grad_enabled() and outs and i not in self._kept:
            torch.autograd.graph.register_multi_grad_hook(outs, _Call(weakref.ref(self), "_pre_backward", i),
                                                          mode="any")
        if not last:
            return
        if i in self._keep and i in self._loaded:
            self._keep.discard(i)
            self._kept.add(i)
            self.stats["kept"] = len(self._kept)
        if i in self._loaded and i not in self._kept:
            self._free(i)

    def _pre_backward(self, i) -> None:
        if i in self._arrived:
            self._use(i)
        self._read_ahead(i, -1)

    def _grad_arrived(self, i) -> None:
        if i not in self._arrived:
            return  # (made resident since: make_resident)
        self._arrived[i] += 1
        if self._arrived[i] >= len(self._trainable[i]) and i in self._loaded and i not in self._kept:
            self._free(i)

    def _count_forward(self) -> None:
        """A training forward begins. With ``measure``: the second one's peak memory is sampled, and
        at the third the streamed layers that fit beside it stay on the device from then on, first
        layers first (a kept layer costs no copies), leaving 1 GiB and 5 % of the device free and a
        tenth for the allocator's fragmentation. The peak is what was allocated: the reserved peak
        counts the blocks the window's frees left cached, which the kept layers would reuse."""
        if not self._measure:
            return
        self._forwards += 1
        if self._forwards == 2:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._forwards == 3:
            self._measure = False
            total = torch.cuda.get_device_properties(self.device).total_memory
            room = total - torch.cuda.max_memory_allocated(self.device) - (1 << 30) - total // 20 - total // 10
            for i in self.streamed:
                need = self.layer_bytes(i)
                if need > room:
                    break
                room -= need
                self._keep.add(i)

    def _install(self) -> None:
        ref = weakref.ref(self)
        for i, layer in enumerate(self.layers):
            members = layer.members if isinstance(layer, Unit) else [layer]
            for k, m in enumerate(members):
                self._hooks.append(m.register_forward_pre_hook(_Call(ref, "_pre_forward", i, k)))
                self._hooks.append(m.register_forward_hook(_Call(ref, "_post_forward", i, k == len(members) - 1,
                                                                 with_output=True)))
        for i in self.streamed:
            for p in self._trainable[i]:
                self._hooks.append(p.register_post_accumulate_grad_hook(_Call(ref, "_grad_arrived", i)))
        # state_dict() and load_state_dict() of the model or of any module inside it (a wrapper's
        # checkpoint holds what it wraps): the streamed layers' entries are their homes (each layer's
        # own hook runs within any ancestor's state_dict); a load is refused by the first module it
        # visits that holds a streamed layer, before it has written anything.
        for i in self.streamed:
            hook = _Call(ref, "_state_dict", with_args=True)
            for m in self.layers[i].modules() if isinstance(self.layers[i], Unit) else [self.layers[i]]:
                self._hooks.append(m.register_state_dict_post_hook(hook))
        streamed = {id(p) for i in self.streamed for p in self._params[i]}
        for module in self.model.modules():
            if any(id(p) in streamed for p in module.parameters()):
                self._hooks.append(module.register_load_state_dict_pre_hook(_Call(ref, "_load_state_dict",
                                                                                  with_args=True)))

    def _load_state_dict(self, module, state_dict, prefix, *_) -> None:
        """The model's load_state_dict, before it writes anything: refused where it would write a
        streamed parameter (a rollback would otherwise leave the resident ones loaded and the
        streamed ones not)."""
        by_id = {id(p) for p in self.params}
        names = [name for name, p in module.named_parameters(prefix=prefix.rstrip(".") if prefix else "")
                 if id(p) in by_id and name in state_dict]
        if names:
            raise RuntimeError(
                f"load_state_dict would write {len(names)} streamed parameters ({names[0]}, ...), whose weights "
                "live in host memory (hytrain.stream_model): nothing was loaded. Load the weights into the model "
                "before stream_model (a new model, then a new HybridAdamW and its load_state_dict)")

    def _state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        """A streamed parameter's entry in the model's state_dict is its home (a CPU tensor): the
        device copy is empty between uses, and a large model's weights would not fit there anyway."""
        by_id = {id(p): p for p in self.params}
        for name, p in module.named_parameters(prefix=prefix.rstrip(".") if prefix else ""):
            if id(p) in by_id and name in state_dict:
                state_dict[name] = self.weights(p)

    def remove(self) -> None:
        """Every streamed layer back on the device, resident (if it fits), and the hooks removed.
        Refused while an optimizer's state uses the homes (they stage its gradients)."""
        if self._ready is not None:
            raise RuntimeError("this window's homes stage the gradients of an optimizer's state (HybridAdamW "
                               "made its state with them): remove() the window before that optimizer's first "
                               "step, or build a new optimizer after removing it")
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for i in self.streamed:
            if i in self._loaded:
                self._free(i)
            for p in self._params[i]:
                p.__class__ = nn.Parameter
                with torch.no_grad():
                    p.data = self._homes[id(p)].to(self.device)
                _OWNERS.pop(id(p), None)
        self._homes = {}
        _WINDOWS.pop(self.model, None)

    @property
    def ends(self) -> list:
        """The streamed units outside the repeated layers: ``"embeddings"``, ``"head"`` (see ``ends=``)."""
        return [self.layers[i].name for i in self.streamed if isinstance(self.layers[i], Unit)]

    def __repr__(self) -> str:
        ends = f" (with the {' and the '.join(self.ends)})" if self.ends else ""
        return (f"WeightWindow({len(self.streamed)} of {len(self.layers)} layers streamed{ends}, depth {self.depth}, "
                f"{format_bytes(self.host_bytes())} on the host)")


class _Call:
    """A hook calling ``window.name(*args)`` through a weak reference; copies do nothing."""

    def __init__(self, ref, name, *args, with_output=False, with_args=False):
        self.ref, self.name, self.args, self.with_output, self.with_args = ref, name, args, with_output, with_args

    @torch.compiler.disable
    def __call__(self, *hook_args):
        w = self.ref() if self.ref is not None else None
        if w is None:
            return None
        if self.with_output:
            getattr(w, self.name)(*self.args, hook_args[-1])
        elif self.with_args:
            getattr(w, self.name)(*hook_args)
        else:
            getattr(w, self.name)(*self.args)
        return None

    def __reduce__(self):
        return (_Call, (None, self.name))


def stream_model(model: nn.Module, device=None, *, stream="auto", depth: int = 2, reserve_bytes=None,
                 pool: PinnedPool | None = None, ends="auto", state_format=None) -> WeightWindow:
    """Places ``model`` on ``device`` (default: the current CUDA device, else the CPU) with its last
    repeated layers streamed from pinned host memory, and returns the window. The model may be on
    the CPU (it is moved layer by layer, each layer's CPU memory freed as it goes), already on the
    device, or on the meta device: then each streamed parameter gets an uninitialised home and the
    rest uninitialised device memory, for its weights to be read straight into (``window.home(p)``
    where ``window.streams(p)``, else the parameter: what ``hytrain train --model DIR`` does with a
    checkpoint's files; meta buffers too, so build it with real ones where they are computed). Build
    HybridAdamW with ``model=model`` afterwards or before (its state is made at the first step); it
    finds the window.

    ``stream``: ``"auto"``, a number of layers (the last ones), or 0. Auto: none where the weights
    leave half of the device free; else every layer that can, until the second training
    forward has been measured, after which the first streamed layers that fit beside its peak stay
    on the device for good (with ``reserve_bytes`` given: as few as :func:`plan_window` says, no
    measurement). Where the host cannot hold every streamed block's optimizer state, HybridAdamW makes
    the first streamed layers resident at its first step, their states on the GPU, as many as it holds
    (``window.stats["made_resident"]``); given HybridAdamW's ``state_format``, auto also streams where the
    host cannot hold that state for the whole model. ``depth``: streamed layers on the GPU at once (at least
    1; 2 lets the next layer's copy run beside the current one's compute). ``reserve_bytes``: GPU memory kept for
    everything but the weights (activations, gradients in flight, the optimizer's GPU side; default
    measured, see ``stream``). ``ends``: whether the parameters outside the repeated layers stream
    too, each end one more unit of the window (``window.ends``): ``"auto"`` streams the head (final
    norm and LM head), then the embeddings, only where the layers alone cannot make room (a small
    GPU); True both, False neither. With the embeddings streamed every block is updated on the
    host (k = 0): the GPU-updated blocks come before the first streamed one. Tied embeddings do not
    stream. A model that does not fit even streamed is refused before anything moves
    (CapacityError)."""
    if window_of(model) is not None:
        raise ValueError("this model already streams its weights (stream_model was called on it)")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"stream_model places models on a CUDA device (or the CPU, for tests), not {device}")
    inner = getattr(model, "_orig_mod", model)
    meta = next((name for name, b in inner.named_buffers() if b.is_meta), None)
    if meta is not None:  # (uninitialised memory in its place would make the forward silently wrong)
        raise ValueError(f"buffer {meta} is on the meta device: stream_model places parameters from the meta device, "
                         "not buffers, which are computed: build the model with real ones (accelerate's "
                         "init_empty_weights(include_buffers=False)) or fill them first")
    layers, ok, layer_bytes, fixed = layout(inner)
    count, with_ends, measure = choose_streamed(inner, layers, ok, layer_bytes, fixed, device, stream=stream,
                                                depth=depth, reserve_bytes=reserve_bytes, ends=ends,
                                                state_format=state_format)
    first = [u for u in with_ends if u.name == "embeddings"]
    last = [u for u in with_ends if u.name == "head"]
    units = first + list(layers) + last
    n = len(layers)
    streamed = list(range(len(first))) + [len(first) + i for i in range(n - count, n)] + \
        list(range(len(units) - len(last), len(units)))
    sizes = [sum(p.numel() * p.element_size() for p in units[i].parameters()) for i in streamed]
    host_need = sum(sizes)
    room = available_memory_bytes()
    if room is not None and host_need > room:
        raise CapacityError(f"streaming {len(streamed)} layers needs {format_bytes(host_need)} of pinned host memory "
                            f"for their weights, and {format_bytes(room)} is available")
    if pool is None and streamed:
        pool = PinnedPool(None, slab_bytes=max(256 << 20, max(sizes) + 4096),
                          pinned=True if device.type == "cuda" else "auto")
        if pool.page_locked:
            pool.reserve_for([p.numel() * p.element_size() for i in streamed for p in units[i].parameters()])
    window = WeightWindow(inner, units, streamed, device, depth, pool, measure=measure)
    window.adjustable = stream == "auto"
    _WINDOWS[inner] = window
    return window
