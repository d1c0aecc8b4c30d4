"""A compact Llama-style decoder: token embedding, pre-norm blocks (RMSNorm, causal self-attention with
rotary embeddings and grouped KV heads, SwiGLU MLP), final RMSNorm and an untied LM head.

The repeated blocks live in ``model.layers`` (an ``nn.ModuleList``), which is what hytrain's block
detection looks for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 344
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("the head dimension must be even for rotary embeddings")

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = h // self.num_heads * self.num_kv_heads
        per_layer = 2 * h + h * h * 2 + 2 * h * kv + 3 * h * i
        return 2 * v * h + h + self.num_layers * per_layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rotary(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        hd = c.hidden_size // c.num_heads
        self.attn_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.q = nn.Linear(c.hidden_size, c.num_heads * hd, bias=False)
        self.k = nn.Linear(c.hidden_size, c.num_kv_heads * hd, bias=False)
        self.v = nn.Linear(c.hidden_size, c.num_kv_heads * hd, bias=False)
        self.o = nn.Linear(c.num_heads * hd, c.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.gate = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        c, hd = self.c, self.c.hidden_size // self.c.num_heads
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, c.num_heads, hd).transpose(1, 2)
        k = self.k(h).view(b, t, c.num_kv_heads, hd).transpose(1, 2)
        v = self.v(h).view(b, t, c.num_kv_heads, hd).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaModel(nn.Module):
    """``checkpointing=True``: each layer is recomputed in backward (activation checkpointing)."""

    def __init__(self, config: LlamaConfig, *, checkpointing: bool = False):
        super().__init__()
        self.config = config
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        hd = config.hidden_size // config.num_heads
        inv = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), inv)
        self.register_buffer("rope_cos", ang.cos(), persistent=False)
        self.register_buffer("rope_sin", ang.sin(), persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens, targets=None):
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.embed(tokens)
        cos = self.rope_cos[:t].to(x.dtype)
        sin = self.rope_sin[:t].to(x.dtype)
        recompute = self.checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False) if recompute else layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
