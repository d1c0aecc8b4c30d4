"""transformers' Trainer with HybridAdamW: HybridTrainer builds the optimizer from the
TrainingArguments (learning_rate, weight_decay, adam_beta1/2) and does the max_grad_norm clipping
inside the update. A tiny Llama with random weights.

    python examples/trainer.py

The Trainer puts the model on the GPU when there is one. The data has something to learn (a Markov
chain: each token is followed by one of four); the script checks that the model predicts the next
token of unseen rows better than the token frequencies alone do.
"""

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from hytrain.integrations import HybridTrainer

from _data import held_out_loss, markov_rows  # examples/_data.py

torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(config)
tokens = markov_rows(64, seed=0)
dataset = [{"input_ids": row, "labels": row} for row in tokens]  # the model shifts the labels itself

with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, max_steps=40, per_device_train_batch_size=8, learning_rate=3e-3,
                             weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=2,
                             logging_steps=8, save_strategy="no", report_to="none", disable_tqdm=True,
                             dataloader_pin_memory=torch.cuda.is_available())
    trainer = HybridTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()

held, unigram = held_out_loss(model, tokens, args.device)
print(f"held-out next-token loss {held:.3f}, unigram baseline {unigram:.3f}")
assert held < unigram - 0.3, "the model has not learned which tokens come next"
