"""HybridAdamW inside the loops people already run, on the CPU: parameters moved or cast after the
optimizer was built, clipping done by the loop (plain ``clip_grad_norm_``, transformers' Trainer with
``max_grad_norm``, accelerate's ``clip_grad_norm_``, Lightning's ``gradient_clip_val``), checkpoints
saved and resumed through those libraries, and block detection on transformers' decoder models. Each
run is compared with ``torch.optim.AdamW`` (on fp32 master copies where the model is bf16/fp16) in the
same loop."""

import copy
import warnings

import pytest
import torch

import hytrain
from hytrain.blocks import detect_blocks
from hytrain.models import LlamaConfig, LlamaModel
from test_hybrid_adam import Reference, counting  # torch's AdamW on fp32 copies of the model's parameters

CFG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                  num_kv_heads=2, max_seq_len=64)
LR = 2e-3


def data(n, seed=0, vocab=CFG.vocab_size, batch=2, seq=16):
    g = torch.Generator().manual_seed(seed)
    return [counting(g, (batch, seq), vocab) for _ in range(n)]


def model_and_optimizer(**kw):
    """A fresh model (seed 0) on the CPU in fp32, and HybridAdamW over it built before anything moves."""
    torch.manual_seed(0)
    model = LlamaModel(CFG)
    return model, hytrain.HybridAdamW(model.parameters(), lr=LR, model=model, workers=2, **kw)


def with_torch_twin(**kw):
    """model_and_optimizer(), and a copy of the model with torch's AdamW (same settings)."""
    model, opt = model_and_optimizer(**kw)
    ref_model = copy.deepcopy(model)
    return model, opt, ref_model, torch.optim.AdamW(ref_model.parameters(), lr=LR, foreach=False)


def run(model, opt, batches, clip=None):
    losses, norms = [], []
    for x in batches:
        loss = model(x, x)
        loss.backward()
        if clip is not None:
            norms.append(float(clip()))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if isinstance(opt, hytrain.HybridAdamW):
        opt.synchronize()  # the last updates overlap what would come next: wait before reading weights
    return losses, norms


def assert_same_training(model, ref_model, losses, ref_losses, tol):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=tol)
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=name)


# ---- parameters moved after the optimizer was built --------------------------------------------------

@pytest.mark.parametrize("moves", [(torch.bfloat16,), (torch.float16,), (torch.float16, torch.bfloat16)],
                         ids=["bf16", "fp16", "fp16-then-bf16"])
def test_cast_after_construction_trains_as_torch_adamw(moves):
    model, opt = model_and_optimizer()
    assert not opt.bound and len(opt.state) == 0  # nothing is made before the first step
    for dtype in moves:
        model.to(dtype)
    ref_model = copy.deepcopy(model)
    ref = Reference(ref_model, lr=LR, weight_decay=1e-2)
    batches = data(8)
    losses, _ = run(model, opt, batches[:1])
    ref_losses, _ = run(ref_model, ref, batches[:1])
    assert opt.bound
    # The fp32 masters after one step: created from the cast weights, then stepped as torch's.
    for p, m in zip(model.parameters(), ref.master):
        torch.testing.assert_close(opt.state[p]["master"], m, rtol=1e-6, atol=1e-7)
    more, _ = run(model, opt, batches[1:])
    ref_more, _ = run(ref_model, ref, batches[1:])
    assert_same_training(model, ref_model, losses + more, ref_losses + ref_more, 2e-2)
    assert more[-1] < losses[0]


def test_state_dict_loaded_before_the_first_step_is_applied_at_it():
    model, first = model_and_optimizer()
    batches = data(6)
    run(model, first, batches[:3])
    saved = copy.deepcopy(first.state_dict())
    weights = copy.deepcopy(model.state_dict())
    rest, _ = run(model, first, batches[3:])
    del first

    model2 = LlamaModel(CFG)
    model2.load_state_dict(weights)
    opt = hytrain.HybridAdamW(model2.parameters(), lr=LR, model=model2, workers=2)
    opt.load_state_dict(saved)  # a resume loads before the first step
    assert not opt.bound and opt.state_dict()["state"].keys() == saved["state"].keys()
    again, _ = run(model2, opt, batches[3:])
    assert again == rest  # bit-identical on the CPU
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_a_move_after_the_first_step_is_refused_and_keeps_the_state():
    model, opt = model_and_optimizer()
    batches = data(3)
    run(model, opt, batches[:2])
    saved = copy.deepcopy(opt.state_dict())
    model.to(torch.bfloat16)
    x = batches[2]
    model(x, x).backward()
    with pytest.raises(RuntimeError, match=r"parameter 0 is now bfloat16 .* created its state at the first step "
                                           r"for float32"):
        opt.step()
    after = opt.state_dict()
    for i, st in saved["state"].items():
        for key, t in st.items():
            assert torch.equal(t, after["state"][i][key]), (i, key)


def test_a_cast_right_after_a_step_with_updates_in_flight_is_refused_at_the_step():
    """release_grads=True: the cast right after step() waits for the updates in flight (the fence),
    the next backward hands nothing off, and step() refuses before anything is applied."""
    model, opt = model_and_optimizer(release_grads=True)
    batches = data(3)
    for x in batches[:2]:
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    model.to(torch.bfloat16)
    x = batches[2]
    model(x, x).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="Moving or casting parameters after the first step is not supported"):
        opt.step()
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))


def test_new_storage_of_the_same_kind_is_followed():
    """``p.data = ...`` with the same device, dtype and shape (what some wrappers do) is not a move:
    the next step updates the new storage."""
    model, opt, ref_model, ref = with_torch_twin()
    batches = data(4)
    losses, _ = run(model, opt, batches[:2])
    ref_losses, _ = run(ref_model, ref, batches[:2])
    for p in model.parameters():
        p.data = p.data.clone()
    more, _ = run(model, opt, batches[2:])
    ref_more, _ = run(ref_model, ref, batches[2:])
    assert_same_training(model, ref_model, losses + more, ref_losses + ref_more, 1e-4)


# ---- clipping done by the loop ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_grad_norm_between_backward_and_step_is_exact(dtype):
    torch.manual_seed(0)
    model = LlamaModel(CFG).to(dtype)
    ref_model = copy.deepcopy(model)
    opt = hytrain.HybridAdamW(model.parameters(), lr=LR, model=model, workers=2)
    ref = Reference(ref_model, lr=LR, weight_decay=1e-2)
    batches = data(8)
    losses, norms = run(model, opt, batches, clip=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
    ref_losses, ref_norms = run(ref_model, ref, batches,
                                clip=lambda: torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5))
    assert all(n > 0.5 for n in ref_norms[:3]), "clipping should fire"
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=0)
    assert_same_training(model, ref_model, losses, ref_losses, 2e-2 if dtype != torch.float32 else 1e-5)


def test_routed_clip_returns_the_true_norm_and_clips_inside_the_update():
    model, opt, ref_model, ref = with_torch_twin()
    batches = data(8)

    def routed():
        grads = [p.grad.clone() for p in model.parameters()]
        norm = opt.clip_grad_norm_(0.5)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))  # .grad untouched
        return norm

    losses, norms = run(model, opt, batches, clip=routed)
    ref_losses, ref_norms = run(ref_model, ref, batches,
                                clip=lambda: torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5))
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert opt.last_grad_norm == pytest.approx(ref_norms[-1], rel=1e-5)
    assert_same_training(model, ref_model, losses, ref_losses, 1e-5)
    with pytest.raises(ValueError, match="norm_type=2"):
        opt.clip_grad_norm_(1.0, norm_type=1)


def test_gradient_accumulation_the_optimizer_was_not_told_of():
    """Kept gradients may gather several backward passes before step() (a loop's own accumulation)."""
    model, opt, ref_model, ref = with_torch_twin()
    batches = data(8)
    for m, o in ((model, opt), (ref_model, ref)):
        for i in range(0, 8, 2):
            for x in batches[i:i + 2]:
                (m(x, x) / 2).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert_same_training(model, ref_model, [0.0], [0.0], 1e-5)


# ---- transformers' Trainer ----------------------------------------------------------------------------

def tiny_hf_llama(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=16, vocab=96):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def trainer_run(out, optimizer=None, cls=None, resume=None, max_steps=6, cpu=True, bf16=False, cast=None,
                fp16=False, accumulation=1, **trainer_kwargs):
    """transformers' Trainer on a tiny Llama built on the CPU; ``optimizer(model)`` is built before
    the Trainer moves the model (and before ``cast``, a dtype applied after it)."""
    transformers = pytest.importorskip("transformers")
    model = tiny_hf_llama()
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=LR,
        max_grad_norm=0.05, logging_steps=1, save_strategy="steps", save_steps=3, report_to="none",
        use_cpu=cpu, bf16=bf16, fp16=fp16, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        gradient_accumulation_steps=accumulation)
    opt = optimizer(model) if optimizer is not None else None
    if cast is not None:
        model.to(cast)
    trainer = (cls or transformers.Trainer)(model=model, args=args, train_dataset=TokenDataset(),
                                            optimizers=(opt, None), **trainer_kwargs)
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return model, trainer, [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


def test_trainer_with_max_grad_norm_save_and_resume(tmp_path):
    from hytrain.integrations import HybridTrainer

    ref_model, _, ref_losses, ref_norms = trainer_run(tmp_path / "torch")
    assert max(ref_norms) > 0.05, "the Trainer's clipping should fire"
    plain = lambda m: hytrain.HybridAdamW(m.parameters(), lr=LR, weight_decay=0.0, workers=2)  # noqa: E731
    for name, kw in (("plain", dict(optimizer=plain)), ("routed", dict(cls=HybridTrainer,
                                                                       hybrid_kwargs=dict(workers=2)))):
        model, trainer, losses, norms = trainer_run(tmp_path / name, **kw)
        opt = trainer.optimizer.optimizer
        assert isinstance(opt, hytrain.HybridAdamW), name
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0, msg=name)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=0, msg=name)
        for (n, a), b in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"{name} {n}")
        # Resume from the step-3 checkpoint: the same last three steps.
        _, _, resumed, _ = trainer_run(tmp_path / name, resume=str(tmp_path / name / "checkpoint-3"), **kw)
        torch.testing.assert_close(torch.tensor(resumed[-3:]), torch.tensor(losses[3:]), rtol=1e-6, atol=0, msg=name)


def test_hybrid_trainer_takes_the_trainers_gradient_accumulation(tmp_path):
    # The optimizer the HybridTrainer builds is told the micro-batches a step (on CUDA it hands blocks
    # off during the last backward only); the run is torch's Trainer's.
    from hytrain.integrations import HybridTrainer

    ref_model, _, ref_losses, _ = trainer_run(tmp_path / "torch", max_steps=3, accumulation=2)
    model, trainer, losses, _ = trainer_run(tmp_path / "hybrid", cls=HybridTrainer, max_steps=3, accumulation=2,
                                            hybrid_kwargs=dict(workers=2))
    assert trainer.optimizer.optimizer.accumulation_steps == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---- accelerate -----------------------------------------------------------------------------------------

def accelerate_runs(tmp_path, cpu=True, mixed_precision="no"):
    """The same accelerate loop (clip_grad_norm_ every step, save_state at step 3, then a resume from it)
    with torch's AdamW, HybridAdamW, and HybridAdamW with the clipping routed."""
    accelerate = pytest.importorskip("accelerate")
    from hytrain.integrations import route_clipping

    batches = data(6)
    results = {}
    for mode in ("torch", "plain", "routed"):
        torch.manual_seed(0)
        model = LlamaModel(CFG)
        acc = accelerate.Accelerator(cpu=cpu, mixed_precision=mixed_precision)
        opt = (torch.optim.AdamW(model.parameters(), lr=LR, foreach=False) if mode == "torch"
               else hytrain.HybridAdamW(model.parameters(), lr=LR, model=model, workers=2))
        model, opt = acc.prepare(model, opt)  # moves the model, wraps the optimizer
        if mode == "routed":
            route_clipping(acc, opt)
        losses, norms = [], []
        for i, x in enumerate(batches):
            x = x.to(acc.device)
            loss = model(x, x)
            acc.backward(loss)
            norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if i == 2:
                acc.save_state(str(tmp_path / mode))
        results[mode] = (model, losses, norms)
        results[mode + "_opt"] = opt.optimizer if hasattr(opt, "optimizer") else opt
        if mode != "torch":  # resume through accelerate's own checkpoint, with a fresh optimizer
            torch.manual_seed(1)
            model2 = LlamaModel(CFG)
            opt2 = hytrain.HybridAdamW(model2.parameters(), lr=LR, model=model2, workers=2)
            acc2 = accelerate.Accelerator(cpu=cpu, mixed_precision=mixed_precision)
            model2, opt2 = acc2.prepare(model2, opt2)
            if mode == "routed":
                route_clipping(acc2, opt2)
            acc2.load_state(str(tmp_path / mode))
            again = []
            for x in batches[3:]:
                x = x.to(acc2.device)
                loss = model2(x, x)
                acc2.backward(loss)
                acc2.clip_grad_norm_(model2.parameters(), 0.5)
                opt2.step()
                opt2.zero_grad()
                again.append(loss.item())
            results[mode + "_resumed"] = again
    return results


def test_accelerate_loop_with_clip_grad_norm(tmp_path):
    results = accelerate_runs(tmp_path)
    ref_model, ref_losses, ref_norms = results["torch"]
    assert max(ref_norms) > 0.5
    for mode in ("plain", "routed"):
        model, losses, norms = results[mode]
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0, msg=mode)
        assert_same_training(model, ref_model, losses, ref_losses, 1e-5)
        assert results[mode + "_resumed"] == losses[3:], mode  # bit-identical on the CPU


# ---- Lightning ----------------------------------------------------------------------------------------

def lightning_run(opt_factory, mixin, clip, accelerator="cpu", precision=None, steps=6, save_to=None, resume=None):
    """Lightning's Trainer for ``steps`` steps, epochs of 3 batches (so a checkpoint at step 3 resumes
    at an epoch boundary); ``save_to``: save a checkpoint at the end; ``resume``: fit from one."""
    L = pytest.importorskip("lightning")
    from hytrain.integrations import HybridClipping

    batches = data(3)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = LlamaModel(CFG)

        def training_step(self, batch, i):
            return self.net(batch, batch)

        def configure_optimizers(self):
            return opt_factory(self.net)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(batches, batch_size=None)

    cls = type("Routed", (HybridClipping, Module), {}) if mixin else Module
    module = cls()
    trainer = L.Trainer(max_steps=steps, gradient_clip_val=clip, accelerator=accelerator, devices=1,
                        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, ckpt_path=resume)
    for opt in trainer.optimizers:
        if isinstance(opt, hytrain.HybridAdamW):
            opt.synchronize()  # the last update overlaps what would come next
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return module.net, trainer


def test_lightning_trainer_with_gradient_clip_val():
    ref, _ = lightning_run(lambda net: torch.optim.AdamW(net.parameters(), lr=LR, foreach=False), False, 0.5)
    hybrid = lambda net: hytrain.HybridAdamW(net.parameters(), lr=LR, model=net, workers=2)  # noqa: E731
    for mixin in (False, True):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            net, trainer = lightning_run(hybrid, mixin, 0.5)
        # (logger=False: the norm is not sent to a logger, and nothing warns that there is none)
        assert not [w for w in seen if "logger" in str(w.message)], [str(w.message) for w in seen]
        for (n, a), b in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"mixin={mixin} {n}")
        if mixin:
            assert trainer.callback_metrics["grad_norm"] > 0.5


def test_lightning_checkpoint_resume(tmp_path):
    """Fit 3 steps, save Lightning's checkpoint, fit on from it to 6: HybridAdamW ends where torch's
    AdamW ends through the same save and resume."""
    hybrid = lambda net: hytrain.HybridAdamW(net.parameters(), lr=LR, model=net, workers=2)  # noqa: E731
    plain = lambda net: torch.optim.AdamW(net.parameters(), lr=LR, foreach=False)  # noqa: E731
    ends = {}
    for name, factory in (("torch", plain), ("hybrid", hybrid)):
        lightning_run(factory, name == "hybrid", 0.5, steps=3, save_to=tmp_path / f"{name}.ckpt")
        ends[name], trainer = lightning_run(factory, name == "hybrid", 0.5, resume=tmp_path / f"{name}.ckpt")
        assert trainer.global_step == 6
    for (n, a), b in zip(ends["hybrid"].named_parameters(), ends["torch"].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)


# ---- block detection on transformers' decoders ----------------------------------------------------------

def hf_models():
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    return {
        "llama": (transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **small)),
                  lambda m: m.model.layers),
        "mistral": (transformers.MistralForCausalLM(transformers.MistralConfig(num_key_value_heads=2, **small)),
                    lambda m: m.model.layers),
        "qwen2": (transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **small)),
                  lambda m: m.model.layers),
        "gpt2": (transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4,
                                                                      n_positions=64)),
                 lambda m: m.transformer.h),
        "gpt_neox": (transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**small)),
                     lambda m: m.gpt_neox.layers),
    }


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt2", "gpt_neox"])
def test_blocks_of_transformers_decoders(arch):
    torch.manual_seed(0)
    model, layers_of = hf_models()[arch]
    params = list(model.parameters())
    blocks = detect_blocks(model, params)
    layers = layers_of(model)
    # Head (embeddings), one block per decoder layer, tail (final norm, untied head).
    assert len(blocks) == len(layers) + 2
    for blk, layer in zip(blocks[1:-1], layers):
        assert [id(p) for p in blk] == [id(p) for p in layer.parameters()]
    assert sorted(id(p) for b in blocks for p in b) == sorted(id(p) for p in params)
    # And it trains as torch's AdamW does, with the forward hooks of those blocks in place.
    model.eval()  # no dropout: the two runs see the same forward
    ref_model = copy.deepcopy(model)
    # eps=1e-3: key biases get gradients of rounding noise only (softmax ignores them), which Adam
    # would otherwise blow up to full-size steps of random sign in either run.
    opt = hytrain.HybridAdamW(model.parameters(), lr=LR, eps=1e-3, model=model, workers=2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, eps=1e-3, foreach=False)
    for m, o in ((model, opt), (ref_model, ref)):
        for x in data(3, vocab=64):
            m(input_ids=x, labels=x).loss.backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
