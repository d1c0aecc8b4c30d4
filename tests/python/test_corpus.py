"""The streamed corpus (hytrain.job.corpus): rows hold the tokenizer's tokens for the documents, every
format gives the same rows, a cursor resumes bit-identically, validation is disjoint and fixed, memory
does not grow with the corpus, and bad input is a one-line ConfigError naming the problem."""

import gzip
import json
import random
import re
import threading
import tracemalloc

import pytest
import torch

from hytrain.job import records as records_module
from hytrain.job.corpus import open_corpus
from hytrain.job.tokenizers import ByteTokenizer, HFTokenizer
from hytrain.job.options import ConfigError

WORDS = "the cat dog sat on a mat and ran far away quickly over hill river stone tree é 木".split()
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def sentences(n, seed, lo=1, hi=40):
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(sentences(400, 99), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    return HFTokenizer.load(tokenizer_dir)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_gz(path, records):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def write_parquet(path, records, row_group_size=7):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def take_then_close(stream, n):
    tokens, mask = stream.take(n)
    stream.close()
    return tokens, mask


def text_records(n=120, seed=0):
    return [{"text": t, "id": i} for i, t in enumerate(sentences(n, seed))]


def held_out_val(tmp_path):
    return str(write_jsonl(tmp_path / "val.jsonl", text_records(20, seed=7)))


# ---- tokens

def test_text_rows_are_the_tokenizers_tokens_with_eos_between_documents(tmp_path, hf, tokenizer_dir):
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(tokenizer_dir)   # independent of HFTokenizer's own encoding
    records = text_records()
    c = open_corpus(str(write_jsonl(tmp_path / "a.jsonl", records)), hf, seq_len=16, val_spec=held_out_val(tmp_path))
    assert c.kind == "text" and "1 jsonl" in c.description
    expected = [t for r in records for t in raw(r["text"], add_special_tokens=False)["input_ids"] + [raw.eos_token_id]]
    n = len(expected) // 17
    tokens, mask = take_then_close(c.train_stream(), n)
    assert tokens.dtype == torch.int64 and tokens.shape == (n, 17) and mask.shape == (n, 16) and mask.all()
    assert tokens.flatten().tolist() == expected[:n * 17]
    text = raw.decode(tokens[:8].flatten().tolist())
    assert text.startswith(records[0]["text"] + "</s>" + records[1]["text"] + "</s>")


def test_text_files_directory_is_read_in_sorted_order_as_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(records_module, "TEXT_PIECE", 100)   # a file of many pieces: one document still
    d = tmp_path / "code"
    (d / "pkg").mkdir(parents=True)
    files = {"b.md": "# title\n" * 50, "pkg/__init__.py": "", "pkg/mod.py": "def f():\n    return 'é'\n" * 40,
             "z.txt": "last line\n"}
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "image.bin").write_bytes(bytes(range(256)) * 4)   # binary: skipped
    (d / ".hidden.txt").write_text("never read")
    expected = b"".join(files[n].encode() for n in ("b.md", "pkg/mod.py", "z.txt"))
    c = open_corpus(str(d), ByteTokenizer(), seq_len=31, val_spec=held_out_val(tmp_path))
    assert "3 files (3 text)" in c.description
    n = len(expected) // 32
    tokens, _ = take_then_close(c.train_stream(), n)
    assert bytes(tokens.flatten().tolist()) == expected[:n * 32]


def test_prompt_tokens_and_padding_carry_no_loss(tmp_path, hf):
    records = [{"prompt": "the cat", "response": " sat on a mat"},
               {"instruction": "the dog", "input": "ran far", "output": " away quickly"},
               {"instruction": "a tree", "input": "", "output": " stone"},
               {"prompt": "river " * 40, "response": "never seen"},   # no response token fits: skipped
               {"prompt": "hill", "response": " over the hill and far away over the river" * 3}]   # truncated
    c = open_corpus(str(write_jsonl(tmp_path / "p.jsonl", records)), hf, seq_len=24,
                    val_spec=str(write_jsonl(tmp_path / "v.jsonl", records[:1])))
    assert c.kind == "prompt"
    tokens, mask = take_then_close(c.train_stream(), 4)
    pairs = [("the cat", " sat on a mat"), ("the dog\n\nran far", " away quickly"), ("a tree", " stone"),
             ("hill", records[4]["response"])]
    for row, row_mask, (prompt, response) in zip(tokens.tolist(), mask.tolist(), pairs):
        p, r = hf.encode(prompt), hf.encode(response)
        ids = ([hf.bos_id] + p + r + [hf.eos_id])[:25]
        assert row == ids + [hf.eos_id] * (25 - len(ids))
        in_response = [len(p) + 1 <= j + 1 < len(ids) for j in range(24)]   # target j is token j + 1
        assert row_mask == in_response


def test_chat_loss_only_on_assistant_turns(tmp_path, hf, tokenizer_dir):
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(tokenizer_dir)
    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"},
              {"role": "assistant", "content": "sat on a mat"}, {"role": "user", "content": "and"},
              {"role": "assistant", "content": "ran far away"}],
             [{"role": "user", "content": "river"}, {"role": "assistant", "content": "stone tree"}]]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    c = open_corpus(str(path), hf, seq_len=64, val_spec=str(path))
    assert c.kind == "chat"
    tokens, mask = take_then_close(c.train_stream(), 2)
    for row, row_mask, messages in zip(tokens, mask, chats):
        rendered = raw.apply_chat_template(messages, tokenize=False)
        text = raw.decode(row.tolist())
        assert text.startswith(rendered) and text[len(rendered):] == "</s>" * text[len(rendered):].count("</s>")
        assert raw.decode(row[1:][row_mask].tolist()) == "".join(m["content"] + "</s>" for m in messages
                                                                   if m["role"] == "assistant")


# ---- formats

def test_every_format_gives_the_same_rows(tmp_path, hf):
    import datasets
    import pyarrow as pa

    records = text_records(90)
    val = held_out_val(tmp_path)
    (tmp_path / "shards").mkdir()
    for i in range(3):
        write_gz(tmp_path / "shards" / f"c4-train.0000{i}-of-00003.json.gz", records[i * 30:(i + 1) * 30])
    table = pa.Table.from_pylist(records)
    with pa.ipc.new_file(str(tmp_path / "t.arrow"), table.schema) as w:   # the IPC file format
        for batch in table.to_batches(max_chunksize=11):
            w.write_batch(batch)
    datasets.Dataset.from_dict({"text": [r["text"] for r in records]}).save_to_disk(tmp_path / "saved")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [r["text"] for r in records]}),
                               "validation": datasets.Dataset.from_dict({"text": ["held out"] * 3})})
    dd.save_to_disk(tmp_path / "dict")
    specs = [write_jsonl(tmp_path / "a.jsonl", records), tmp_path / "shards", write_parquet(tmp_path / "a.parquet", records),
             tmp_path / "t.arrow", tmp_path / "saved",
             f"{write_jsonl(tmp_path / 'h1.jsonl', records[:45])},{write_jsonl(tmp_path / 'h2.jsonl', records[45:])}"]
    rows = [take_then_close(open_corpus(str(s), hf, seq_len=20, val_spec=val).train_stream(), 60)[0] for s in specs]
    dict_corpus = open_corpus(str(tmp_path / "dict"), hf, seq_len=2)
    rows.append(take_then_close(open_corpus(str(tmp_path / "dict"), hf, seq_len=20, val_spec=val).train_stream(), 60)[0])
    for r in rows[1:]:
        assert torch.equal(r, rows[0])
    for s in specs[2:5]:   # Parquet row groups and Arrow batches are skipped on resume
        resumed_equals_uninterrupted(open_corpus(str(s), hf, seq_len=20, val_spec=val), [7, 23, 41], 60)
    held = "".join(hf.tok.decode(t) for t, _ in dict_corpus.validation(100))   # the validation split's text
    assert held and ("held out</s>" * 3).startswith(held)


# ---- resume

def resumed_equals_uninterrupted(c, ks, total):
    reference, reference_mask = take_then_close(c.train_stream(), total)
    cursors = []
    for k in ks:
        s = c.train_stream()
        if k:
            s.take(k)
        cursor = json.loads(json.dumps(s.cursor()))
        s.close()
        tokens, mask = take_then_close(c.train_stream(cursor), total - k)
        assert torch.equal(tokens, reference[k:]) and torch.equal(mask, reference_mask[k:]), (k, cursor)
        assert set(cursor) == {"epoch", "file", "record", "offset"}
        cursors.append(cursor)
    return cursors


def test_resume_is_bit_identical_mid_file_mid_document_and_across_epochs(tmp_path, hf):
    d = tmp_path / "shards"
    d.mkdir()
    records = [{"text": t} for t in sentences(40, 3, hi=80)]
    for i in range(3):
        write_gz(d / f"c4-train.0000{i}-of-00003.json.gz", records[i::3])
    c = open_corpus(str(d), hf, seq_len=20, val_every=5, seed=11)
    s, per_epoch = c.train_stream(), 0
    while s.cursor()["epoch"] == 0:   # rows until the first one that ends in the second epoch
        s.take(1)
        per_epoch += 1
    s.close()
    ks = [0, 1, 2, 5, per_epoch // 3, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch + 3]
    cursors = resumed_equals_uninterrupted(c, ks, 3 * per_epoch + 5)
    assert {cur["file"] for cur in cursors} >= {f"shards/c4-train.0000{i}-of-00003.json.gz" for i in range(3)}
    assert any(cur["offset"] > 0 for cur in cursors) and any(cur["epoch"] == 2 for cur in cursors)


def test_resume_of_parquet_prompts_and_long_documents(tmp_path, hf, monkeypatch):
    prompts = [{"prompt": p, "response": r} for p, r in zip(sentences(30, 1, hi=10), sentences(30, 2, hi=10))]
    c = open_corpus(str(write_parquet(tmp_path / "p.parquet", prompts, row_group_size=4)), hf, seq_len=32,
                    val_every=4)
    resumed_equals_uninterrupted(c, [0, 3, 9, 17, 22, 30], 60)
    monkeypatch.setattr(records_module, "TEXT_PIECE", 64)
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "book.txt").write_text(" ".join(sentences(60, 5)))   # one document, many pieces
    (tmp_path / "long" / "note.txt").write_text("a short note")
    c = open_corpus(str(tmp_path / "long"), hf, seq_len=16, val_spec=held_out_val(tmp_path))
    resumed_equals_uninterrupted(c, [0, 1, 7, 40, 90], 130)


# ---- validation

def test_validation_is_held_out_and_fixed(tmp_path, hf):
    records = [{"text": f"#{i}# " + t} for i, t in enumerate(sentences(200, 4, hi=10))]
    c = open_corpus(str(write_jsonl(tmp_path / "a.jsonl", records)), hf, seq_len=24, val_every=10)
    stream = c.train_stream()
    first = c.validation(6)   # while the train stream reads ahead with the same tokenizer
    train = []
    while stream.cursor()["epoch"] == 0:
        train.append(stream.take(1)[0])
    stream.close()
    seen_train = set(re.findall(r"#(\d+)#", hf.tok.decode(torch.cat(train).flatten().tolist())))
    seen_val = set(re.findall(r"#(\d+)#", hf.tok.decode(torch.cat([t for t, _ in first]).tolist())))
    assert seen_val and seen_train and not seen_val & seen_train
    assert len(seen_train) > 150
    again = open_corpus(str(tmp_path / "a.jsonl"), hf, seq_len=24, val_every=10).validation(6)
    for (t1, m1), (t2, m2), (t3, _) in zip(first, c.validation(6), again):
        assert torch.equal(t1, t2) and torch.equal(m1, m2) and torch.equal(t1, t3)
    assert [t.shape for t, _ in first] == [(25,)] * 6
    assert len(c.validation(10_000)) < 10_000   # what there is


# ---- memory

def test_memory_does_not_grow_with_the_corpus(tmp_path):
    line = json.dumps({"text": "x" * 2000}) + "\n"

    def peak(n_docs):
        path = tmp_path / f"c4-{n_docs}.json.gz"
        with gzip.open(path, "wt", compresslevel=1) as f:
            f.write(line * n_docs)
        c = open_corpus(str(path), ByteTokenizer(), seq_len=1023, val_every=1000, read_ahead=2)
        tracemalloc.start()
        s = c.train_stream()
        while s.cursor()["epoch"] == 0:
            s.take(64)
        s.close()
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(1000), peak(4000)   # 2 MB and 8 MB of text, one shard each
    assert large < small * 1.5 + (1 << 20), (small, large)


# ---- bad input

def bad_inputs(tmp_path, hf):
    write_jsonl(tmp_path / "nofield.jsonl", [{"text": "fine"}, {"body": "no text", "url": "u"}])
    shard = gzip.compress("".join(json.dumps(r) + "\n" for r in text_records(300)).encode())
    (tmp_path / "corrupt.json.gz").write_bytes(shard[:1000] + bytes(100) + shard[1100:])
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "blob.bin").write_bytes(b"\0\1\2" * 100)
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    (tmp_path / "badjson.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    return [("nofield.jsonl", ByteTokenizer(), r"nofield\.jsonl: line 2 has no field 'text' \(its fields: body, url\)"),
            ("corrupt.json.gz", ByteTokenizer(), r"corrupt\.json\.gz cannot be read"),
            ("empty.jsonl", ByteTokenizer(), r"empty\.jsonl is empty"),
            ("nothing", ByteTokenizer(), r"no supported files in .*nothing"),
            ("chat.jsonl", ByteTokenizer(), r"chat\.jsonl holds chat data .* the byte tokenizer has none"),
            ("badjson.jsonl", hf, r"badjson\.jsonl: line 2 is not valid JSON"),
            ("missing.jsonl", hf, r"missing\.jsonl' is neither a file nor a directory")]


@pytest.mark.parametrize("case", range(7))
def test_bad_input_is_a_one_line_config_error(tmp_path, hf, case):
    name, tokenizer, message = bad_inputs(tmp_path, hf)[case]
    with pytest.raises(ConfigError, match=message) as e:   # at open, or from the reader thread at take
        c = open_corpus(str(tmp_path / name), tokenizer, seq_len=8, val_every=2)
        take_then_close(c.train_stream(), 1000)
    assert "\n" not in str(e.value)


def test_missing_tokenizer_and_small_validation_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer at .*nowhere") as e:
        HFTokenizer.load(tmp_path / "nowhere")
    assert "\n" not in str(e.value)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match="no tokenizer at .*empty_dir") as e:
        HFTokenizer.load(tmp_path / "empty_dir")
    assert "\n" not in str(e.value)
    c = open_corpus(str(write_jsonl(tmp_path / "a.jsonl", text_records(5))), ByteTokenizer(), seq_len=8)
    with pytest.raises(ConfigError, match="too small for a validation split.*--val-data"):
        c.validation(4)


def test_too_small_for_a_validation_split_names_val_data_and_eval_every_0(tmp_path):
    c = open_corpus(str(write_jsonl(tmp_path / "a.jsonl", text_records(5))), ByteTokenizer(), seq_len=8)
    with pytest.raises(ConfigError, match="too small for a validation split") as e:
        c.validation(4)
    assert "--val-data" in str(e.value) and "--eval-every 0" in str(e.value) and "\n" not in str(e.value)


def test_a_corpus_without_a_validation_split_trains_on_every_document(tmp_path):
    records = text_records(60)
    path = str(write_jsonl(tmp_path / "a.jsonl", records))
    everything = "".join(r["text"] for r in records).encode()   # (the byte tokenizer: no EOS between them)
    n = len(everything) // 9
    split = open_corpus(path, ByteTokenizer(), seq_len=8, val_every=3)   # about a third held out
    assert split.has_split() and split.validation(1000)
    held_back = bytes(take_then_close(split.train_stream(), n // 2)[0].flatten().tolist())
    assert not everything.startswith(held_back)   # (the held-out documents are skipped)
    c = open_corpus(path, ByteTokenizer(), seq_len=8, val_every=3)
    c.drop_validation("no validation wanted")
    assert not c.has_split() and c.held_out(1000) == []
    assert c.description.endswith("validation: none (no validation wanted)")
    rows = take_then_close(c.train_stream(), n)[0]
    assert bytes(rows.flatten().tolist()) == everything[:9 * n]   # every document, in order, none held out


def test_the_description_counts_one_file_and_one_held_out_file_in_the_singular(tmp_path):
    train = str(write_jsonl(tmp_path / "a.jsonl", text_records(20)))
    c = open_corpus(train, ByteTokenizer(), seq_len=8, val_spec=held_out_val(tmp_path))
    assert f"{train}: 1 file (1 jsonl)" in c.description and c.description.endswith("validation: 1 held-out file")
    write_jsonl(tmp_path / "b.jsonl", text_records(20))
    assert ": 2 files (2 jsonl)" in open_corpus(str(tmp_path / "a.jsonl") + "," + str(tmp_path / "b.jsonl"),
                                                ByteTokenizer(), seq_len=8).description


def test_close_stops_the_reader_and_waits_are_counted(tmp_path):
    c = open_corpus(str(write_jsonl(tmp_path / "a.jsonl", text_records(50))), ByteTokenizer(), seq_len=8,
                    val_every=3, read_ahead=1)
    before = set(threading.enumerate())  # (readers other tests left are not this stream's)
    s = c.train_stream()
    s.take(3)
    readers = [t for t in threading.enumerate() if t.name == "hytrain-corpus" and t not in before]
    assert readers and s.wait_seconds > 0
    s.close()
    assert not any(t.is_alive() for t in readers)
