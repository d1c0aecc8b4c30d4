"""A model whose weights need not fit on the GPU: hytrain.stream_model keeps its last layers' bf16
weights in host memory and streams them through a window of layers, while HybridAdamW trains it
exactly as it would train the same model resident.

    python examples/streamed_model.py

A small transformers Llama is saved and loaded back as a pretrained one would be; half of its layers
stream (`stream=2`; the default, "auto", streams only where the weights do not leave half the GPU
free). It trains on the GPU when there is one, else on the CPU, checks that the loss fell, and that
the same model trained resident ends with the same weights, bit for bit.
"""

import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hytrain

from _data import markov_rows  # examples/_data.py

STEPS = 16
device = "cuda" if torch.cuda.is_available() and hytrain.cuda_available() else "cpu"
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
batches = [markov_rows(4, seed=step).to(device) for step in range(STEPS)]


def train(path, stream):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, use_cache=False)  # on the CPU
    if hasattr(model, "activation_checkpointing_enable"):  # (older transformers: gradient_checkpointing_enable)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    window = hytrain.stream_model(model, device, stream=stream)  # moved layer by layer
    opt = hytrain.HybridAdamW(model.parameters(), lr=1e-2, model=model, state_format="8bit", max_grad_norm=1.0)
    model.train()
    losses = []
    for step in range(STEPS):
        x = batches[step]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict(), window  # (the streamed weights come from host memory)


with tempfile.TemporaryDirectory() as path:
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    losses, weights, window = train(path, stream=2)
    resident_losses, resident_weights, _ = train(path, stream=0)

print(window)
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
assert window.streamed == [2, 3], window.streamed
assert losses[-1] < 0.8 * losses[0], losses
assert losses == resident_losses, (losses, resident_losses)
for name, w in resident_weights.items():
    assert torch.equal(w.cpu(), weights[name].cpu()), name
print("streamed and resident training agree bit for bit")
