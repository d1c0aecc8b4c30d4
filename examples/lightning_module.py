"""Lightning with HybridAdamW: configure_optimizers returns it; the HybridClipping mixin (first in
the bases) makes Trainer(gradient_clip_val=...) clip inside the update and logs the true grad_norm.

    python examples/lightning_module.py

accelerator="auto" trains on the GPU when there is one. The data has something to learn (a Markov
chain: each token is followed by one of four); the script checks that the model predicts the next
token of unseen rows better than the token frequencies alone do.
"""

import tempfile

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

import hytrain
from hytrain.integrations import HybridClipping
from hytrain.models import LlamaConfig, LlamaModel

from _data import held_out_loss, markov_rows  # examples/_data.py


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
with tempfile.TemporaryDirectory() as logs:  # loss and grad_norm every 5 steps, as CSV (a real run keeps it)
    trainer = L.Trainer(max_steps=40, accelerator="auto", devices=1, gradient_clip_val=1.0,
                        logger=CSVLogger(logs), log_every_n_steps=5, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=8, shuffle=True))

print(f"loss {module.losses[0]:.3f} -> {module.losses[-1]:.3f}, grad norm {float(trainer.callback_metrics['grad_norm']):.3f}")
held, unigram = module.held_out
print(f"held-out next-token loss {held:.3f}, unigram baseline {unigram:.3f}")
assert held < unigram - 0.3, "the model has not learned which tokens come next"
