"""What scripts do to an optimizer besides step() (test_state_surgery.py, test_script_paths.py), on
CUDA bf16 parameters at k = 0, 2 and auto, with and without clipping (speculative updates during
backward): each case run with HybridAdamW(model=...) overlapping the next forward, then with the same
optimizer updating inside ``step()`` (``overlap=False``, the same kernels), weights compared bit for
bit; and the writes' effect checked against its rule on its own (both runs could share a mistake)."""

import copy
import io
import threading
from collections import defaultdict

import pytest
import torch

import hytrain
from test_torch_contract import Net, batches
from test_torch_contract import train as loop

pytestmark = pytest.mark.gpu

KS = [0, 2, "auto"]
CLIP = pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])


def build():
    torch.manual_seed(0)
    return Net(d=256, wide=1024, layers=4).cuda().to(torch.bfloat16)


def run_both(case, k, clip, make=build, **kw):
    model = make()
    ref = copy.deepcopy(model)
    kw = dict(lr=1e-3, weight_decay=0.1, gpu_blocks=k, max_grad_norm=clip, **kw)
    opt = hytrain.HybridAdamW(model.parameters(), model=model, **kw)
    ref_opt = hytrain.HybridAdamW(ref.parameters(), model=ref, overlap=False, **kw)
    xs = [x.cuda().to(torch.bfloat16) for x in batches(6)]
    got = case(model, opt, xs)
    want = case(ref, ref_opt, xs)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())
    return got, want


def _surgery(opt, model, how):
    p = model.embed.weight
    if how == "clear":
        opt.state.clear()
    elif how == "del_entry":
        del opt.state[p]
    elif how == "step_reset":
        for q in model.parameters():
            opt.state[q]["step"] = torch.tensor(0.0)
    elif how == "moments_replaced":
        opt.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        opt.state[p]["exp_avg_sq"] = torch.full_like(p, 1e-4, dtype=torch.float32)
    elif how == "new_dict":
        opt.state = defaultdict(dict)


@pytest.mark.parametrize("k", KS)
@CLIP
@pytest.mark.parametrize("how", ["clear", "del_entry", "step_reset", "moments_replaced", "new_dict"])
def test_state_surgery_on_the_gpu(how, clip, k):
    def case(model, opt, xs):
        loop(model, opt, xs, after_step=lambda i: _surgery(opt, model, how) if i == 2 else None)
    run_both(case, k, clip)


def _write(model, how):
    if how == "data_zero":
        model.layers[1].up.weight.data.zero_()
    elif how == "data_clamp":
        for p in model.parameters():
            p.data.clamp_(-0.02, 0.02)
    elif how == "data_assigned":
        model.embed.weight.data = torch.zeros_like(model.embed.weight)


@pytest.mark.parametrize("k", KS)
@CLIP
@pytest.mark.parametrize("when", ["after_step", "before_step"])
@pytest.mark.parametrize("how", ["data_zero", "data_clamp", "data_assigned"])
def test_weight_writes_on_the_gpu(how, when, clip, k):
    if how == "data_assigned" and when == "before_step" and clip:
        pytest.skip("new storage between backward and step() with released gradients is refused (README)")

    def case(model, opt, xs):
        loop(model, opt, xs, after_step=(lambda i: _write(model, how) if i == 2 else None) if when == "after_step"
             else None, before_step=(lambda i: _write(model, how) if i == 2 else None) if when == "before_step" else None)
    run_both(case, k, clip)


@pytest.mark.parametrize("k", KS)
def test_a_zeroed_weight_moves_by_one_step_only_on_the_gpu(k):
    model = build()
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, gpu_blocks=k)
    xs = [x.cuda().to(torch.bfloat16) for x in batches(3)]
    loop(model, opt, xs[:2])
    for p in model.parameters():
        p.data.zero_()  # right after step(): the fence waits for the updates in flight first
    loop(model, opt, xs[2:])
    assert max(float(p.detach().abs().max()) for p in model.parameters()) <= 1.1e-3


@pytest.mark.parametrize("k", KS)
def test_load_hooks_pickling_and_a_swapped_parameter_on_the_gpu(k):
    def case(model, opt, xs):
        opt.register_load_state_dict_pre_hook(lambda o, sd: {**sd, "param_groups": [
            {**g, "lr": 5e-4} for g in sd["param_groups"]]})

        def after(i):
            if i == 1:
                opt.load_state_dict(opt.state_dict())
            if i == 2:
                buf = io.BytesIO()
                torch.save(model, buf)
                copy.deepcopy(model)
            if i == 3:
                fresh = torch.nn.Parameter(torch.full_like(model.head.weight, 0.01))
                model.head.weight = fresh
                opt.param_groups[0]["params"][-2] = fresh
        loop(model, opt, xs, after_step=after)
        assert opt.param_groups[0]["lr"] == 5e-4
    run_both(case, k, None)


class ConvNet(torch.nn.Module):
    """A stem, repeated convolutions (blocks the planner finds), a head."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.layers = torch.nn.ModuleList(torch.nn.Conv2d(32, 32, 3, padding=1) for _ in range(3))
        self.head = torch.nn.Conv2d(32, 4, 3)

    def forward(self, x):
        h = self.stem(x)
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return self.head(h)


def conv_model():
    torch.manual_seed(0)
    return ConvNet().cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)


@pytest.mark.parametrize("k", KS)
def test_channels_last_on_the_gpu(k):
    def case(model, opt, xs):
        assert not model.stem.weight.is_contiguous()
        g = torch.Generator(device="cuda").manual_seed(0)
        for _ in range(4):
            x = torch.randn(2, 16, 12, 12, device="cuda", generator=g).to(torch.bfloat16)
            model(x.to(memory_format=torch.channels_last)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    run_both(case, k, None, make=conv_model)


@pytest.mark.parametrize("k", KS)
def test_another_thread_after_synchronize_on_the_gpu(k):
    model = build()
    ref = copy.deepcopy(model)
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, gpu_blocks=k)
    ref_opt = hytrain.HybridAdamW(ref.parameters(), lr=1e-3, model=ref, gpu_blocks=k, overlap=False)
    for x in batches(4):
        x = x.cuda().to(torch.bfloat16)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).float().backward()
            o.step()
            o.zero_grad()
        opt.synchronize()
        torch.cuda.current_stream().synchronize()
        seen = []
        t = threading.Thread(target=lambda: seen.append([p.detach().clone() for p in model.parameters()]))
        t.start()
        t.join()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(seen[0], ref.parameters()))


def test_cuda_fingerprints_equal_the_host_ones():
    """The device kernel against the host function (itself checked against fingerprint.h's definition
    in test_script_paths.py and ctest), on fresh random bytes: aligned and unaligned spans, odd
    lengths, chunk edges, many spans in one launch."""
    from hytrain._native import native

    g = torch.Generator().manual_seed(torch.seed() % (1 << 62))
    host = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g)
    dev = host.cuda()
    spans = [(0, 0), (0, 1), (1, 2), (3, 5), (16, 4096), (17, 4097), (0, 2 * 65536), (2, 2 * 65536 + 1),
             (5, (1 << 20) + 3), (64, (3 << 20) - 64)]
    group = native().CudaFingerprintGroup([(dev.data_ptr() + off, n) for off, n in spans], dev.device.index)
    out = torch.zeros(len(spans), dtype=torch.int64, device="cuda")
    group.compute(out.data_ptr(), torch.cuda.current_stream().cuda_stream)
    got = [x % (1 << 64) for x in out.tolist()]
    want = [native().fingerprint(host.data_ptr() + off, n) for off, n in spans]
    assert got == want
    # The spans passed with the launch (gradients: new addresses every step), more than one launch's
    # 32 of them, into a buffer that held something else.
    many = spans * 4
    out = torch.full((len(many),), 7, dtype=torch.int64, device="cuda")
    native().cuda_fingerprint_spans([(dev.data_ptr() + off, n) for off, n in many], out.data_ptr(),
                                    dev.device.index, torch.cuda.current_stream().cuda_stream)
    assert [x % (1 << 64) for x in out.tolist()] == want * 4
