"""The torch.optim contract on CUDA parameters: bf16 weights, fp32 masters, k = 0, 2 and auto. Each case
is run with HybridAdamW(model=...) and then with the same optimizer updating inside ``step()``
(``overlap=False``, the same kernels), and the weights compared bit for bit: what overlaps the next
forward must never be seen by any other path to the weights or gradients."""

import copy

import pytest
import torch

import hytrain
from test_torch_contract import Net, batches, functional_forward, parts_forward
from test_torch_contract import train as loop

pytestmark = pytest.mark.gpu

KS = [0, 2, "auto"]


def cuda_net(make=Net):
    def build():
        torch.manual_seed(0)
        return make(d=256, wide=1024, layers=4).cuda().to(torch.bfloat16)
    return build


def run_both(case, k, make=None, **kw):
    build = make or cuda_net()
    model = build()
    ref = copy.deepcopy(model)
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, model=model, gpu_blocks=k, **kw)
    ref_opt = hytrain.HybridAdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, model=ref, gpu_blocks=k,
                                  overlap=False, **kw)
    xs = [x.cuda().to(torch.bfloat16) for x in batches(5)]
    got = case(model, opt, xs)
    want = case(ref, ref_opt, xs)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())
    return got, want


@pytest.mark.parametrize("k", KS)
def test_ema_right_after_step(k):
    def case(model, opt, xs):
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        loop(model, opt, xs, after_step=lambda i: ema.update_parameters(model))
        return [p.detach().clone() for p in ema.parameters()]
    got, want = run_both(case, k)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("k", KS)
def test_grad_zeroed_in_place_and_rollback(k):
    def case(model, opt, xs):
        saved = {n: v.clone() for n, v in model.state_dict().items()}

        def after(i):
            if i == 1:
                model.load_state_dict(saved)

        def zero():
            model.zero_grad(set_to_none=False)
        loop(model, opt, xs, after_step=after, zero=zero)
    run_both(case, k)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("forward", [functional_forward, parts_forward], ids=["functional", "parts"])
def test_parameters_used_outside_their_layers(k, forward):
    run_both(lambda m, o, xs: loop(m, o, xs, forward=forward), k)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("clip", [None, 0.5])
def test_lr_set_between_backward_and_step(k, clip):
    def case(model, opt, xs):
        def set_lr(i):
            for g in opt.param_groups:
                g["lr"] = 1e-3 / (i + 1)
        loop(model, opt, xs, before_step=set_lr)
    run_both(case, k, max_grad_norm=clip)


@pytest.mark.parametrize("k", KS)
def test_maximize_on_the_gpu(k):
    run_both(lambda m, o, xs: loop(m, o, xs), k, maximize=True)


@pytest.mark.parametrize("k", [0, 2])
def test_compiled_model_on_the_gpu(k):
    def build():
        torch.manual_seed(0)
        return Net(d=256, wide=1024, layers=4).cuda().to(torch.bfloat16)

    def case(model, opt, xs):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager")
        loop(compiled, opt, xs)
    run_both(case, k, make=build)


@pytest.mark.parametrize("k", [0, 2])
def test_refused_step_changes_nothing_on_the_gpu(k):
    torch.manual_seed(0)
    model = Net(d=256, wide=1024, layers=4).cuda().to(torch.bfloat16)
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-3, model=model, gpu_blocks=k)
    xs = [x.cuda().to(torch.bfloat16) for x in batches(3)]
    loop(model, opt, xs[:2])
    model(xs[2]).float().backward()
    weights = [p.detach().clone() for p in model.parameters()]
    # A non-finite norm after the blocks were handed off (held, or speculated and already writing).
    model.layers[0].up.weight.grad[0, 0] = float("inf")
    opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    del opt
