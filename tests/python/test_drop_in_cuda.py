"""HybridAdamW on the GPU inside the loops people run, the model moved to CUDA after the optimizer was
built: a plain loop (fp32 weights under bf16 autocast, and bf16 weights; no clipping, torch's
``clip_grad_norm_``, and the routed ``HybridAdamW.clip_grad_norm_``; k = 0, 1 and auto), transformers'
Trainer, accelerate and Lightning with clipping on. Each is compared with torch's AdamW in the same
loop (fp32 masters where the weights are bf16)."""

import copy

import pytest
import torch

import hytrain
from hytrain.models import LlamaModel
from test_drop_in import CFG, LR, accelerate_runs, assert_same_training, data, lightning_run, trainer_run
from test_hybrid_adam import Reference

pytestmark = pytest.mark.gpu

STEPS = 12


def loop(model, opt, clip, autocast, steps=STEPS):
    losses = []
    for i, x in enumerate(data(steps, seq=32)):
        x = x.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, x)
        loss.backward()
        max_norm = 0.5 if i % 3 == 0 else 1e3  # clipping fires on some steps only
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        elif clip == "routed":
            opt.clip_grad_norm_(max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.cuda.synchronize()
    if isinstance(opt, hytrain.HybridAdamW):
        opt.synchronize()
    return losses


@pytest.mark.parametrize("k", [0, 1, "auto"])
@pytest.mark.parametrize("clip", ["none", "torch", "routed"])
@pytest.mark.parametrize("weights", ["fp32-autocast", "bf16"])
def test_plain_loop_model_moved_to_cuda_after_construction(weights, clip, k):
    torch.manual_seed(0)
    model = LlamaModel(CFG)  # on the CPU
    opt = hytrain.HybridAdamW(model.parameters(), lr=LR, model=model, gpu_blocks=k, workers=2)
    model.cuda()
    if weights == "bf16":
        model.to(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    ref = Reference(ref_model, lr=LR, weight_decay=1e-2)
    autocast = weights == "fp32-autocast"
    losses = loop(model, opt, clip, autocast)
    ref_clip = "torch" if clip == "routed" else clip
    ref_losses = loop(ref_model, ref, ref_clip, autocast)
    assert opt.device.type == "cuda"
    # Losses closely; weights within bf16 tolerance (a last-bit difference between the CPU and the GPU
    # AdamW can flip a bf16 rounding under autocast, which Adam then turns into a full step on rarely
    # used rows).
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-3, atol=0)
    assert_same_training(model, ref_model, losses, ref_losses, 2e-2)
    if clip != "none":
        assert opt.last_grad_norm is None or opt.last_grad_norm > 0


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps one AcceleratorState per process (its mixed precision included): each test
    starts without one."""
    yield
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(reset_partial_state=True)


def test_trainer_on_the_gpu(tmp_path):
    from hytrain.integrations import HybridTrainer

    for cast, tol in ((None, 1e-2), (torch.bfloat16, 5e-2)):
        _, _, ref_losses, ref_norms = trainer_run(tmp_path / f"torch{cast}", cpu=False, bf16=True, cast=cast)
        plain = lambda m: hytrain.HybridAdamW(m.parameters(), lr=LR, weight_decay=0.0, workers=2)  # noqa: E731
        for name, kw in (("plain", dict(optimizer=plain)),
                         ("routed", dict(cls=HybridTrainer, hybrid_kwargs=dict(workers=2)))):
            model, trainer, losses, norms = trainer_run(tmp_path / f"{name}{cast}", cpu=False, bf16=True, cast=cast, **kw)
            assert trainer.optimizer.optimizer.device.type == "cuda"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=0,
                                       msg=f"{name} {cast}")
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=5 * tol, atol=0,
                                       msg=f"{name} {cast}")
            _, _, resumed, _ = trainer_run(tmp_path / f"{name}{cast}", cpu=False, bf16=True, cast=cast,
                                           resume=str(tmp_path / f"{name}{cast}" / "checkpoint-3"), **kw)
            torch.testing.assert_close(torch.tensor(resumed[-3:]), torch.tensor(losses[3:]), rtol=tol, atol=0)


def test_trainer_fp16_on_the_gpu(tmp_path):
    # TrainingArguments(fp16=True): accelerate's GradScaler; HybridTrainer's routed clipping keeps the
    # gradients scaled and the hand-offs going. Losses, logged norms and a resume as torch's AdamW.
    from hytrain.integrations import HybridTrainer

    _, _, ref_losses, ref_norms = trainer_run(tmp_path / "torch16", cpu=False, fp16=True)
    model, trainer, losses, norms = trainer_run(tmp_path / "routed16", cpu=False, fp16=True, cls=HybridTrainer,
                                                hybrid_kwargs=dict(workers=2))
    opt = trainer.optimizer.optimizer
    assert opt._engine.loss_scaling and not opt._engine.unscaled_in_place and opt._engine.early_handoff()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=5e-2, atol=0)
    _, _, resumed, _ = trainer_run(tmp_path / "routed16", cpu=False, fp16=True, cls=HybridTrainer,
                                   hybrid_kwargs=dict(workers=2), resume=str(tmp_path / "routed16" / "checkpoint-3"))
    torch.testing.assert_close(torch.tensor(resumed[-3:]), torch.tensor(losses[3:]), rtol=1e-2, atol=0)


def test_accelerate_on_the_gpu(tmp_path):
    results = accelerate_runs(tmp_path, cpu=False, mixed_precision="bf16")
    ref_model, ref_losses, ref_norms = results["torch"]
    for mode in ("plain", "routed"):
        model, losses, norms = results[mode]
        assert next(model.parameters()).is_cuda
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-2, atol=0, msg=mode)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-3, atol=0, msg=mode)
        assert_same_training(model, ref_model, losses, ref_losses, 2e-2)
        torch.testing.assert_close(torch.tensor(results[mode + "_resumed"]), torch.tensor(losses[3:]),
                                   rtol=1e-3, atol=0, msg=mode)


def test_accelerate_fp16_on_the_gpu(tmp_path):
    # fp16 mixed precision: accelerate's GradScaler. Its own clipping unscales .grad in place first
    # (HybridAdamW then keeps the gradients to step()); the routed clipping leaves the scale to
    # HybridAdamW's step and keeps the hand-offs. Both follow torch's AdamW, with the unscaled norms.
    results = accelerate_runs(tmp_path, cpu=False, mixed_precision="fp16")
    ref_model, ref_losses, ref_norms = results["torch"]
    for mode in ("plain", "routed"):
        model, losses, norms = results[mode]
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-2, atol=0, msg=mode)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-3, atol=0, msg=mode)
        assert_same_training(model, ref_model, losses, ref_losses, 2e-2)
        torch.testing.assert_close(torch.tensor(results[mode + "_resumed"]), torch.tensor(losses[3:]),
                                   rtol=1e-3, atol=0, msg=mode)
    plain, routed = results["plain_opt"], results["routed_opt"]
    assert plain._engine.unscaled_in_place and not routed._engine.unscaled_in_place
    assert routed._engine.steps > 0 and routed._engine.early_handoff()


def test_lightning_on_the_gpu():
    ref, _ = lightning_run(lambda net: torch.optim.AdamW(net.parameters(), lr=LR, foreach=False), False, 0.5,
                           accelerator="gpu", precision="bf16-mixed")
    hybrid = lambda net: hytrain.HybridAdamW(net.parameters(), lr=LR, model=net, workers=2)  # noqa: E731
    # Lightning's mixed-precision plugins refuse their own clipping for optimizers that take the loss
    # scale themselves (HybridAdamW does, for GradScaler): a clear error at the first step, which the
    # HybridClipping mixin avoids by clipping inside HybridAdamW.
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        lightning_run(hybrid, False, 0.5, accelerator="gpu", precision="bf16-mixed")
    net, trainer = lightning_run(hybrid, True, 0.5, accelerator="gpu", precision="bf16-mixed")
    assert trainer.strategy.root_device.type == "cuda"  # (fit's teardown moves the module back to the CPU)
    assert trainer.callback_metrics["grad_norm"] > 0.5
    for (n, a), b in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=n)


def test_lightning_fp16_on_the_gpu():
    # precision="16-mixed": Lightning's GradScaler, which leaves the unscaling to HybridAdamW's step
    # (it takes the scale itself); HybridClipping clips inside the step: the hand-offs stand, the
    # kept gradients compared by content. The weights follow torch's AdamW's (Lightning unscales
    # and clips for it).
    ref, _ = lightning_run(lambda net: torch.optim.AdamW(net.parameters(), lr=LR, foreach=False), False, 0.5,
                           accelerator="gpu", precision="16-mixed")
    hybrid = lambda net: hytrain.HybridAdamW(net.parameters(), lr=LR, model=net, workers=2)  # noqa: E731
    net, trainer = lightning_run(hybrid, True, 0.5, accelerator="gpu", precision="16-mixed")
    opt = trainer.optimizers[0]
    opt = getattr(opt, "optimizer", opt)
    assert opt._engine.loss_scaling and not opt._engine.unscaled_in_place and opt._engine.early_handoff()
    for (n, a), b in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=n)
