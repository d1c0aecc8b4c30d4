"""HybridAdamW's param groups are torch's AdamW's: every key torch has, with torch's values, in
``defaults``, ``param_groups`` and ``state_dict()["param_groups"]``, loaded both ways; and its
hyperparameters' ranges are torch's (``eps=0`` included, element for element as torch computes it)."""

import copy

import pytest
import torch

import hytrain


def params(n=2):
    return [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(n)]


KWARGS = [
    {},
    dict(lr=3e-4, betas=(0.8, 0.95), weight_decay=0.1, eps=1e-6),
    dict(lr=1e-2, amsgrad=True, maximize=True, foreach=False, fused=None),
]


@pytest.mark.parametrize("kw", KWARGS, ids=["default", "tuned", "flags"])
def test_defaults_and_groups_have_every_key_of_torchs_with_its_values(kw):
    torch_opt = torch.optim.AdamW(params(), **kw)
    opt = hytrain.HybridAdamW(params(), workers=1, **kw)
    assert opt.defaults == torch_opt.defaults
    want = {k: v for k, v in torch_opt.param_groups[0].items() if k != "params"}
    got = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert got == want
    assert "decoupled_weight_decay" in got and got["decoupled_weight_decay"] is True
    want_sd = torch_opt.state_dict()["param_groups"]
    got_sd = opt.state_dict()["param_groups"]
    assert got_sd == want_sd
    # A group added later gets the defaults as torch's does.
    torch_opt.add_param_group({"params": params(1), "lr": 5e-3})
    opt.add_param_group({"params": params(1), "lr": 5e-3})
    assert ({k: v for k, v in opt.param_groups[1].items() if k != "params"}
            == {k: v for k, v in torch_opt.param_groups[1].items() if k != "params"})


def test_torchs_param_groups_load_into_hybrid_and_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    twin = copy.deepcopy(model)
    x = torch.randn(3, 6)
    ref = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.85, 0.99), weight_decay=0.2)
    for _ in range(2):
        model(x).sum().backward()
        ref.step()
        ref.zero_grad()
    saved = ref.state_dict()
    opt = hytrain.HybridAdamW(twin.parameters(), workers=1)
    opt.load_state_dict(saved)
    assert opt.param_groups[0].keys() == ref.param_groups[0].keys()
    assert opt.state_dict()["param_groups"] == saved["param_groups"]
    back = torch.optim.AdamW(copy.deepcopy(model).parameters())
    back.load_state_dict(opt.state_dict())
    assert back.state_dict()["param_groups"] == saved["param_groups"]
    # torch.optim.Adam's groups (decoupled_weight_decay=False) load into torch's AdamW as AdamW's:
    # the same here.
    adam = torch.optim.Adam(model.parameters(), weight_decay=0.1)
    torch_adamw = torch.optim.AdamW(copy.deepcopy(model).parameters())
    torch_adamw.load_state_dict(adam.state_dict())
    opt.load_state_dict(adam.state_dict())
    assert opt.param_groups[0]["decoupled_weight_decay"] is torch_adamw.param_groups[0]["decoupled_weight_decay"]
    assert opt.state_dict()["param_groups"] == torch_adamw.state_dict()["param_groups"]


def test_decoupled_weight_decay_false_is_refused():
    with pytest.raises(ValueError, match="decoupled_weight_decay must be True"):
        hytrain.HybridAdamW([{"params": params(1), "decoupled_weight_decay": False}], workers=1)
    p = params(1)
    opt = hytrain.HybridAdamW(p, workers=1)
    opt.param_groups[0]["decoupled_weight_decay"] = False  # a loop may set it: refused at the step
    p[0].grad = torch.ones_like(p[0])
    before = p[0].detach().clone()
    with pytest.raises(ValueError, match="decoupled_weight_decay must be True"):
        opt.step()
    assert torch.equal(p[0], before)


def test_eps_range_is_torchs():
    for eps in (-1e-8, -1.0):
        with pytest.raises(ValueError, match="Invalid epsilon value"):
            torch.optim.AdamW(params(1), eps=eps)
        with pytest.raises(ValueError, match="eps must be >= 0"):
            hytrain.HybridAdamW(params(1), eps=eps, workers=1)
    torch.optim.AdamW(params(1), eps=0.0)
    hytrain.HybridAdamW(params(1), eps=0.0, workers=1)
    hytrain.HybridAdamW(params(1), eps=0, workers=1)


class ZeroGradNet(torch.nn.Module):
    """A small net whose embedding rows 6 to 9 are never looked up (their gradients, dense, are
    exactly zero from the first step: m and v stay 0, and with eps=0 their update is 0/0), and a
    parameter the forward does not use, whose gradient the loop sets to zeros."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.idle = torch.nn.Parameter(torch.randn(4))

    def forward(self, ids):
        return self.b(torch.tanh(self.a(self.emb(ids))))


def train_eps_zero_and_compare(model, ref, twin, opt):
    """Five steps of torch's optimizer on ``model`` and HybridAdamW on its copy ``twin`` (on the
    model's device), then torch's result -- 0/0 where the gradient was always zero -- in both."""
    device = next(model.parameters()).device
    for _ in range(5):
        ids = torch.randint(0, 6, (6, 3), device=device)
        for m, o in ((model, ref), (twin, opt)):
            m(ids).square().mean().backward()
            m.idle.grad = torch.zeros_like(m.idle)
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert model.idle.isnan().all() and model.emb.weight[6:].isnan().all()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(q.isnan(), p.isnan()), name
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_eps_zero_matches_torch_element_for_element(amsgrad):
    torch.manual_seed(0)
    model = ZeroGradNet()
    twin = copy.deepcopy(model)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0, amsgrad=amsgrad, foreach=False)
    opt = hytrain.HybridAdamW(twin.parameters(), lr=1e-2, eps=0.0, amsgrad=amsgrad, workers=2, model=twin)
    train_eps_zero_and_compare(model, ref, twin, opt)
    assert not model.emb.weight[:6].isnan().any() and not model.a.weight.isnan().any()
    for p, q in zip(model.parameters(), twin.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[q][key], ref.state[p][key], rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and hytrain.cuda_available()), reason="needs a GPU")
@pytest.mark.parametrize("gpu_blocks", [1, 4])
def test_eps_zero_on_the_gpu_matches_torch_element_for_element(gpu_blocks):
    """The fused CUDA AdamW with eps=0: 0/0 where torch has it, torch's values elsewhere (the blocks
    the GPU updates, and the CPU's beside them)."""
    torch.manual_seed(0)
    model = ZeroGradNet().cuda()
    twin = copy.deepcopy(model)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0, foreach=False)
    opt = hytrain.HybridAdamW(twin.parameters(), lr=1e-2, eps=0.0, workers=2, model=twin,
                              blocks=[twin.emb, twin.a, twin.b, [twin.idle]], gpu_blocks=gpu_blocks)
    train_eps_zero_and_compare(model, ref, twin, opt)
