"""Model presets for ``hytrain train`` (shapes of the project's Llama-style decoder, up to the L3B and
L7B workloads), and the wrapper that gives a transformers causal LM the same ``(tokens, labels)``
interface."""

from __future__ import annotations

import torch

from .llama import next_token_loss

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
    """A transformers causal LM called as the project's decoder is: ``model(tokens)`` gives the
    logits, ``model(tokens, labels)`` the next-token loss with the labels shifted inside, exactly as
    transformers' own ``model(input_ids=tokens, labels=labels).loss`` (so ``model(tokens, tokens)``
    is next-token prediction; labels of -100 carry no loss). Checkpoints hold it under its own
    parameter names (``saved_module``)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    @property
    def saved_module(self):
        return self.inner

    def forward(self, tokens, labels=None):
        """The logits (batch, seq, vocab) without ``labels``; with them (batch, seq, aligned with the
        tokens), the fp32 mean cross-entropy of ``logits[:, :-1]`` against ``labels[:, 1:]``."""
        logits = self.inner(input_ids=tokens).logits
        if labels is None:
            return logits
        return next_token_loss(logits, labels)
