"""Fine-tuning a pretrained model with `hytrain train`, as a user runs it: a Llama checkpoint on local
disk (safetensors, written here with random weights by `save_pretrained`, since the GPU machine has no
network) beside a byte-level BPE tokenizer trained here, and C4-style gzip JSONL shards of synthetic
text. Per size, one `hytrain train` process, timed from the command's start:

  first_step_s   command start -> the first step's metrics record (load, tokenizer, data, state, step)
  startup_s      the job's own account (summary.json): seconds from its process's start to the end of
                 loading the model, building the optimizer and the first step
  iter_s         median step time of the steps after the first two
  data_wait      the share of the step time the loop waited for the reader thread (median)
  peak_gpu_reserved_gb, peak_host_gb   from the run's summary.json (caching allocator; process RSS)
  total_s        the whole command (with --export: writing OUT/model, a Hugging Face directory, at the end)

Shapes (transformers LlamaForCausalLM, untied, vocab 32000): 7b hidden 4096 x 32 layers, 13b hidden 5120
x 40 layers, 70b Llama-2-70B's (hidden 8192 x 80 layers, 8 KV heads); 32b is Qwen2.5-32B's (hidden 5120 x
64 layers, 8 KV heads, vocab 152064). 32b and 70b are written from host memory (a machine kind with a
large host and disk: their checkpoints take 65 and 138 GB); the job streams them by itself. Micro-batch --batch-size x --seq-len tokens, activation checkpointing on; --keep 0 (no
checkpoint: a 7 B model's with fp32 states is 94 GB, more than the GPU machine's disk holds).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timed_window import window_figures  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40),
    # Qwen2.5-32B's shape as a Llama (GQA, vocab 152064): 32.8 B
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
    # Llama-2-70B's shape (GQA): 69.0 B
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}
BUILT_ON_HOST = ("32b", "70b")  # their bf16 weights (65, 138 GB) are made and saved from host memory
WORDS = ("the of and to in is was for on that with as by at from his her they which this be are an had "
         "not were but have one their all there been has would when who will more no if out so said what up "
         "its about into than them can only other new some could time these two may then do first any my now "
         "such like our over man me even most made after also did many before must through back years where").split()


def make_tokenizer(where: Path, docs) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(where)


def make_model(where: Path, size: str, device: str) -> float:
    """A random Llama of the shape, saved in bf16 safetensors shards; returns the seconds taken."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    shape = {"vocab_size": 32000 if size != "tiny" else 512, **SHAPES[size]}
    cfg = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      **shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(torch.bfloat16)
    if size in BUILT_ON_HOST:  # drawing 33-69 B normals on the CPU would take minutes: a tiled pool of them
        from capacity_bench import init_params

        init_params(list(model.parameters()))
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(where, max_shard_size="5GB")
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()  # the job is another process: this one gives the GPU back
    return time.perf_counter() - t0


def make_data(where: Path, shards: int, docs_per_shard: int):
    rng = random.Random(0)
    where.mkdir(parents=True, exist_ok=True)
    sample = []
    for i in range(shards):
        with gzip.open(where / f"c4-train.{i:05d}-of-{shards:05d}.json.gz", "wt") as f:
            for _ in range(docs_per_shard):
                doc = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 800)))
                if len(sample) < 2000:
                    sample.append(doc)
                f.write(json.dumps({"text": doc, "url": "https://example.com"}) + "\n")
    return sample


def run_job(model: Path, data: Path, out: Path, args, size: str) -> dict:
    cmd = [sys.executable, "-m", "hytrain", "train", "--model", str(model), "--data", str(data),
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--activation-checkpointing",
           "--lr", "1e-5", "--out", str(out), "--state-format", args.state_format[size], "--keep", "0",
           "--export" if args.export else "--no-export"]
    subprocess.run(["rm", "-rf", str(out)], check=True)  # a fresh run, nothing of an earlier one
    metrics = out / "metrics.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    while proc.poll() is None:
        if first is None and metrics.is_file() and metrics.stat().st_size:
            first = time.perf_counter() - t0
        time.sleep(0.2)
    total = time.perf_counter() - t0
    text = proc.stdout.read()
    rec = {"size": size, "state_format": args.state_format[size], "rc": proc.returncode, "first_step_s": first,
           "total_s": round(total, 1)}
    if proc.returncode != 0:
        rec["error"] = text.strip().splitlines()[-1:] if text.strip() else None
        return rec
    rows = [json.loads(line) for line in metrics.open()]
    later = rows[2:] or rows
    summary = json.loads((out / "summary.json").read_text())
    rec.update(iter_s=statistics.median(r["step_s"] for r in later), k=rows[-1].get("k"),
               data_wait=statistics.median(r.get("data_wait_frac", 0.0) for r in later),
               gpu_wait=statistics.median(r.get("gpu_wait_frac", 0.0) for r in later if "gpu_wait_frac" in r)
               if any("gpu_wait_frac" in r for r in later) else None,
               loss_first=rows[0]["loss"], loss_last=rows[-1]["loss"], params=summary["params"],
               peak_gpu_reserved_gb=summary.get("peak_gpu_reserved_gb"), peak_host_gb=summary["peak_host_gb"],
               model_dir=summary.get("model_dir"), startup_s=summary.get("startup_s"),
               state_made_s=summary.get("state_made_s"), state_made_memory=summary.get("state_made_memory"),
               **window_figures([r["step_s"] for r in later], args.batch_size * args.seq_len))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7b")
    ap.add_argument("--formats", default="fp32", help="state format per size, comma-separated (one: all)")
    ap.add_argument("--root", default="/tmp/finetune")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--docs-per-shard", type=int, default=4000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--export", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="keep a model directory an earlier run wrote (and leave "
                    "the last size's in place)")
    args = ap.parse_args(argv)
    sizes = args.sizes.split(",")
    formats = args.formats.split(",")
    args.state_format = {s: formats[min(i, len(formats) - 1)] for i, s in enumerate(sizes)}
    root = Path(args.root)
    data = root / "data"
    sample = make_data(data, args.shards, args.docs_per_shard)
    for size in sizes:
        model = root / size
        made_s = 0.0
        if not (args.reuse and (model / "config.json").is_file() and (model / "tokenizer.json").is_file()):
            made_s = make_model(model, size, "cpu" if size in BUILT_ON_HOST else args.device)
            make_tokenizer(model, sample)
        rec = run_job(model, data, root / f"run-{size}", args, size)
        rec["checkpoint_write_s"] = round(made_s, 1)
        print(json.dumps(rec), flush=True)
        if size != sizes[-1] and not args.reuse:
            subprocess.run(["rm", "-rf", str(model), str(root / f"run-{size}")], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
