"""HybridAdamW's parts, each built and checked on its own on the CPU: the block plan from a module,
the state store from a list of parameters and a pool, the gradient intake's norm and clips, the
planner from recorded costs."""

import math

import pytest
import torch
from torch import nn

import hytrain
from hytrain._native import native
from hytrain.blocks import detect_blocks
from hytrain.hybrid.intake import GradientIntake
from hytrain.hybrid.plan import BlockPlan
from hytrain.hybrid.planner import Planner, first_backward, first_split
from hytrain.hybrid.settings import settings
from hytrain.hybrid.store import StateStore
from hytrain.models import LlamaConfig, LlamaModel

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2, num_kv_heads=2,
                  max_seq_len=32)


def make_settings(**kw):
    base = dict(max_grad_norm=None, release_grads=None, accumulation_steps=1, gpu_blocks="auto", schedule_every=1,
                gpu_memory_limit=None, speculate="auto", host_memory_limit=None, fence=True, overlap=True,
                workers=1, slice_elements=1 << 18, trace=False, pool=None, model=None, blocks=None,
                bucket_elements=4 << 20)
    base.update(kw)
    return settings(**base)


def groups_of(params, **kw):
    return [dict(params=list(params), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 maximize=False, **kw)]


def test_the_block_plan_from_a_module():
    torch.manual_seed(0)
    model = LlamaModel(CFG)
    frozen = model.embed.weight if hasattr(model, "embed") else next(model.parameters())
    frozen.requires_grad_(False)
    groups = groups_of(model.parameters())
    plan = BlockPlan(groups, model=model)
    params = [p for p in model.parameters() if p.requires_grad]
    assert plan.params == params and plan.frozen == [frozen]
    assert plan.blocks == detect_blocks(model, params)
    assert len(plan) == len(plan.blocks) >= CFG.num_layers
    for i, p in enumerate(params):
        assert plan.index(p) == i and plan.group(p) is groups[0]
        assert any(q is p for q in plan.blocks[plan.block_of[id(p)]])
    assert plan.of_handles(plan.handles(params[:3])) == params[:3]
    numel, weight, state = plan.sizes()
    assert sum(numel) == sum(p.numel() for p in params)
    assert weight == [sum(p.numel() * 4 for p in b) for b in plan.blocks]
    assert state == [sum(p.numel() * (8 + 4) for p in b) for b in plan.blocks]  # m, v, the gradient buffer
    buckets = BlockPlan(groups, bucket_elements=1000)
    assert [p for b in buckets.blocks for p in b] == params
    with pytest.raises(ValueError, match="no parameter that requires gradients"):
        BlockPlan(groups_of([nn.Parameter(torch.zeros(2), requires_grad=False)]))
    with pytest.raises(ValueError, match="in no block"):
        BlockPlan(groups, blocks=[params[:2]])


def test_the_state_store_from_parameters_and_a_pool():
    torch.manual_seed(1)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7).to(torch.bfloat16))]
    groups = groups_of(params, foreach=None, capturable=False, differentiable=False, fused=None)
    plan = BlockPlan(groups, bucket_elements=1)
    pool = hytrain.PinnedPool(1 << 22, pinned=False)
    rt = native().BlockRuntime([len(b) for b in plan.blocks], 1)
    state = {}
    import collections
    state = collections.defaultdict(dict)
    store = StateStore(plan, make_settings(pool=pool), rt, state, wait=lambda ids: None)
    store.prepare()
    assert store.host_floor() == 0  # the pool holds all of it
    store.create(groups, 0)
    assert store.device == torch.device("cpu") and not store.cuda and store.pool is pool
    fp32, bf16 = (state[p] for p in params)
    assert set(fp32) == {"step", "exp_avg", "exp_avg_sq"}  # fp32 on the CPU: the weight is its master
    assert set(bf16) == {"step", "exp_avg", "exp_avg_sq", "master"}
    assert torch.equal(bf16["master"], params[1].detach().float())
    assert pool.stats()["in_use"] > 0
    assert store.sync_groups(groups) is False and store.sync_groups(groups) is False
    groups[0]["lr"] = 2e-3
    assert store.sync_groups(groups) is True  # the table had other values
    store.writes.note()  # as Engine.bind does once the state is made
    entry = {"exp_avg": torch.full((7,), 0.5), "exp_avg_sq": torch.full((7,), 0.25), "step": torch.tensor(3.0)}
    store.load_entries({params[1]: entry}, reset_missing=True)
    assert torch.equal(bf16["exp_avg"], entry["exp_avg"]) and float(bf16["step"]) == 3.0
    assert float(fp32["step"]) == 0.0 and not fp32["exp_avg"].any()
    with torch.no_grad():
        params[1].add_(1)
    assert store.writes.written() == [params[1]]
    store.writes.refresh([params[1]])
    assert torch.equal(bf16["master"], params[1].detach().float()) and store.writes.written() == []
    params[0].data = params[0].data.double()
    with pytest.raises(RuntimeError, match="Moving or casting"):
        store.check_bound(params[0])
    assert store.shadows.allocate(1) and store.shadows.has(1) and not store.shadows.has(0)
    store.clear()
    assert not state and store.bound is None


def test_the_host_floor_from_the_room_the_host_gives():
    """The host holds the states of the blocks from its floor on; k never goes below it. Without
    CUDA nothing can live elsewhere: a state the host cannot hold is refused before anything is made."""
    params = [nn.Parameter(torch.randn(1000)) for _ in range(4)]
    groups = groups_of(params, foreach=None, capturable=False, differentiable=False, fused=None)
    plan = BlockPlan(groups, bucket_elements=1)
    assert len(plan) == 4
    per_block = 2 * 4096  # m and v, fp32, on the CPU (the fp32 weight is its own master), 256-byte aligned

    def store_with(capacity):
        pool = hytrain.PinnedPool(capacity, pinned=False)
        rt = native().BlockRuntime([1] * 4, 1)
        import collections
        store = StateStore(plan, make_settings(pool=pool), rt, collections.defaultdict(dict), wait=lambda ids: None)
        store.prepare()
        return store, pool

    store, pool = store_with(4 * per_block)
    assert store.block_host_bytes() == [per_block] * 4 and store.host_floor() == 0
    store, pool = store_with(4 * per_block - 1)
    with pytest.raises(hytrain.CapacityError, match=r"needs 32\.00 KiB of pinned host memory .* the pool given has room for \d+\.\d\d KiB: pass a pool "
                       r"with a larger capacity"):
        store.host_floor()
    assert pool.stats()["in_use"] == 0 and not store.state
    # As for CUDA parameters (their state has a master and staging too): the floor rises as the
    # host's room shrinks, block by block from the first.
    store.cuda = True
    per_block = 4 * 4096  # m, v, master and fp32 staging
    assert store.block_host_bytes() == [per_block] * 4
    for capacity, floor in ((4 * per_block, 0), (4 * per_block - 1, 1), (2 * per_block, 2), (per_block - 1, 4)):
        store.settings.pool = hytrain.PinnedPool(capacity, pinned=False)
        assert store.host_floor() == floor == store.floor, capacity


def test_the_intake_norm_and_chained_clips():
    torch.manual_seed(2)
    params = [nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(6))]
    groups = groups_of(params)
    plan = BlockPlan(groups, bucket_elements=1)
    rt = native().BlockRuntime([len(b) for b in plan.blocks], 1)
    arrived = []
    intake = GradientIntake(plan, make_settings(), rt, store=None, shard_group=None,
                            arrived=lambda b, complete: arrived.append((b, complete)))
    grads = [torch.randn(4), torch.randn(6)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
    assert intake.global_norm() == pytest.approx(norm)
    assert intake.clip(norm / 2, False) == pytest.approx(norm)
    assert intake.clip(norm / 4, False) == pytest.approx(norm / 2, rel=1e-5)  # the norm after the first clip
    assert intake.multiplier() == pytest.approx(0.25, rel=1e-5) and intake.last_grad_norm == pytest.approx(norm)
    intake.apply_pending_clips()  # more gradients are coming: the clips go into .grad
    torch.testing.assert_close(params[0].grad, grads[0] * 0.25, rtol=1e-5, atol=1e-6)
    intake.end_step()
    assert intake.multiplier(0.5) == 0.5  # no clip asked for: the loss scale only
    # The same clips on gradients still scaled by 8 (a GradScaler leaving the unscaling to the step):
    # the norms, the factor applied to .grad and the step's multiplier are those of the unscaled ones.
    for p, g in zip(params, grads):
        p.grad = g * 8.0
    assert intake.clip(norm / 2, False, 8.0) == pytest.approx(norm)
    assert intake.clip(norm / 4, False, 8.0) == pytest.approx(norm / 2, rel=1e-5)
    assert intake.multiplier(1 / 8.0) == pytest.approx(0.25 / 8.0, rel=1e-5)
    intake.apply_pending_clips()
    torch.testing.assert_close(params[0].grad, grads[0] * 8.0 * 0.25, rtol=1e-5, atol=1e-6)
    intake.end_step()
    intake.close()


@pytest.mark.parametrize("bad", [None, "inf", "nan"])
def test_released_overflow_reaches_a_grad_scaler(bad):
    # Blocks handed off during backward under loss scaling give up .grad: a GradScaler must still
    # find an overflow in them (skip, back off) and none where there is none (step, keep the scale),
    # through the stand-in gradient merged in at the backward's end. Gradients at fp16's largest
    # finite value are not an overflow.
    torch.manual_seed(3)
    params = [nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3, 3))]
    plan = BlockPlan(groups_of(params), bucket_elements=1)
    assert len(plan) == 3
    rt = native().BlockRuntime([len(b) for b in plan.blocks], 1)
    intake = GradientIntake(plan, make_settings(release_grads=True), rt, store=None, shard_group=None,
                            arrived=lambda b, complete: None)

    def hand_off(p):  # what the launcher does for blocks 1 and 2 (block 0 keeps its gradient)
        b = plan.block_of[id(p)]
        if b > 0:
            intake.handed_off(b, [(p, p.grad)], scaled=True)
            p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(hand_off) for p in params]
    big = torch.finfo(torch.float16).max
    poison = {None: big, "inf": float("inf"), "nan": float("nan")}[bad]
    hooks.append(params[2].register_hook(lambda g: g.index_fill(0, torch.tensor([1]), poison)))
    ref = torch.optim.SGD(params, lr=0.1)
    before = [p.detach().clone() for p in params]
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    loss = params[0].sum() + params[1].square().sum() + params[2].sum()
    scaler.scale(loss).backward()
    assert params[0].grad is not None and params[2].grad is None
    stand_in = params[1]  # the smallest released parameter
    assert stand_in.grad is not None and int((stand_in.grad != 0).sum()) == (0 if bad is None else 1)
    scaler.step(ref)
    scaler.update()
    if bad is None:  # stepped: the kept gradient moved block 0; the stand-in's zero gradient nothing
        assert scaler.get_scale() == 4.0 and not torch.equal(params[0], before[0])
        assert torch.equal(params[1], before[1])
    else:  # skipped, the scale backed off
        assert scaler.get_scale() == 2.0 and all(torch.equal(p, q) for p, q in zip(params, before))
    for h in hooks:
        h.remove()
    intake.close()


class _RecordedMeter:
    """A meter that hands the scheduler recorded per-block costs and a recorded memory peak."""

    def __init__(self, costs, peak):
        self.costs, self.peak, self.pending, self.current = costs, peak, None, None
        self.retries = 0  # the allocator's retries the next harvested iteration reports

    def end_iteration(self):
        return "recorded"

    def harvest(self, record, scheduler):
        for j, per_phase in enumerate(self.costs):
            for phase, t in per_phase.items():
                scheduler.observe(j, phase, t)
        return {"iter_s": 0.1, "gpu_wait_frac": 0.2, "nonstate_peak_bytes": self.peak, "alloc_retries": self.retries}


class _Store:
    cuda, device, made_s = True, torch.device("cpu"), None
    shadows = type("NoShadows", (), {"work_log": (), "trim_due": False})()

    def __init__(self):
        self.moves = []

    def migrate(self, k):
        self.moves.append(k)


def test_the_planner_from_recorded_costs():
    L = 8
    plan = BlockPlan(groups_of([nn.Parameter(torch.zeros(10**6)) for _ in range(L)]), bucket_elements=1)
    s = make_settings(speculate=False)
    store = _Store()
    planner = Planner(plan, s, native().BlockRuntime([1] * L, 1), store)
    P = native().Phase
    costs = [{P.forward: 1e-3, P.backward: 2e-3, P.cpu: 8e-3, P.gpu: 0.5e-3, P.d2h: 0.4e-3, P.h2d: 0.4e-3}] * L
    sched = native().KSplitScheduler(*plan.sizes(), every=1, deferred=True)
    limit = 8 << 30
    planner.attach(_RecordedMeter(costs, peak=2 << 30), sched, limit)
    planner.after_step(early_copies=False, speculation_allowed=False)
    margin = (1 << 30) + limit // 20
    assert sched.memory_budget == float(limit - (2 << 30) - margin)
    k = store.moves[-1]
    assert 0 < k <= L and k == sched.last_prediction()["k"]
    stats = planner.stats()
    assert stats["iter_s"] == 0.1 and stats["predicted_iter_s"] == sched.last_prediction()["iter_s"]
    assert stats["state_budget_bytes"] == sched.memory_budget and planner.spec_from is None


class _PagedShadows:
    """Shadows in a page-locking pool: ``free`` bytes locked and unused; a background reservation
    locks what is short, and is done when the test says (``finish``); so is a background trim."""

    def __init__(self, sizes, free):
        self.sizes, self.free, self.made, self.in_flight, self.started = sizes, free, set(), 0, 0
        self.trims, self.trimming, self.ahead, self.trim_due, self.given = 0, False, None, False, False

    def trim_later(self):
        self.trim_due = not self.given  # (a pool the caller gave is not trimmed)

    def has(self, b):
        return b in self.made

    def need(self, b):
        return 0 if b in self.made else self.sizes[b]

    def free_room(self):
        return self.free

    def reserve_ahead(self, blocks):
        self.ahead = list(blocks)
        short = sum(self.need(b) for b in blocks) - self.free
        self.free += max(0, short)
        return max(0, short)

    def reserve_in_background(self, blocks):
        if self.in_flight or self.trimming:
            return False
        self.in_flight = sum(self.need(b) for b in blocks) - self.free
        self.started += 1
        return self.in_flight > 0

    def trim_in_background(self):
        if self.in_flight or self.trimming:
            return False
        self.trims, self.trimming = self.trims + 1, True
        return True

    def pool_idle(self):
        return not self.in_flight and not self.trimming

    def finish(self):
        self.free, self.in_flight = self.free + self.in_flight, 0
        if self.trimming:
            self.free, self.trimming = 0, False  # the wholly free slabs go

    def allocate(self, b):
        assert not self.in_flight and self.sizes[b] <= self.free  # never beyond what is locked
        self.free -= self.sizes[b]
        self.made.add(b)
        return True


class _ShadowStore:
    def __init__(self, shadows, L=None):
        self.shadows, self.cuda = shadows, True
        self.pool = type("Pool", (), {"page_locked": True})()
        self.on_gpu = 0

    def shadow_plan(self, start):
        return list(range(len(self.shadows.sizes) - 1, max(start, self.on_gpu) - 1, -1))


def _shadow_planner(L, shadows, **kw):
    plan = BlockPlan(groups_of([nn.Parameter(torch.zeros(10)) for _ in range(L)]), bucket_elements=1)
    store = _ShadowStore(shadows)
    return Planner(plan, make_settings(speculate="auto", **kw), native().BlockRuntime([1] * L, 1), store), store


def test_speculation_shadows_wait_for_page_locking_in_the_background():
    """Eight offloaded blocks of 1 GB each to speculate from block 0, in a pool with 2.5 GB locked
    and free: blocks 7 and 6 take their shadows at once, the rest is page-locked in the background
    (the step does not wait), speculation starts at 6 until that is done, then comes down to 0."""
    L, GB = 8, 1 << 30
    shadows = _PagedShadows([GB] * L, free=2 * GB + GB // 2)
    planner, _ = _shadow_planner(L, shadows)
    planner.speculate_from(0, True)
    assert planner.spec_from == 6 and shadows.in_flight == 6 * GB - GB // 2 and shadows.trims == 0
    planner.speculate_from(0, True)  # still locking: nothing more, no second reservation
    assert planner.spec_from == 6 and shadows.started == 1
    shadows.finish()
    planner.speculate_from(0, True)
    assert planner.spec_from == 0 and shadows.started == 1
    assert [n for n, _ in planner.shadow_allocations] == [2, 6]
    planner.speculate_from(None, True)
    assert planner.spec_from is None


def test_what_the_shadows_leave_is_given_back_in_the_background_once_the_speculation_holds():
    """The first step locks the shadows of the last half of the offloaded blocks; speculation takes
    fewer; the locked memory they leave stays while the start may still move (a move within it
    costs no locking) and goes, on the background thread, after QUIET_STEPS steps without shadow
    allocations -- once, and never from a pool the caller gave."""
    from hytrain.hybrid.planner import QUIET_STEPS
    L, GB = 8, 1 << 30
    shadows = _PagedShadows([GB] * L, free=0)
    planner, store = _shadow_planner(L, shadows, gpu_blocks=2)

    def step(start):
        planner.speculate_from(start, True)
        planner.give_back_when_quiet()

    planner.reserve_shadows_ahead()
    assert shadows.ahead == [7, 6, 5] and shadows.free == 3 * GB  # 6 offloaded blocks: the last 3
    step(7)
    step(6)  # within what was locked ahead: carved at once, nothing locked
    assert planner.spec_from == 6 and shadows.started == 0 and shadows.free == GB
    for _ in range(QUIET_STEPS):
        step(6)
        assert shadows.trims == 0
    step(6)
    assert shadows.trims == 1 and planner.spec_from == 6
    shadows.finish()
    assert shadows.free == 0
    for _ in range(2 * QUIET_STEPS):
        step(6)
    assert shadows.trims == 1  # nothing left since
    shadows.trim_later()  # e.g. the host memory of states that went to the GPU: given back once quiet
    for _ in range(QUIET_STEPS + 1):
        step(6)
    assert shadows.trims == 2

    given = _PagedShadows([GB] * L, free=0)
    given.given = True
    planner, _ = _shadow_planner(L, given, gpu_blocks=2, pool=hytrain.PinnedPool(1 << 20))
    planner.reserve_shadows_ahead()
    assert given.ahead is None  # the caller's pool: nothing locked ahead
    for _ in range(3 * QUIET_STEPS):
        planner.speculate_from(7, True)
        planner.give_back_when_quiet()
        given.finish()
    assert given.trims == 0 and planner.spec_from == 7


def test_the_planner_gives_way_where_the_allocator_retried():
    """A slow CPU: every block the budget holds goes to the GPU (5 of 8). An iteration in which the
    caching allocator reached the limit and retried costs one block's room for the rest of the run:
    k goes to 4, and stays there when the retries stop."""
    L = 8
    plan = BlockPlan(groups_of([nn.Parameter(torch.zeros(10**6)) for _ in range(L)]), bucket_elements=1)
    s = make_settings(speculate=False)

    class Store(_Store):
        def migrate(self, k):
            super().migrate(k)
            s.gpu_blocks = k

    store, P = Store(), native().Phase
    planner = Planner(plan, s, native().BlockRuntime([1] * L, 1), store)
    costs = [{P.forward: 1e-3, P.backward: 2e-3, P.cpu: 20e-3, P.gpu: 0.5e-3, P.d2h: 0.4e-3, P.h2d: 0.4e-3}] * L
    sched = native().KSplitScheduler(*plan.sizes(), every=1, deferred=True)
    state = plan.sizes()[2]
    peak, margin = 2 << 30, 1 << 30
    limit = int((peak + margin + sum(state[:5]) + state[5] // 2) / 0.95) + 1  # 5 blocks and a half fit
    meter = _RecordedMeter(costs, peak=peak)
    planner.attach(meter, sched, limit)
    planner.after_step(early_copies=False, speculation_allowed=False)
    assert s.gpu_blocks == 5
    meter.retries = 3
    planner.after_step(early_copies=False, speculation_allowed=False)
    assert s.gpu_blocks == 4 and sched.memory_budget == float(planner._budget(peak))
    assert planner.stats()["alloc_retries"] == 3
    meter.retries = 0
    for _ in range(3):
        planner.after_step(early_copies=False, speculation_allowed=False)
    assert s.gpu_blocks == 4 and store.moves == [5, 4]


def test_the_planner_keeps_k_at_or_above_the_host_floor():
    """A fast CPU: the best k is small. A host floor above it, or a GPU budget below it, leaves k
    at the floor (those states have nowhere else to live)."""
    L = 8
    plan = BlockPlan(groups_of([nn.Parameter(torch.zeros(10**6)) for _ in range(L)]), bucket_elements=1)
    P = native().Phase
    costs = [{P.forward: 1e-3, P.backward: 2e-3, P.cpu: 0.5e-3, P.gpu: 0.5e-3, P.d2h: 0.4e-3, P.h2d: 0.4e-3}] * L
    chosen = {}
    for floor, limit in ((0, 8 << 30), (5, 8 << 30), (5, 3 << 30)):
        store = _Store()
        planner = Planner(plan, make_settings(speculate=False), native().BlockRuntime([1] * L, 1), store)
        sched = native().KSplitScheduler(*plan.sizes(), every=1, deferred=True)
        planner.attach(_RecordedMeter(costs, peak=2 << 30), sched, limit)
        sched.min_k = floor
        planner.after_step(early_copies=False, speculation_allowed=False)
        chosen[floor, limit] = store.moves[-1] if store.moves else 0
    assert chosen[0, 8 << 30] < 5
    assert chosen[5, 8 << 30] == 5
    assert chosen[5, 3 << 30] == 5  # the budget (3 GiB less 2 GiB and the margin) holds none of them


def test_with_accumulation_the_steady_peak_keeps_every_gradient():
    # The first backward's samples (block, memory in use), in the order blocks completed, and the
    # first iteration's whole peak above them (the loss's logits, between samples). Released
    # gradients leave one block at a time later; accumulating, they all stay through the micro-batches
    # before the last, and the loss's peak comes on top of them at every micro-batch: the first
    # iteration's whole peak is the later ones', and the scheduler's budget starts from it (the 7 B
    # run with 10 micro-batches ran out of GPU memory at a later step when the budget came from the
    # samples alone).
    L, n = 4, 10**6
    plan = BlockPlan(groups_of([nn.Parameter(torch.zeros(n)) for _ in range(L)]), bucket_elements=1)
    samples = [(3, 10 * n), (2, 14 * n), (1, 18 * n), (0, 22 * n)]
    peaks, budgets = {}, {}
    for accumulation in (1, 4):
        store = _Store()
        planner = Planner(plan, make_settings(max_grad_norm=1.0, accumulation_steps=accumulation),
                          native().BlockRuntime([1] * L, accumulation), store)
        planner._first_samples = samples
        peaks[accumulation] = planner._steady_peak(25 * n, released=planner.releases_in_backward())
        P = native().Phase
        costs = [{P.forward: 1e-3, P.backward: 2e-3, P.cpu: 8e-3, P.gpu: 0.5e-3, P.d2h: 0.4e-3, P.h2d: 0.4e-3}] * L
        sched = native().KSplitScheduler(*plan.sizes(), every=1, deferred=True)
        planner.attach(_RecordedMeter(costs, peak=20 * n), sched, 8 << 30)  # measured later: the samples' peak
        planner.after_step(early_copies=False, speculation_allowed=False)
        budgets[accumulation] = sched.memory_budget
    assert peaks[1] == 22 * n - 3 * 4 * n  # three blocks' fp32 gradients gone by the last sample
    assert peaks[4] == 25 * n
    limit = 8 << 30
    margin = (1 << 30) + limit // 20
    assert budgets[1] == float(limit - 20 * n - margin)
    assert budgets[4] == float(limit - 25 * n - margin)


def test_the_first_split_defers_what_fits_once_the_gradients_are_released():
    """The first step: k blocks' states fit now, beside every gradient; more fit once the step has
    released the other blocks' gradients, within what later iterations leave (``steady``). A
    deferred block's own gradients still count when its state is made."""
    G = 1 << 30
    states, grads = [3 * G] * 8, [G] * 8
    # 10 GiB free now, 2 GiB margin: two blocks now (6 GiB). Releasing the gradients of the blocks
    # not deferred gives more: a third needs 9 <= 8 + 8 - 1, a fourth 12 <= 8 + 8 - 2, a fifth
    # 15 > 8 + 8 - 3.
    assert first_split(states, grads, free=10 * G, steady=40 * G, margin=2 * G) == (2, 4)
    assert first_split(states, None, free=10 * G, steady=40 * G, margin=2 * G) == (2, 2)
    # Later iterations leave 10 GiB for states: three blocks, whatever the step releases.
    assert first_split(states, grads, free=10 * G, steady=10 * G, margin=2 * G) == (2, 3)
    # Nothing released, nothing deferred; a GPU with no room now defers from block 0.
    assert first_split(states, [0] * 8, free=10 * G, steady=40 * G, margin=2 * G) == (2, 2)
    assert first_split(states, [2 * G] * 8, free=2 * G, steady=40 * G, margin=2 * G) == (0, 3)
    # Exact fits count: 3 x 3 GiB in 9 GiB.
    assert first_split(states, grads, free=11 * G, steady=11 * G, margin=2 * G) == (3, 3)


def test_the_first_backward_keeps_hands_off_or_refuses_by_the_bytes():
    """Decided at the first backward's first gradient: the gradients still to come stay to step()
    where they fit beside a 1 GiB margin; else the state is made at once (blocks below the host's
    floor on the GPU, beside one block's gradients in flight) and they leave block by block; else,
    where the device itself has room (a limit below it governs the states), they stay; else refused."""
    G = 1 << 30
    kw = dict(floor_states=0, transient=G, hands_off=True)
    assert first_backward(40 * G, 41 * G, device_free=41 * G, **kw) == "keep"
    assert first_backward(40 * G, 40 * G, device_free=40 * G, **kw) == "hand off"  # the margin counts
    assert first_backward(40 * G, 39 * G, device_free=39 * G, **dict(kw, floor_states=38 * G)) == "hand off"
    assert first_backward(40 * G, 39 * G, device_free=39 * G, **dict(kw, floor_states=38 * G + 1)) == "refuse"
    assert first_backward(40 * G, 39 * G, device_free=39 * G, **dict(kw, hands_off=False)) == "refuse"
    # A limit below what is allocated already: the state has no room in it, the device has for the
    # gradients, which autograd allocates whatever the limit.
    assert first_backward(40 * G, 0, device_free=41 * G, **kw) == "keep"
    assert first_backward(40 * G, 0, device_free=40 * G, **kw) == "refuse"


def test_the_first_backward_refusal_names_the_bytes_and_the_cause(monkeypatch):
    """Fake budgets: 3 GiB of gradients to come, 2 GiB free. Kept to step() (here by release_grads=False):
    refused naming both sides and the cause; handed off: refused where the host's floor does not fit
    beside the gradients in flight, allowed where it does."""
    model = LlamaModel(CFG)
    opt = hytrain.HybridAdamW(model.parameters(), model=model, release_grads=False)
    planner, G = opt._engine.planner, 1 << 30
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(planner, "_free", lambda device=False: (5 * G, 2 * G + n - 3 * G, 80 * G))
    with pytest.raises(hytrain.CapacityError, match=r"the first backward would keep every block's gradients on the "
                       r"GPU until step\(\) \(release_grads=False\): .* more of them, but .* free beside the 5\.00 GiB"):
        planner.first_backward(0, hands_off=False, why_kept="release_grads=False")
    opt._engine.store.prepare()
    transient = planner._transient()  # room for exactly the gradients in flight
    monkeypatch.setattr(planner, "_free", lambda device=False: (5 * G, transient, 80 * G))
    with pytest.raises(hytrain.CapacityError, match=r"so the first 2 blocks must keep theirs on the GPU"):
        planner.first_backward(2, hands_off=True, why_kept="")
    assert planner.first_backward(0, hands_off=True, why_kept="") is True


def test_states_come_back_to_the_host_only_where_it_has_room(monkeypatch):
    """A lower k brings states back to the host: those that do not fit beside the host's margin
    (the pool's free blocks counted) stay on the GPU, the lowest first, so k rises past them."""
    from hytrain.hybrid import budgets

    params = [nn.Parameter(torch.randn(1000)) for _ in range(4)]
    groups = groups_of(params, foreach=None, capturable=False, differentiable=False, fused=None)
    plan = BlockPlan(groups, bucket_elements=1)
    import collections
    rt = native().BlockRuntime([1] * 4, 1)
    store = StateStore(plan, make_settings(pool=hytrain.PinnedPool(1 << 22, pinned=False)), rt,
                       collections.defaultdict(dict), wait=lambda ids: None)
    store.prepare()
    store.create(groups, 0)
    up, _ = rt.migrate(4)  # as if every block's state had gone up to the GPU
    for b in up:
        rt.moved_up(b)
    per_block = store.block_host_bytes()[0]
    stats = store.pool.stats()
    free = stats["reserved"] - stats["in_use"]
    monkeypatch.setattr(budgets, "host_margin", lambda available: 1000)
    monkeypatch.setattr(budgets, "available_memory_bytes", lambda: 2 * per_block - free + 1000)
    assert store.host_fit(0) == 2 and store.host_fit(2) == 2 and store.host_fit(3) == 3
    monkeypatch.setattr(budgets, "available_memory_bytes", lambda: 2 * per_block - free + 999)
    assert store.host_fit(0) == 3
    monkeypatch.setattr(budgets, "available_memory_bytes", lambda: None)  # the system does not tell
    assert store.host_fit(0) == 0
