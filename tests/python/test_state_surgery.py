"""What scripts do to optimizer.state besides stepping: clear it, remove or empty an entry, put other
tensors in it, replace the dict itself. HybridAdamW must do what torch's AdamW does with each (fresh
state where it was removed, the new values where tensors were replaced) and never touch memory the
loop let go of (the native table points at the state's buffers). Each case: HybridAdamW's loop run to
the end, then torch's AdamW(foreach=False) loop on the same model and data, weights compared after
every step; with and without ``model=``."""

from collections import defaultdict

import pytest
import torch

import hytrain

STEPS, AT = 7, 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _surgery(opt, how, model):
    p = next(model.parameters())
    if how == "clear":
        opt.state.clear()
    elif how == "del_entry":
        del opt.state[p]
    elif how == "empty_entry":
        opt.state[p] = {}
    elif how == "step_reset":
        for q in model.parameters():
            opt.state[q]["step"] = torch.tensor(0.0)
    elif how == "moments_replaced":
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
        opt.state[p]["exp_avg_sq"] = torch.full_like(p, 1e-4)
    elif how == "new_dict":
        opt.state = defaultdict(dict)
    else:
        raise AssertionError(how)


def _train(make_opt, how, with_model):
    model = _model()
    opt = make_opt(model, with_model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]
    weights = []
    for i, (x, y) in enumerate(data):
        if i == AT:
            _surgery(opt, how, model)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        weights.append([q.detach().clone() for q in model.parameters()])
    return weights, opt


def _hybrid(model, with_model):
    return hytrain.HybridAdamW(model.parameters(), lr=3e-2, weight_decay=0.01, model=model if with_model else None)


def _torch(model, _):
    return torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01, foreach=False)


HOW = ["clear", "del_entry", "empty_entry", "step_reset", "moments_replaced", "new_dict"]


@pytest.mark.parametrize("with_model", [False, True], ids=["plain", "model"])
@pytest.mark.parametrize("how", HOW)
def test_state_surgery_as_torch(how, with_model):
    got, opt = _train(_hybrid, how, with_model)
    want, ref = _train(_torch, how, with_model)
    for step, (a, b) in enumerate(zip(got, want), 1):
        for i, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{how}, step {step}, param {i}: {m}")
    # The state reads as torch's: every parameter's counter, and the moments of the one operated on.
    for p, q in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"]):
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"])
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-5, atol=1e-7)


def test_a_replaced_tensor_of_the_wrong_size_is_refused_and_changes_nothing():
    model = _model()
    opt = _hybrid(model, True)
    x = torch.randn(8, 16)
    model(x).sum().backward()
    opt.step()
    p = next(model.parameters())
    before = opt.state_dict()
    kept = {q: [t.clone() for t in opt.state[q].values()] for q in model.parameters()}
    opt.state[p]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"optimizer.state\[p\]\['exp_avg'\] of parameter 0 was replaced by a tensor "
                                         r"of 3 elements"):
        opt.step()
    opt.state[p]["exp_avg"] = kept[p][1].clone()  # the loop puts a good one back: nothing else had changed
    for q in model.parameters():
        assert all(torch.equal(a, b) for a, b in zip(opt.state[q].values(), kept[q]))
    del opt.state[p]["exp_avg_sq"]
    with pytest.raises(KeyError, match="lost 'exp_avg_sq'"):
        opt.zero_grad()
    opt.state[p] = {}
    opt.step()  # that parameter starts afresh
    assert float(opt.state[p]["step"]) == 1.0 and before["state"][0]["step"] == 1.0
