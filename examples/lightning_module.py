"""Lightning with HybridAdamW: configure_optimizers returns it; the HybridClipping mixin (first in
the bases) makes Trainer(gradient_clip_val=...) clip inside the update and logs the true grad_norm.

    python examples/lightning_module.py

accelerator="auto" trains on the GPU when there is one. The data has something to learn (a Markov
chain: each token is followed by one of four); the script checks that the model predicts the next
token of unseen rows better than the token frequencies alone do.
"""

import lightning as L
import torch
import torch.nn.functional as F

import hytrain
from hytrain.integrations import HybridClipping
from hytrain.models import LlamaConfig, LlamaModel

# The data: a Markov chain over token ids 0..31, each followed by one of 4 (a fixed table).
FOLLOWERS = torch.randint(0, 32, (32, 4), generator=torch.Generator().manual_seed(0))


def markov_rows(n, seed, length=32):
    g = torch.Generator().manual_seed(seed)
    cols = [torch.randint(0, 32, (n,), generator=g)]
    while len(cols) < length:
        cols.append(FOLLOWERS[cols[-1], torch.randint(0, 4, (n,), generator=g)])
    return torch.stack(cols, dim=1)


def held_out_loss(model, seen, device):
    """(next-token loss on unseen rows, unigram baseline). The loss comes from the logits, position t
    scored against token t + 1; the baseline is the entropy of the token frequencies in ``seen``, the
    best a model that ignores the context can do."""
    rows = markov_rows(16, seed=1_000_000).to(device)
    with torch.no_grad():
        logits = model(rows).float()  # without labels: the logits
    held = F.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten()).item()
    p = torch.bincount(seen.flatten().cpu()).double() / seen.numel()
    return held, -(p[p > 0] * p[p > 0].log()).sum().item()


class TinyLlama(HybridClipping, L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = LlamaModel(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=2,
                                          max_seq_len=64))
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.net(batch, batch)  # next-token prediction: the model shifts the labels itself
        self.losses.append(loss.item())
        self.log("loss", loss, prog_bar=True)
        return loss

    def on_train_end(self):  # (while the model is on the device it trained on)
        self.held_out = held_out_loss(self.net, self.trainer.train_dataloader.dataset, self.device)

    def configure_optimizers(self):
        opt = hytrain.HybridAdamW(self.parameters(), lr=3e-3, weight_decay=0.1, model=self)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_steps, eta_min=3e-4)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


torch.manual_seed(0)
tokens = markov_rows(64, seed=0)
module = TinyLlama()
trainer = L.Trainer(max_steps=40, accelerator="auto", devices=1, gradient_clip_val=1.0, logger=False,
                    enable_checkpointing=False, enable_model_summary=False)
trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=8, shuffle=True))

print(f"loss {module.losses[0]:.3f} -> {module.losses[-1]:.3f}, grad norm {float(trainer.callback_metrics['grad_norm']):.3f}")
held, unigram = module.held_out
print(f"held-out next-token loss {held:.3f}, unigram baseline {unigram:.3f}")
assert held < unigram - 0.3, "the model has not learned which tokens come next"
