"""The k-split scheduler through the bindings (its own behaviour is tested in tests/cpp/test_ksplit.cpp),
and HybridAdamW's gpu_blocks argument on the CPU."""

import pytest
import torch

import hytrain
from hytrain._native import native
from hytrain.models import LlamaModel
from test_hybrid_adam import CFG


def scheduler(L=16, cpu=8e-3, gpu=0.5e-3, fwd=1e-3, bwd=2e-3, **kw):
    s = native().KSplitScheduler([10**6] * L, [2 * 10**6] * L, [14 * 10**6] * L, **kw)
    P = native().Phase
    for j in range(L):
        for phase, t in ((P.forward, fwd), (P.backward, bwd), (P.cpu, cpu), (P.gpu, gpu),
                         (P.d2h, 0.4e-3), (P.h2d, 0.4e-3)):
            s.observe(j, phase, t)
    return s


def test_decide_predict_and_budget():
    s = scheduler()
    assert s.ready() and s.blocks == 16
    k = s.decide(0)
    p = s.last_prediction()
    assert p["k"] == k and 0 < k <= 16
    assert p["iter_s"] == pytest.approx(s.predict(k)["iter_s"])
    assert p["iter_s"] <= s.predict(0)["iter_s"]
    assert p["gpu_idle_s"] == pytest.approx(p["iter_s"] - p["gpu_busy_s"])
    assert len(s.costs()) == 16 and len(p["ready"]) == 16
    s.memory_budget = 3.5 * 14 * 10**6
    assert s.max_k() == 3 and s.decide(k) == min(k, 3)
    slower = scheduler(cpu=16e-3)
    assert slower.decide(0) >= k
    assert native().KSplitScheduler.closed_form_k(10, 5.0, 1.0, 0.25) == pytest.approx(4.0)


def test_speculation_through_the_bindings():
    s = scheduler(cpu=20e-3)
    s.deferred, s.early_copies = True, True
    assert s.speculative_min is None and s.predict(2)["speculative_from"] is None
    none = s.predict(2)["iter_s"]
    s.speculative_min = 0
    best = s.predict(2)
    assert best["iter_s"] <= none and 2 <= best["speculative_from"] <= 15
    s.speculative_fixed = True
    fixed = s.predict(2)
    assert s.speculative_fixed and fixed["speculative_from"] == 2 and fixed["iter_s"] >= best["iter_s"]
    s.speculative_min = None
    assert s.predict(2)["speculative_from"] is None


def test_bad_input_raises():
    with pytest.raises(RuntimeError, match="one entry per block"):
        native().KSplitScheduler([1, 2], [1], [1, 2])
    s = scheduler()
    with pytest.raises(RuntimeError, match="block 99"):
        s.observe(99, native().Phase.cpu, 1.0)
    with pytest.raises(RuntimeError, match="finite"):
        s.observe(0, native().Phase.cpu, float("nan"))
    with pytest.raises(RuntimeError, match="k=17"):
        s.predict(17)


def test_hybrid_adamw_gpu_blocks_argument_on_the_cpu():
    model = LlamaModel(CFG)
    opt = hytrain.HybridAdamW(model.parameters(), model=model)  # default "auto": k = 0 on the CPU
    assert opt.auto and opt.gpu_blocks == 0 and opt.schedule_stats()["k"] == 0
    with pytest.raises(ValueError, match="'auto'"):
        hytrain.HybridAdamW(model.parameters(), model=model, gpu_blocks="most")
    with pytest.raises(ValueError, match="needs CUDA"):
        hytrain.HybridAdamW(model.parameters(), model=model, gpu_blocks=1).step()  # at the first step
    with pytest.raises(ValueError, match="gpu_memory_limit"):
        hytrain.HybridAdamW(model.parameters(), model=model, gpu_memory_limit=0)
