"""transformers' Trainer with HybridAdamW: HybridTrainer builds the optimizer from the
TrainingArguments (learning_rate, weight_decay, adam_beta1/2) and does the max_grad_norm clipping
inside the update. A tiny Llama with random weights, trained on random tokens.

    python examples/trainer.py

The Trainer puts the model on the GPU when there is one.
"""

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from hytrain.integrations import HybridTrainer


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=16, seq_len=32, vocab_size=128):
        self.tokens = torch.randint(0, vocab_size, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(config)

with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, max_steps=24, per_device_train_batch_size=8, learning_rate=3e-3,
                             weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=2,
                             logging_steps=6, save_strategy="no", report_to="none", disable_tqdm=True)
    trainer = HybridTrainer(model=model, args=args, train_dataset=RandomTokens())
    trainer.train()

losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
print("logged losses:", [round(x, 3) for x in losses])
assert losses[-1] < losses[0], "the loss should have fallen"
