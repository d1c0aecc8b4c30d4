"""`import hytrain_native` as an optimizer replacement: the design card's own entry point. A script
written only against hytrain_native trains and matches torch.optim.AdamW (on the CPU; on the GPU too
where there is one); the names are hytrain's own objects; the module imports without torch or a GPU."""

import subprocess
import sys
import textwrap

import pytest
import torch

import hytrain
import hytrain_native

SCRIPT = textwrap.dedent("""
    import copy, sys
    import torch
    import hytrain_native  # nothing else of hytrain is named

    device = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
    twin = copy.deepcopy(model)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    opt = hytrain_native.HybridAdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, workers=2, model=twin)
    for step in range(6):
        x = torch.randn(8, 16, device=device)
        for m, o in ((model, ref), (twin, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    print("matched", device, sorted(hytrain_native.simd_paths()))
""")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_script_written_against_hytrain_native_matches_torch(device):
    if device == "cuda" and not (torch.cuda.is_available() and hytrain.cuda_available()):
        pytest.skip("needs a GPU")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, device], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"matched {device}" in proc.stdout


def test_the_names_are_hytrains_own_objects():
    assert hytrain_native.HybridAdamW is hytrain.HybridAdamW
    assert hytrain_native.CapacityError is hytrain.CapacityError
    assert hytrain_native.PoolExhaustedError is hytrain.PoolExhaustedError
    assert hytrain_native.DeviceTimeoutError is hytrain.DeviceTimeoutError
    assert hytrain_native.simd_paths is hytrain.simd_paths
    assert hytrain_native.stream_model is hytrain.stream_model
    assert "HybridAdamW" in dir(hytrain_native) and "UpdateEngine" in dir(hytrain_native)
    with pytest.raises(AttributeError, match="hytrain_native' has no attribute 'AdamW'"):
        hytrain_native.AdamW


def test_import_needs_neither_torch_nor_a_gpu():
    code = ("import sys, hytrain_native as h; assert 'torch' not in sys.modules and 'hytrain' not in sys.modules; "
            "print(h.__doc__.splitlines()[0]); print(h.cuda_available())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["hytrain's native core, and its optimizer under the same names as in hytrain.",
                                        "False"]


def test_help_says_where_the_optimizer_is():
    import pydoc

    text = pydoc.render_doc(hytrain_native, renderer=pydoc.plaintext)
    head = "\n".join(text.splitlines()[:12])
    assert "hytrain_native.HybridAdamW" in head and "torch.optim.AdamW" in head, head
