"""Bad arguments get a TypeError/ValueError naming the problem before any pointer reaches native
code, and leave every tensor untouched."""

import pytest
import torch

import hytrain


def fresh(n=64):
    return dict(param=torch.randn(n), grad=torch.randn(n), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n))


def call(t, **kw):
    kw.setdefault("step", 1)
    return hytrain.adamw_step(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], **kw)


@pytest.mark.parametrize("name,value,exc,match", [
    ("param", torch.randn(64, dtype=torch.float64), TypeError, "param must have dtype float32"),
    ("param", torch.randn(64).to(torch.bfloat16), TypeError, "param must have dtype float32"),
    ("grad", torch.randint(0, 3, (64,)), TypeError, "grad must have dtype"),
    ("exp_avg", torch.zeros(64, dtype=torch.float16), TypeError, "exp_avg must have dtype"),
    ("exp_avg_sq", [0.0] * 64, TypeError, "exp_avg_sq must be a torch.Tensor"),
    ("grad", torch.randn(65), ValueError, "grad has 65 elements"),
    ("grad", torch.randn(128)[::2], ValueError, "grad must be contiguous"),
    ("exp_avg_sq", torch.zeros(8, 8).t(), ValueError, "exp_avg_sq must be contiguous"),
    ("param", torch.empty(64, device="meta"), ValueError, "param must be on the cpu device"),
    ("grad", torch.zeros(64).to_sparse(), ValueError, "grad must be a dense"),
])
def test_bad_tensor_arguments(name, value, exc, match):
    t = fresh()
    before = {k: v.clone() for k, v in t.items()}
    t[name] = value
    with pytest.raises(exc, match=match):
        call(t)
    for k, v in before.items():
        if k != name:
            assert torch.equal(t[k], v), f"{k} changed by a rejected call"


def test_same_element_count_in_another_shape_is_accepted():
    t = fresh()
    t["exp_avg"] = torch.zeros(8, 8)  # states may be flat or shaped like the weight
    call(t)
    assert t["exp_avg"].abs().sum() > 0


def test_misaligned_tensor_is_rejected():
    buf = bytearray(64 * 4 + 8)
    misaligned = torch.frombuffer(buf, dtype=torch.float32, offset=2, count=64)
    assert misaligned.data_ptr() % 4 != 0
    t = fresh()
    t["exp_avg"] = misaligned
    with pytest.raises(ValueError, match="exp_avg is not aligned"):
        call(t)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(step=0), ValueError, "step must be >= 1"),
    (dict(step=1.5), TypeError, "step must be an integer"),
    (dict(lr=-1e-3), ValueError, "lr must be >= 0"),
    (dict(lr=float("nan")), ValueError, "lr must be finite"),
    (dict(lr="0.1"), TypeError, "lr must be a real number"),
    (dict(betas=(1.0, 0.999)), ValueError, r"betas\[0\] must be < 1"),
    (dict(betas=(0.9,)), TypeError, "betas must be a pair"),
    (dict(eps=-1e-8), ValueError, "eps must be >= 0"),  # 0 is accepted, as torch does
    (dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0"),
    (dict(grad_scale=float("inf")), ValueError, "grad_scale must be finite"),
    (dict(num_threads=0), ValueError, "num_threads must be >= 1"),
    (dict(simd="avx1024"), ValueError, "simd must be one of"),
    (dict(amsgrad=True), ValueError, "max_exp_avg_sq is required"),
    (dict(max_exp_avg_sq=torch.zeros(64)), ValueError, "amsgrad=False"),
    (dict(param_copy=torch.empty(64)), TypeError, "param_copy must have dtype bfloat16, float16"),
    (dict(param_copy=torch.empty(63, dtype=torch.bfloat16)), ValueError, "param_copy has 63"),
])
def test_bad_scalar_and_optional_arguments(kw, exc, match):
    t = fresh()
    before = {k: v.clone() for k, v in t.items()}
    with pytest.raises(exc, match=match):
        call(t, **kw)
    for k, v in before.items():
        assert torch.equal(t[k], v)


def test_aliased_tensors_are_rejected():
    t = fresh()
    t["exp_avg_sq"] = t["exp_avg"]
    with pytest.raises(ValueError, match="overlap"):
        call(t)
    t = fresh()
    with pytest.raises(ValueError, match="overlap"):
        call(t, param_copy=t["param"].view(torch.bfloat16)[:64])


def test_native_errors_become_python_exceptions():
    nat = hytrain.native()
    # A raw call that skips the Python checks still gets an exception, not a crash.
    with pytest.raises(RuntimeError, match="step must be >= 1"):
        nat.adamw_step(0, 0, 0, 0, 0, 0, 0, 1, 4, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0, True, False,
                       1.0, 1, "auto", 0, 0, 0)
    with pytest.raises(RuntimeError, match="must be non-null"):
        nat.adamw_step(0, 0, 0, 0, 0, 0, 0, 1, 4, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True, False,
                       1.0, 1, "auto", 0, 0, 0)
    with pytest.raises(RuntimeError, match="unknown SIMD path"):
        nat.adamw_step(0, 0, 0, 0, 0, 0, 0, 1, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True, False,
                       1.0, 1, "neon", 0, 0, 0)
    buf = torch.zeros(64)  # fp16 "states": refused by the native check too
    a = buf.data_ptr()
    with pytest.raises(RuntimeError, match="float32, bfloat16 or 8-bit"):
        nat.adamw_step(a, a + 64, a + 128, 0, a + 192, 0, 0, 1, 8, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True, False,
                       1.0, 1, "auto", 2, 0, 0)
