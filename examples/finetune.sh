#!/usr/bin/env bash
# Fine-tuning a pretrained transformers model with `hytrain train`: a tiny Llama and a BPE tokenizer
# (saved with save_pretrained, as any model directory on the Hub is) and JSON-lines data are made
# here; the job trains them and writes OUT/model, a model directory that transformers loads.
#
#   bash examples/finetune.sh [WORKDIR]      # WORKDIR: where to put everything (default: a temp dir)
#
# On a GPU the same command trains there (bf16 weights). With your own model and data, --model and
# --data take their paths (README.md, "Fine-tune a Hugging Face model", has whole commands).
set -euo pipefail

WORK=${1:-$(mktemp -d)}
mkdir -p "$WORK"
echo "working in $WORK"

# 1. A "pretrained" model directory and a data file (in practice: downloaded ones).
python3 - "$WORK" <<'PY'
import json, random, sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

work = sys.argv[1]
rng = random.Random(0)
words = "the a cat dog runs jumps over under quick brown lazy fox red blue green sky tree and of".split()
docs = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 40))) for _ in range(2000)]

bpe = Tokenizer(models.BPE(unk_token="<unk>"))
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                  show_progress=False))  # (its bar prints blank lines to a pipe)
tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                              unk_token="<unk>")
config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(f"{work}/base")
tok.save_pretrained(f"{work}/base")
with open(f"{work}/train.jsonl", "w") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
PY

# 2. Fine-tune: the model's own tokenizer reads the data; --keep 0 writes no optimizer checkpoint,
#    only OUT/model at the end.
hytrain train --model "$WORK/base" --data "$WORK/train.jsonl" --steps 4 --batch-size 4 --seq-len 64 \
  --lr 1e-3 --warmup 1 --eval-every 2 --eval-batches 2 --keep 0 --no-progress --out "$WORK/run"

# 3. The result is an ordinary transformers model directory.
python3 - "$WORK/run/model" <<'PY'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path)
tok = AutoTokenizer.from_pretrained(path)
inputs = tok("the quick brown", return_tensors="pt")
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
print("generated:", tok.decode(out[0], skip_special_tokens=True))
PY
