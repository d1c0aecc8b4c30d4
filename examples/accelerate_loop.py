"""accelerate with HybridAdamW: prepare the model, the optimizer and the data loader as usual;
route_clipping makes accelerator.clip_grad_norm_ clip inside the update (it returns the true norm).

    python examples/accelerate_loop.py          # or: accelerate launch examples/accelerate_loop.py

The Accelerator puts the model on the GPU when there is one. The data has something to learn (a
Markov chain: each token is followed by one of four); the script checks that the model predicts the
next token of unseen rows better than the token frequencies alone do.
"""

import torch
from accelerate import Accelerator

import hytrain
from hytrain.integrations import route_clipping
from hytrain.models import LlamaConfig, LlamaModel

from _data import held_out_loss, markov_rows  # examples/_data.py

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=2, max_seq_len=64)
model = LlamaModel(config)
tokens = markov_rows(64, seed=0)
loader = torch.utils.data.DataLoader(tokens, batch_size=8, shuffle=True)

accelerator = Accelerator()
opt = hytrain.HybridAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model)
model, opt, loader = accelerator.prepare(model, opt, loader)
route_clipping(accelerator, opt)

losses = []
for epoch in range(5):
    for x in loader:
        loss = model(x, x)  # next-token prediction: the model shifts the labels itself
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    accelerator.print(f"epoch {epoch}  loss {losses[-1]:.4f}  grad norm {float(norm):.3f}")

accelerator.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
held, unigram = held_out_loss(model, tokens, accelerator.device)
accelerator.print(f"held-out next-token loss {held:.3f}, unigram baseline {unigram:.3f}")
assert held < unigram - 0.3, "the model has not learned which tokens come next"
