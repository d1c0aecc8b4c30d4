"""HybridAdamW in a plain PyTorch loop: clipping by the optimizer, an LR scheduler, and a checkpoint
saved and loaded halfway (model, optimizer and scheduler state dicts, as with torch.optim.AdamW).

    python examples/plain_loop.py

Runs on the GPU when there is one (bf16 weights; fp32 masters and Adam states stay in host memory),
else on the CPU (fp32 weights). The data has something to learn (a Markov chain: each token is
followed by one of four); the script checks that the model predicts the next token of unseen rows
better than the token frequencies alone do.
"""

import os
import tempfile

import torch

import hytrain
from hytrain.models import LlamaConfig, LlamaModel

from _data import held_out_loss, markov_rows  # examples/_data.py

STEPS = 40
device = "cuda" if torch.cuda.is_available() and hytrain.cuda_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=2, max_seq_len=64)

torch.manual_seed(0)
batches = [markov_rows(8, seed=step).to(device) for step in range(STEPS)]


def build():
    model = LlamaModel(config).to(device, dtype)
    opt = hytrain.HybridAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, max_grad_norm=1.0, model=model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=3e-4)
    return model, opt, sched


def train(model, opt, sched, steps):
    losses = []
    for step in steps:
        x = batches[step % len(batches)]
        loss = model(x, x)  # next-token prediction: the model shifts the labels itself
        loss.backward()
        opt.step()  # clips to max_grad_norm; the blocks update on the CPU workers
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 5 == 0:
            print(f"step {step + 1:3d}  loss {losses[-1]:.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"grad norm {opt.last_grad_norm:.3f}")
    return losses


model, opt, sched = build()
first = train(model, opt, sched, range(STEPS // 2))

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "checkpoint.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, path)
    del model, opt, sched

    # A resume: fresh objects, then the saved state (the optimizer's before its first step).
    model, opt, sched = build()
    saved = torch.load(path, map_location=device)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])

second = train(model, opt, sched, range(STEPS // 2, STEPS))

print(f"loss {first[0]:.3f} -> {second[-1]:.3f}")
held, unigram = held_out_loss(model, torch.cat(batches), device)
print(f"held-out next-token loss {held:.3f}, unigram baseline {unigram:.3f}")
assert held < unigram - 0.3, "the model has not learned which tokens come next"
