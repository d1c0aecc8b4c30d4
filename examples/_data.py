"""The examples' training data and their check that a model learned it.

The data is a Markov chain over token ids 0..31, each token followed by one of 4 (a fixed table), so
there is something to learn. The check is the next-token loss on unseen rows, from the logits
(position t scored against token t + 1), against the unigram baseline: the entropy of the token
frequencies, the best a model that ignores the context can do.

An example imports this module from its own directory (``python examples/x.py`` puts it first on
``sys.path``); a copy of an example elsewhere needs this file beside it.
"""

import torch
import torch.nn.functional as F

FOLLOWERS = torch.randint(0, 32, (32, 4), generator=torch.Generator().manual_seed(0))


def markov_rows(n, seed, length=32):
    """n rows of ``length`` token ids, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    cols = [torch.randint(0, 32, (n,), generator=g)]
    while len(cols) < length:
        cols.append(FOLLOWERS[cols[-1], torch.randint(0, 4, (n,), generator=g)])
    return torch.stack(cols, dim=1)


def held_out_loss(model, seen, device):
    """(next-token loss on unseen rows, unigram baseline of the rows ``seen`` in training)."""
    rows = markov_rows(16, seed=1_000_000).to(device)
    with torch.no_grad():
        out = model(rows)  # without labels: the logits (a transformers model: in its output's .logits)
    logits = getattr(out, "logits", out).float()
    held = F.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten()).item()
    p = torch.bincount(seen.flatten().cpu()).double() / seen.numel()
    return held, -(p[p > 0] * p[p > 0].log()).sum().item()
