"""The streamed data can be trusted whatever is in it: a record of 50 MB is tokenized in pieces, host
memory following the piece rather than the record (and the pieces give the tokens of the whole); a
tokenizer without EOS is refused in one line naming --eos-token, which gives one; a data file rewritten
under a checkpoint is noticed on resume (one line, the data read from its beginning) while an unchanged
one resumes at its cursor; undecodable bytes are reported on the line that holds them."""

import gzip
import json
import random
import time
import tracemalloc
from argparse import Namespace

import pytest
import torch

from hytrain.job import main
from hytrain.job import records as records_module
from hytrain.job.corpus import open_corpus
from hytrain.job.data import open_data
from hytrain.job.options import ConfigError
from hytrain.job.tokenizers import ByteTokenizer, HFTokenizer, with_eos

WORDS = "the cat dog sat on a mat and ran far away quickly over hill river stone tree".split()
FAST = ["--batch-size", "4", "--seq-len", "32", "--no-progress", "--device", "cpu", "--workers", "1",
        "--eval-every", "0", "--eval-batches", "1", "--no-export"]


def words(n, seed):
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) for _ in range(n))


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def small_val(tmp_path):
    return str(write_jsonl(tmp_path / "val.jsonl", [words(40, i) for i in range(30)]))


def data_args(data, **over):
    args = dict(data=str(data), data_kind="auto", text_field="text", val_data=None, seed=0, batch_size=2,
                seq_len=16, max_data_bytes=1 << 20, eos_token=None)
    return Namespace(**{**args, **over})


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE tokenizer (GPT-2's kind) with EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([words(30, i) + "\n" + words(20, -i) for i in range(300)], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def words_dir(tmp_path_factory):
    """A word-level tokenizer of 20 tokens and no EOS (small enough for the tiny preset's 256 rows);
    ``</s>`` is one of its tokens, not its EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("words")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


# ---- a long record

@pytest.mark.parametrize("fmt", ["jsonl", "json.gz"])
def test_a_50_mb_record_is_read_with_memory_of_the_piece_not_of_the_record(tmp_path, fmt):
    unit = "the cat sat on the mat\nand ran far away over the hill "
    text = unit * (50_000_000 // len(unit))   # one document of 50 MB on one line
    line = (json.dumps({"text": text}) + "\n").encode()
    path = tmp_path / f"big.{fmt}"
    if fmt == "jsonl":
        path.write_bytes(line)
    else:
        with gzip.open(path, "wb", compresslevel=1) as f:
            f.write(line)
    del line
    c = open_corpus(str(path), ByteTokenizer(), seq_len=1023, val_spec=small_val(tmp_path), read_ahead=2)
    t0 = time.perf_counter()
    tracemalloc.start()
    s = c.train_stream()
    tokens, _ = s.take(64)
    cursor = s.cursor()
    s.close()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    seconds = time.perf_counter() - t0
    assert bytes(tokens.flatten().tolist()) == text.encode()[:64 * 1024]
    assert cursor == {"epoch": 0, "file": path.name, "record": 0, "offset": 64 * 1024}
    # The record is held twice while it is read (its line, then its text: 50 MB each), then once; the
    # pieces add a few MB. Its tokens whole would be 400 MB more (a list of 50 M ids): 1.3 GB in all.
    assert peak < 3 * len(text), f"peak {peak / 1e6:.0f} MB for a {len(text) / 1e6:.0f} MB record"
    assert seconds < 30, seconds


def test_a_long_record_is_the_tokens_of_the_whole_and_resumes_inside_any_piece(tmp_path, bpe_dir, monkeypatch):
    monkeypatch.setattr(records_module, "PIECE_CHARS", 300)   # pieces of 150-300 characters
    hf = HFTokenizer.load(bpe_dir)
    given = []
    encode_batch = hf.encode_batch
    monkeypatch.setattr(hf, "encode_batch", lambda texts: given.extend(map(len, texts)) or encode_batch(texts))
    long = "\n".join(words(60, i) + ("\n\n" if i % 7 == 0 else "") for i in range(40))   # 40 lines, some blank
    long += " " + "x" * 700   # a word longer than a piece: cut at the budget
    texts = [words(10, 1), long, words(12, 2), "y" * 900]
    path = write_jsonl(tmp_path / "docs.jsonl", texts)
    c = open_corpus(str(path), hf, seq_len=15, val_spec=small_val(tmp_path))
    expected = [t for text in texts for t in hf.tok(text, add_special_tokens=False)["input_ids"] + [hf.eos_id]]
    n = len(expected) // 16
    s = c.train_stream()
    whole = s.take(n)[0]
    s.close()
    assert max(given) <= 300, max(given)   # the tokenizer never saw a whole long record
    # Cut after a line break or before a space, this byte-level BPE gives the whole text's tokens; the
    # 700 x's and the 900 y's are cut inside a word (the tokens may differ there) and decode the same.
    assert hf.tok.decode(whole.flatten().tolist()) == hf.tok.decode(expected[:n * 16])
    exact = len(hf.tok(texts[0] + long[:long.index(" x")], add_special_tokens=False)["input_ids"]) + 1
    assert whole.flatten().tolist()[:exact] == expected[:exact]
    for k in (1, 3, 7, 12, n // 2, n - 2):   # cursors inside the long record's pieces and after it
        s = c.train_stream()
        s.take(k)
        cursor = s.cursor()
        s.close()
        s = c.train_stream(json.loads(json.dumps(cursor)))
        assert torch.equal(s.take(n - k)[0], whole[k:]), (k, cursor)
        s.close()


def test_a_long_prompt_is_tokenized_only_as_far_as_a_row_reaches(tmp_path, bpe_dir, monkeypatch):
    monkeypatch.setattr(records_module, "PIECE_CHARS", 200)
    hf = HFTokenizer.load(bpe_dir)
    given = []
    encode_batch = hf.encode_batch
    monkeypatch.setattr(hf, "encode_batch", lambda texts: given.extend(map(len, texts)) or encode_batch(texts))
    records = [{"prompt": "the cat", "response": " " + words(3000, 5)},   # 15 K characters of response
               {"prompt": words(3000, 6), "response": " sat"}]           # a prompt longer than a row: skipped
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records * 2))
    c = open_corpus(str(path), hf, seq_len=24, val_spec=str(path))
    rows = c.validation(4)   # one pass over the four records (a train stream would read ahead, epoch after epoch)
    assert len(rows) == 2
    tokens, mask = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    ids = [hf.bos_id] + hf.encode("the cat") + hf.encode(records[0]["response"])
    assert tokens[0].tolist() == ids[:25] and tokens[1].tolist() == ids[:25]
    assert mask.sum() == 2 * (24 - len(hf.encode("the cat")))   # the response's targets: the rest of the row
    assert max(given) <= 200 and sum(given) < 3000, (max(given), sum(given))   # a few pieces, not 30 K characters


# ---- EOS

def test_a_tokenizer_without_eos_is_refused_naming_eos_token_and_eos_token_gives_one(tmp_path, words_dir):
    path = write_jsonl(tmp_path / "a.jsonl", [words(12, i) for i in range(60)])
    hf = HFTokenizer.load(words_dir)
    for tokenizer in (hf,):  # (the byte tokenizer packs bytes: no token to spare)
        with pytest.raises(ConfigError, match="no EOS token.*--eos-token") as e:
            open_data(data_args(path), tokenizer)
        assert "\n" not in str(e.value)
    data = open_data(data_args(path, eos_token="</s>"), HFTokenizer.load(words_dir))
    tokens, _ = data.batch(0)
    data.close()
    assert tokens.flatten().tolist()[:13] == hf.encode(words(12, 0)) + [hf.tok.get_vocab()["</s>"]]
    data = open_data(data_args(path, eos_token="\n", seq_len=127), ByteTokenizer())
    tokens, _ = data.batch(0)
    data.close()
    assert "\n".join(words(12, i) for i in range(60)).encode().startswith(bytes(tokens.flatten().tolist()))
    assert tokens.flatten().tolist().count(ord("\n")) >= 3
    for text, message in (("the cat", "'the cat' is 2 tokens, not one"),
                          ("zebra", "not in the tokenizer's vocabulary")):
        with pytest.raises(ConfigError, match=message):
            with_eos(HFTokenizer.load(words_dir), text)
    with pytest.raises(ConfigError, match="'é' is 2 bytes, not one"):
        with_eos(ByteTokenizer(), "é")


def test_the_job_refuses_a_tokenizer_without_eos_in_one_line_and_trains_with_eos_token(tmp_path, words_dir, capsys):
    path = write_jsonl(tmp_path / "a.jsonl", [words(12, i) for i in range(300)])
    argv = ["--model", "tiny", "--tokenizer", str(words_dir), "--data", str(path), "--val-data", small_val(tmp_path),
            "--steps", "1", *FAST]
    assert main([*argv, "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--eos-token" in err and "no EOS token" in err and "\n" not in err, err
    assert main([*argv, "--out", str(tmp_path / "trained"), "--eos-token", "</s>"]) == 0
    # The byte alphabet has no token to spare: the presets pack documents as bytes (--eos-token adds one).
    assert main(["--model", "tiny", "--data", str(path), "--val-data", small_val(tmp_path), "--steps", "1", *FAST,
                 "--out", str(tmp_path / "b")]) == 0


# ---- fingerprints

def cursor_of(out, step):
    meta = json.loads((out / "checkpoints" / f"step_{step:08d}" / "meta.json").read_text())
    return (meta.get("config") or meta.get("extra"))["data_cursor"]


def test_a_data_file_rewritten_under_a_checkpoint_is_read_from_its_beginning(tmp_path, capsys):
    docs = [words(random.Random(i).randint(5, 30), i) for i in range(400)]
    path = write_jsonl(tmp_path / "a.jsonl", docs)
    argv = ["--model", "tiny", "--data", str(path), "--eos-token", "\n", "--save-every", "1", *FAST]
    out = tmp_path / "run"
    assert main([*argv, "--steps", "2", "--out", str(out)]) == 0
    at_2 = cursor_of(out, 2)
    assert at_2["record"] > 0 and at_2["files"]["a.jsonl"]["size"] == path.stat().st_size
    random.Random(1).shuffle(docs)   # the same file, shuffled in place: the same size
    size = path.stat().st_size
    write_jsonl(path, docs)
    assert path.stat().st_size == size
    capsys.readouterr()
    assert main([*argv, "--steps", "3", "--out", str(out), "--resume", "latest"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "differ from the checkpoint's" in line]
    assert said == [f"hytrain train: the data files differ from the checkpoint's: a.jsonl (contents, modification "
                    f"time); {path} is read from its beginning"], said
    fresh = open_data(data_args(path, eos_token="\n", batch_size=4, seq_len=32), ByteTokenizer())
    fresh.batch(0)   # one step from the beginning of the shuffled file: where the resumed step ends
    assert cursor_of(out, 3) == fresh.cursor()
    fresh.close()


def test_a_cursor_with_other_files_restarts_and_one_without_fingerprints_resumes(tmp_path):
    (tmp_path / "d").mkdir()
    a = write_jsonl(tmp_path / "d" / "a.jsonl", [words(20, i) for i in range(50)])
    write_jsonl(tmp_path / "d" / "b.jsonl", [words(20, -i) for i in range(50)])
    args = data_args(tmp_path / "d", eos_token="\n", val_data=small_val(tmp_path))
    data = open_data(args, ByteTokenizer())
    data.batch(0)
    cursor = json.loads(json.dumps(data.cursor()))
    data.close()
    assert set(cursor["files"]) == {"d/a.jsonl", "d/b.jsonl"}
    said = []
    data = open_data(args, ByteTokenizer(), cursor, say=said.append)
    assert data.cursor() == cursor and not said   # the same files: resumed at the cursor
    data.close()
    data = open_data(args, ByteTokenizer(), {k: v for k, v in cursor.items() if k != "files"}, say=said.append)
    assert data.cursor() == cursor and not said   # an older checkpoint's cursor: resumed as before
    data.close()
    (tmp_path / "d" / "c.jsonl").write_text(a.read_text())
    data = open_data(args, ByteTokenizer(), cursor, say=said.append)
    assert data.cursor()["offset"] == 0 and data.cursor()["record"] == 0
    data.close()
    assert said == [f"hytrain train: the data files differ from the checkpoint's: d/c.jsonl (added); {args.data} is "
                    f"read from its beginning"]


# ---- undecodable bytes

@pytest.mark.parametrize("fmt", ["jsonl", "json.gz"])
def test_undecodable_bytes_are_reported_on_their_line(tmp_path, fmt):
    lines = [json.dumps({"text": words(30, i)}).encode() for i in range(800)]
    lines[499] = b'{"text": "caf\xe9 au lait"}'   # line 500: Latin-1, not UTF-8
    raw = b"\n".join(lines) + b"\n"
    path = tmp_path / f"bad.{fmt}"
    path.write_bytes(gzip.compress(raw) if fmt == "json.gz" else raw)
    c = open_corpus(str(path), ByteTokenizer(), seq_len=64, val_spec=small_val(tmp_path))
    s = c.train_stream()
    with pytest.raises(ConfigError, match=r"bad\.json(l|\.gz): line 500 is not UTF-8 text") as e:
        s.take(10_000)
    s.close()
    assert "\n" not in str(e.value)


def test_the_default_corpus_walks_the_standard_library_only_and_skips_what_vanishes(tmp_path, monkeypatch):
    """The embedded default corpus is the standard library's own sources: installed packages are not
    walked (a concurrent pip install may remove a directory under them mid-walk), and a directory
    that vanishes during the walk is skipped, not a traceback."""
    import os
    import sysconfig

    from hytrain.job import data

    root = tmp_path / "lib"
    for rel in ("a.py", "json/b.py", "test/c.py", "site-packages/pkg/d.py", "gone/e.py", "notes.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    walked, real_scandir = [], os.scandir

    def scandir(path):
        walked.append(os.path.basename(os.fspath(path)))
        if os.path.basename(os.fspath(path)) == "gone":  # removed by somebody else between listing and walking
            raise FileNotFoundError(path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    files = data.stdlib_files()
    assert [p.relative_to(root).as_posix() for p in files] == ["a.py", "json/b.py"]
    assert "site-packages" not in walked and "pkg" not in walked and "gone" in walked


# ---- data too small for a validation split

def test_small_instruction_data_trains_with_eval_every_0_and_is_otherwise_refused_naming_the_flags(tmp_path, capsys):
    path = tmp_path / "inst.jsonl"
    path.write_text("".join(json.dumps({"instruction": words(6, i), "output": words(8, -i)}) + "\n" for i in range(12)))
    argv = ["--model", "tiny", "--data", str(path), "--steps", "2", *FAST]
    assert main([*argv, "--eval-every", "5", "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert "too small for a validation split" in err and "\n" not in err, err
    assert "--val-data" in err and "--eval-every 0" in err, err
    assert not (tmp_path / "refused").exists()   # (made by the refused run, and left empty: removed)
    # --eval-every 0: no validation needed, none made; every document trains.
    out = tmp_path / "trained"
    assert main([*argv, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "prompt data; validation: none (every 100th document held out: less than a batch; --eval-every 0 " \
           "needs none: training uses every document)" in said, said
    assert not [r for r in map(json.loads, open(out / "metrics.jsonl")) if "val_loss" in r]
    assert json.load(open(out / "summary.json"))["final_val_loss"] is None


def test_small_plain_text_with_eval_every_0_trains_on_every_byte(tmp_path):
    import re

    text = tmp_path / "small.txt"
    text.write_bytes(b"".join(b"%05d " % i for i in range(840)))   # 5040 bytes: the last 5% (252) held out
    with pytest.raises(ConfigError, match="the validation split has 252") as e:
        open_data(data_args(text, seq_len=300), ByteTokenizer())
    assert "--val-data" in str(e.value) and "--eval-every 0" in str(e.value) and "\n" not in str(e.value)
    data = open_data(data_args(text, seq_len=300), ByteTokenizer(), optional_validation=True)
    assert data.validation(4) == [] and data.description == f"{text} (no validation: too small for a split, and " \
                                                           "--eval-every 0 needs none)"
    seen = b"".join(bytes(row.tolist()) for step in range(50) for row in data.batch(step)[0])
    assert max(map(int, re.findall(rb"\d{5}", seen))) >= 800   # the held-out tail (from 00798) is trained on
    # A directory whose held-out files (one in 20, by name) are too few: the same.
    (tmp_path / "dir").mkdir()
    for i in range(3):
        (tmp_path / "dir" / f"f{i}.txt").write_bytes(b"the quick brown fox jumps over the lazy dog\n" * 40)
    with pytest.raises(ConfigError, match="too small .* for a validation split.*--val-data.*--eval-every 0"):
        open_data(data_args(tmp_path / "dir"), ByteTokenizer())
    data = open_data(data_args(tmp_path / "dir"), ByteTokenizer(), optional_validation=True)
    assert data.validation(4) == [] and "(3 files, 0.0 MB train, no validation" in data.description


def test_max_data_bytes_too_small_for_the_data_is_named(tmp_path):
    text = tmp_path / "big.txt"
    text.write_bytes(b"the cat sat on the mat. " * 1000)
    with pytest.raises(ConfigError, match=r"has 100 bytes \(its first --max-data-bytes 100: raise it\)"):
        open_data(data_args(text, max_data_bytes=100), ByteTokenizer())
    with pytest.raises(ConfigError, match="--max-data-bytes 5000.*raise --max-data-bytes or lower --seq-len"):
        open_data(data_args(text, max_data_bytes=5000, seq_len=300), ByteTokenizer())
    (tmp_path / "dir").mkdir()
    for i in range(4):
        (tmp_path / "dir" / f"f{i}.txt").write_bytes(b"x" * 3000)
    with pytest.raises(ConfigError, match="--max-data-bytes 2000 stopped the reading; raise it"):
        open_data(data_args(tmp_path / "dir", max_data_bytes=2000), ByteTokenizer())
