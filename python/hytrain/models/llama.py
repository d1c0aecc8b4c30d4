"""A compact Llama-style decoder: token embedding, pre-norm blocks (RMSNorm, causal self-attention with
rotary embeddings and grouped KV heads, SwiGLU MLP), final RMSNorm and an untied LM head.

The repeated blocks live in ``model.layers`` (an ``nn.ModuleList``), which is what hytrain's block
detection looks for.

It is called as transformers' causal LMs are: ``model(tokens)`` gives the logits, ``model(tokens,
labels)`` the next-token loss, the labels shifted inside the model (``model(tokens, tokens)`` trains
position t to predict token t + 1; labels of -100 carry no loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


IGNORE_INDEX = -100


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy (in fp32) of ``logits[:, :-1]`` against ``labels[:, 1:]``: the logits at
    position t are scored against the label of position t + 1, as transformers' causal LMs shift their
    ``labels``. Labels equal to -100 (prompts, padding) carry no loss and are not counted in the mean.

    ``logits``: (batch, seq, vocab); ``labels``: (batch, seq), aligned with the input tokens (pass the
    tokens themselves for plain next-token prediction, not tokens shifted by one).
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels of shape {tuple(labels.shape)} for tokens of shape {tuple(logits.shape[:-1])}: "
                         "the labels are aligned with the tokens (the model shifts them itself)")
    # The labels move left (the last position gets -100) rather than the logits: no copy of the logits
    # beyond their fp32 cast.
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX)


@dataclass
class LlamaConfig:
    """The decoder's shape.

    ``vocab_size``: rows of the embedding and the LM head. ``hidden_size``: the residual width, split
    into ``num_heads`` attention heads (the head dimension must be even, for the rotary embedding);
    ``num_kv_heads`` of them carry keys and values (grouped-query attention; it divides
    ``num_heads``). ``intermediate_size``: the SwiGLU MLP's width. ``num_layers``: the repeated
    blocks. ``max_seq_len``: the longest sequence a forward takes (the rotary tables' length);
    ``rope_theta``: the rotary base; ``norm_eps``: RMSNorm's epsilon.
    """

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
        """The model's parameter count, from the shape alone."""
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
    """The decoder of ``config`` (a :class:`LlamaConfig`), weights drawn from N(0, 0.02), norms at 1.

    ``model(tokens)`` returns the logits; ``model(tokens, labels)`` the next-token loss, with the
    labels shifted inside (see :meth:`forward`), so ``model(tokens, tokens)`` is causal language
    modelling. ``checkpointing=True``: each layer is recomputed in backward (activation
    checkpointing).
    """

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

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens``: (batch, seq) token ids, seq at most ``config.max_seq_len``.

        Without ``labels``: the logits, (batch, seq, vocab_size), in the weights' dtype; those at
        position t are the prediction of token t + 1 (the attention is causal).

        With ``labels`` (batch, seq; usually the tokens themselves): the loss, a scalar in fp32 -- the
        mean cross-entropy of the logits at positions 0 .. seq - 2 against ``labels[:, 1:]``. The
        shift happens here, as in transformers' ``LlamaForCausalLM(input_ids, labels=...)``: pass
        the labels aligned with the tokens, never shifted by one already. Labels of -100 carry no
        loss (a prompt, padding); a row's first label is never used.
        """
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
        if labels is None:
            return logits
        return next_token_loss(logits, labels)
