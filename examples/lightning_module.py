"""Lightning with HybridAdamW: configure_optimizers returns it; the HybridClipping mixin (first in
the bases) makes Trainer(gradient_clip_val=...) clip inside the update and logs the true grad_norm.

    python examples/lightning_module.py

accelerator="auto" trains on the GPU when there is one.
"""

import lightning as L
import torch

import hytrain
from hytrain.integrations import HybridClipping
from hytrain.models import LlamaConfig, LlamaModel


class TinyLlama(HybridClipping, L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = LlamaModel(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=2,
                                          max_seq_len=64))
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.net(batch, batch)
        self.losses.append(loss.item())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = hytrain.HybridAdamW(self.parameters(), lr=3e-3, weight_decay=0.1, model=self)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_steps, eta_min=3e-4)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


torch.manual_seed(0)
tokens = torch.randint(0, 256, (16, 32))
module = TinyLlama()
trainer = L.Trainer(max_steps=32, accelerator="auto", devices=1, gradient_clip_val=1.0, logger=False,
                    enable_checkpointing=False, enable_model_summary=False)
trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=4, shuffle=True))

print(f"loss {module.losses[0]:.3f} -> {module.losses[-1]:.3f}, grad norm {float(trainer.callback_metrics['grad_norm']):.3f}")
assert module.losses[-1] < module.losses[0] - 1.0, "the loss should have fallen"
