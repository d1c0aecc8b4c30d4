"""Model presets for ``hytrain train`` (shapes of the project's Llama-style decoder, up to the L3B and
L7B workloads), and the wrapper that gives a transformers causal LM the same ``(tokens, targets)``
interface."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PRESETS = {
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=344, num_layers=4, num_heads=4, num_kv_heads=2),
    "small": dict(vocab_size=256, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
                  num_kv_heads=2),
    "125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                 num_kv_heads=12),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_layers=16, num_heads=16,
               num_kv_heads=16),
    "l3b": dict(vocab_size=32000, hidden_size=3072, intermediate_size=8192, num_layers=26, num_heads=24,
                num_kv_heads=24),
    "l7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                num_kv_heads=32),
}


class CausalLM(torch.nn.Module):
    """A transformers causal LM called as ``model(tokens, targets)`` (the loss) or ``model(tokens)``
    (the logits); checkpoints hold it under its own parameter names (``saved_module``)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    @property
    def saved_module(self):
        return self.inner

    def forward(self, tokens, targets=None):
        logits = self.inner(input_ids=tokens).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
