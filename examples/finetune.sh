#!/usr/bin/env bash
# Fine-tuning a pretrained transformers model with `hytrain train`: a tiny Llama and a BPE tokenizer
# (saved with save_pretrained, as any model directory on the Hub is) and JSON-lines data are made
# here; the job trains them and writes OUT/model, a model directory that transformers loads.
#
#   bash examples/finetune.sh [WORKDIR]      # WORKDIR: where to put everything (default: a temp dir)
#
# The "pretrained" model's weights are random (nothing is downloaded) and the data is a few phrases
# repeated: what it prints at the end, the fine-tuned model's greedy continuation of "the quick brown",
# is what the 60 steps taught it ("fox jumps over the lazy dog ..."). From random weights that takes a
# pre-training --lr (3e-3); a real pretrained model fine-tunes at --lr's default, 2e-5.
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
# (Phrases, not words drawn at random: a continuation that can be learned, so the sample shows it.)
phrases = ["the quick brown fox jumps over the lazy dog", "a red cat runs under the green tree",
           "the blue sky is over the tree", "a lazy dog and a quick cat"]
docs = [" ".join(rng.choice(phrases) for _ in range(rng.randint(2, 8))) for _ in range(3000)]

bpe = Tokenizer(models.BPE(unk_token="<unk>"))
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
# (400: room for every word, with its leading space and without, as one token: whole words in the sample)
bpe.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
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
hytrain train --model "$WORK/base" --data "$WORK/train.jsonl" --steps 60 --batch-size 8 --seq-len 64 \
  --lr 3e-3 --warmup 5 --eval-every 20 --eval-batches 2 --keep 0 --no-progress --out "$WORK/run"

# 3. The result is an ordinary transformers model directory: its greedy continuation of a prompt.
python3 - "$WORK/run/model" <<'PY'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path)
tok = AutoTokenizer.from_pretrained(path)
prompt = "the quick brown"
inputs = tok(prompt, return_tensors="pt")
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
said = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
if not said.strip():  # (a model that learned nothing continues with spaces, or nothing)
    sys.exit(f"the fine-tuned model continues {prompt!r} with {said!r}: it learned nothing from the data")
print("generated:", prompt + said)
PY
