"""`hytrain train` on a pretrained transformers model and real data: a tiny Llama saved with
`save_pretrained` beside a BPE tokenizer made here, data made here (gzip JSONL shards, instruction
JSONL). The first loss is what transformers computes for that model on that batch (the tokenizer's
tokens, the prompts carrying no loss); a resume in the middle of a shard gives the same losses bit for
bit, at one and two processes; the model directory written at the end loads in transformers and gives
the job's final validation loss; bad input is one line."""

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from hytrain.job import main  # noqa: E402
from hytrain.job.corpus import open_corpus  # noqa: E402
from hytrain.job.tokenizers import HFTokenizer  # noqa: E402

FAST = ["--batch-size", "4", "--seq-len", "48", "--no-progress", "--device", "cpu", "--workers", "1",
        "--eval-batches", "2", "--lr", "1e-3"]  # (all in the warm-up: the schedule does not depend on --steps)
WORDS = "the a cat dog runs jumps over under quick brown lazy fox red blue green sky tree and of".split()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(model directory, shards directory, instruction JSONL)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("real")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 50))) for _ in range(1200)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model_dir = root / "model"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    shards = root / "shards"
    shards.mkdir()
    for i in range(3):  # C4's layout: each shard a gzip file of JSON lines
        with gzip.open(shards / f"c4-train.{i:05d}-of-00003.json.gz", "wt") as f:
            for d in docs[i::3]:
                f.write(json.dumps({"text": d, "url": "https://example.com"}) + "\n")
    inst = root / "inst.jsonl"
    with open(inst, "w") as f:
        for d in docs[:400]:
            f.write(json.dumps({"prompt": "Repeat: " + d[:30], "response": d[:30]}) + "\n")
    return model_dir, shards, inst


def metrics(out):
    return [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]


def first_batch(made, data, batch=4, seq=48):
    tok = HFTokenizer.load(made[0])
    stream = open_corpus(str(data), tok, seq_len=seq).train_stream()
    try:
        return stream.take(batch)
    finally:
        stream.close()


def hf_loss(model_dir, tokens, mask):
    """transformers' own loss for the batch: labels shifted by the model, prompts' targets -100."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    labels = tokens.clone()
    labels[:, 1:][~mask] = -100
    with torch.no_grad():
        return float(model(input_ids=tokens, labels=labels).loss)


@pytest.mark.parametrize("which", ["shards", "instructions"])
def test_the_first_loss_is_transformers_own_on_the_tokenizers_tokens(made, tmp_path, which):
    model_dir, shards, inst = made
    data = shards if which == "shards" else inst
    out = tmp_path / "run"
    assert main(["--model", str(model_dir), "--data", str(data), "--steps", "1", "--eval-every", "0",
                 "--no-export", "--out", str(out), *FAST]) == 0
    tokens, mask = first_batch(made, data)
    if which == "instructions":
        assert (~mask).any() and mask.any()  # the prompts carry no loss, the responses do
    else:
        assert mask.all() and (tokens == HFTokenizer.load(model_dir).eos_id).any()  # EOS between documents
    assert metrics(out)[0]["loss"] == pytest.approx(hf_loss(model_dir, tokens, mask), rel=1e-5, abs=1e-6)


def test_a_resume_in_the_middle_of_a_shard_is_bit_identical(made, tmp_path):
    model_dir, shards, _ = made
    args = ["--model", str(model_dir), "--data", str(shards), "--eval-every", "0", "--save-every", "3",
            "--no-export", *FAST]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(["--steps", "6", "--out", str(whole), *args]) == 0
    assert main(["--steps", "3", "--out", str(part), *args]) == 0
    meta = json.loads((part / "checkpoints" / "step_00000003" / "meta.json").read_text())
    cursor = (meta.get("config") or meta.get("extra"))["data_cursor"]
    assert cursor["record"] > 0 or cursor["offset"] > 0, cursor  # inside a shard, not at its start
    assert main(["--steps", "6", "--out", str(part), "--resume", "latest", *args]) == 0
    assert [r["loss"] for r in metrics(part)] == [r["loss"] for r in metrics(whole)]


@pytest.mark.timeout(600)
def test_a_resume_of_two_processes_reads_on_where_they_stopped(made, tmp_path):
    from test_distributed import _env

    model_dir, shards, _ = made
    args = ["--model", str(model_dir), "--data", str(shards), "--eval-every", "0", "--save-every", "2",
            "--no-export", *FAST]

    def job(*extra):
        proc = subprocess.run([sys.executable, "-m", "hytrain", "train", *args, *extra], capture_output=True,
                              text=True, timeout=300, env=_env())
        assert proc.returncode == 0, proc.stderr[-4000:]

    whole, again = tmp_path / "whole", tmp_path / "again"
    job("--steps", "4", "--out", str(whole), "--nproc", "2")
    ck = whole / "checkpoints" / "step_00000002"
    job("--steps", "4", "--out", str(again), "--resume", str(ck), "--nproc", "2")
    want = {r["step"]: r["loss"] for r in metrics(whole)}
    assert {r["step"]: r["loss"] for r in metrics(again)} == {3: want[3], 4: want[4]}


def test_the_model_written_at_the_end_loads_and_gives_the_final_validation_loss(made, tmp_path):
    # (--keep 0: no checkpoint, as for a fine-tune whose optimizer state is not wanted afterwards.)
    from transformers import AutoModelForCausalLM

    model_dir, shards, _ = made
    out = tmp_path / "run"
    assert main(["--model", str(model_dir), "--data", str(shards), "--steps", "3", "--eval-every", "0",
                 "--keep", "0", "--out", str(out), *FAST]) == 0
    assert not any((out / "checkpoints").glob("step_*"))  # --keep 0: the model directory alone
    final = [r for r in metrics(out) if "val_loss" in r][-1]["val_loss"]
    exported = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    tok = HFTokenizer.load(out / "model")  # the tokenizer files went with it
    rows = open_corpus(str(shards), tok, seq_len=48).validation(8)  # the held-out rows, in whole batches
    losses = []
    with torch.no_grad():
        for i in range(0, len(rows) - 3, 4):
            tokens = torch.stack([r[0] for r in rows[i:i + 4]])
            losses.append(float(exported(input_ids=tokens, labels=tokens).loss))
    assert losses and sum(losses) / len(losses) == pytest.approx(final, rel=1e-5)


def test_bad_input_is_one_line(made, tmp_path, capsys):
    import shutil

    model_dir, shards, inst = made
    no_weights, no_tokenizer = tmp_path / "no_weights", tmp_path / "no_tokenizer"
    shutil.copytree(model_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    shutil.copytree(model_dir, no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "c4-train.00000-of-00001.json.gz").write_bytes(b"")
    cases = {
        "no_weights": (["--model", str(no_weights), "--data", str(shards)], "safetensors"),
        "no_tokenizer": (["--model", str(no_tokenizer), "--data", str(shards)], "no tokenizer files"),
        "field": (["--model", str(model_dir), "--data", str(shards), "--text-field", "body"], "'body'"),
        "empty": (["--model", str(model_dir), "--data", str(empty)], "empty"),
        "positions": (["--model", str(model_dir), "--data", str(shards), "--seq-len", "256"], "128 positions"),
        "vocabulary": (["--model", "tiny", "--data", str(shards), "--tokenizer", str(model_dir), "--seq-len", "32"],
                       "does not fit the model's embedding"),
    }
    for name, (argv, want) in cases.items():
        assert main([*FAST, *argv, "--steps", "1", "--out", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert want in err and err.count("\n") == 0, (name, err)
