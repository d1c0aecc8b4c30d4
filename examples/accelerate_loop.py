"""accelerate with HybridAdamW: prepare the model, the optimizer and the data loader as usual;
route_clipping makes accelerator.clip_grad_norm_ clip inside the update (it returns the true norm).

    python examples/accelerate_loop.py          # or: accelerate launch examples/accelerate_loop.py

The Accelerator puts the model on the GPU when there is one.
"""

import torch
from accelerate import Accelerator

import hytrain
from hytrain.integrations import route_clipping
from hytrain.models import LlamaConfig, LlamaModel

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=2, max_seq_len=64)
model = LlamaModel(config)
tokens = torch.randint(0, config.vocab_size, (16, 32))
loader = torch.utils.data.DataLoader(tokens, batch_size=4, shuffle=True)

accelerator = Accelerator()
opt = hytrain.HybridAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model)
model, opt, loader = accelerator.prepare(model, opt, loader)
route_clipping(accelerator, opt)

losses = []
for epoch in range(8):
    for x in loader:
        loss = model(x, x)
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    accelerator.print(f"epoch {epoch}  loss {losses[-1]:.4f}  grad norm {float(norm):.3f}")

accelerator.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
assert losses[-1] < losses[0] - 1.0, "the loss should have fallen"
