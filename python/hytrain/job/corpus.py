"""The job's streamed corpus: real training data (text files, JSON lines, C4's gzip shards, Parquet,
Arrow, a ``datasets.save_to_disk`` directory) tokenized on the fly, with host memory independent of the
corpus size. ``data.py`` reads a small corpus whole; this module is for corpora that do not fit.

The rows are a pure function of (files, tokenizer, seq_len, kind, text_field, seed, validation split),
and ``Stream.cursor()`` names the position after the rows taken, so a resumed run reads exactly the rows
an uninterrupted one would. A cursor is ``{"epoch", "file", "record", "offset"}``: the stream goes on
with token ``offset`` of record ``record`` of ``file`` (records are re-tokenized on resume, so no
tokens need to be carried in the cursor). The first epoch reads the files in sorted order; each later
epoch in a permutation drawn from (seed, epoch); records within a file always in order.

Kinds: "text" documents are tokenized, each followed by EOS (when the tokenizer has one), concatenated
and cut into rows of seq_len + 1 tokens. "prompt" (prompt/response, or Alpaca's instruction[/input]/
output, the prompt being ``instruction + "\\n\\n" + input``) and "chat" (``messages``) give one example
per row: [BOS] prompt response EOS, without a chat template for "prompt"; a chat is rendered by the
tokenizer's template. Only the response's (the assistant's) tokens count in the loss; rows are
truncated to seq_len + 1 and padded with EOS (or 0); an example with no response token left is skipped.

Validation is ``val_spec`` if given, else a DatasetDict's validation/test split, else every
``val_every``-th document by a hash of (file, record), which the train stream then skips."""

from __future__ import annotations

import gzip
import json
import queue
import random
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from .options import ConfigError, first_line
from .tokenizers import ByteTokenizer

KINDS = ("auto", "text", "prompt", "chat")
TEXT_PIECE = 1 << 18      # characters of a plain-text file tokenized at once
TOKENIZE_BATCH = 64       # records per encode_batch call
ROWS_BATCH = 256          # Parquet/Arrow rows converted to Python at once
CHUNK_TOKENS = 1 << 15    # tokens per read-ahead chunk of rows


# ---- files

class _DocumentEnd(str):
    """The last piece of a plain-text file: the document ends (and EOS follows) after it."""


@dataclass(frozen=True)
class _Source:
    path: Path
    name: str     # the path the cursor and the hold-out hash use: stable when the corpus moves
    fmt: str      # text, jsonl, jsonl.gz, parquet or arrow


def _format(path: Path) -> str | None:
    name = path.name.lower()
    for ext, fmt in ((".jsonl.gz", "jsonl.gz"), (".json.gz", "jsonl.gz"), (".jsonl", "jsonl"), (".json", "jsonl"),
                     (".parquet", "parquet"), (".arrow", "arrow")):
        if name.endswith(ext):
            return fmt
    with open(path, "rb") as f:   # anything else is text, unless a NUL byte says binary (images, archives)
        return None if b"\0" in f.read(4096) else "text"


def _saved_dataset(d: Path, name: str) -> list[_Source]:
    """The Arrow files of a ``Dataset.save_to_disk`` directory, in the order its state.json lists."""
    try:
        files = [f["filename"] for f in json.loads((d / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        files = sorted(p.name for p in d.glob("data-*.arrow"))
    return [_Source(d / f, f"{name}/{f}", "arrow") for f in files]


def _find(spec: str) -> tuple[list[_Source], list[_Source]]:
    """(train sources, the held-out split's sources: a DatasetDict's validation/test split, or [])."""
    train, held = [], []

    def walk(d: Path, name: str):
        if (d / "dataset_dict.json").exists():
            splits = json.loads((d / "dataset_dict.json").read_text()).get("splits", [])
            if "train" not in splits:
                raise ConfigError(f"{d} is a DatasetDict without a 'train' split (it has {', '.join(splits)})")
            train.extend(_saved_dataset(d / "train", f"{name}/train"))
            val = next((s for s in ("validation", "test") if s in splits), None)
            held.extend(_saved_dataset(d / val, f"{name}/{val}") if val else [])
        elif (d / "state.json").exists() or (d / "dataset_info.json").exists():
            train.extend(_saved_dataset(d, name))
        else:
            for p in sorted(d.iterdir(), key=lambda p: p.name):
                if p.name.startswith("."):
                    continue
                if p.is_dir():
                    walk(p, f"{name}/{p.name}")
                elif (fmt := _format(p)) and (fmt != "text" or p.stat().st_size > 0):   # skip empty __init__.py
                    train.append(_Source(p, f"{name}/{p.name}", fmt))

    for part in filter(None, (s.strip() for s in spec.split(","))):
        p = Path(part)
        if p.is_dir():
            walk(p, p.name)
        elif p.is_file():
            train.append(_Source(p, p.name, _format(p) or "binary"))
        else:
            raise ConfigError(f"the corpus {part!r} is neither a file nor a directory")
    names = Counter(s.name for s in train + held)
    if max(names.values(), default=1) > 1:   # the cursor and the hold-out hash know a file by its name
        raise ConfigError(f"{spec!r} names {names.most_common(1)[0][0]!r} twice; rename one of them")
    if not train:
        raise ConfigError(f"no supported files in {spec!r} (text, .jsonl[.gz], .json[.gz], .parquet, .arrow, "
                          f"or a datasets.save_to_disk directory)")
    for s in train + held:
        try:
            with open(s.path, "rb") as f:
                empty = not f.read(1)
        except OSError as e:
            raise ConfigError(f"{s.path} cannot be read: {e.strerror or first_line(e)}") from None
        if empty or s.fmt == "binary":
            raise ConfigError(f"{s.path} is {'empty' if empty else 'not text, JSON lines, Parquet or Arrow'}")
    return train, held


def _read(source: _Source, start: int, columns):
    """(index, record) from record ``start`` on; a record is a dict, or a piece of a plain-text file."""
    if source.fmt == "text":
        with open(source.path, encoding="utf-8", errors="replace", newline="") as f:
            def piece():   # ends at a line break where one comes soon, so few words are cut
                text = f.read(TEXT_PIECE)
                return text + f.readline(TEXT_PIECE) if len(text) == TEXT_PIECE else text

            index, text = 0, piece()
            while text:
                after = piece()
                if index >= start:
                    yield index, text if after else _DocumentEnd(text)
                index, text = index + 1, after
    elif source.fmt in ("jsonl", "jsonl.gz"):
        opener = gzip.open if source.fmt == "jsonl.gz" else open
        with opener(source.path, "rt", encoding="utf-8") as f:
            for index, line in enumerate(f):
                if index < start or not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise ConfigError(f"{source.path}: line {index + 1} is not valid JSON ({first_line(e)})") from None
                if not isinstance(record, dict):
                    raise ConfigError(f"{source.path}: line {index + 1} is not a JSON object (one object per line "
                                      f"is expected, not a JSON array)")
                yield index, record
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if source.fmt == "parquet":
            pf = pq.ParquetFile(source.path)
            first, skipped = 0, 0
            while first < pf.num_row_groups and skipped + pf.metadata.row_group(first).num_rows <= start:
                skipped += pf.metadata.row_group(first).num_rows   # row groups before the start are never read
                first += 1
            batches = pf.iter_batches(batch_size=ROWS_BATCH, row_groups=list(range(first, pf.num_row_groups)),
                                      columns=columns(pf.schema_arrow.names))
            yield from _rows(batches, skipped, start)
        else:
            with pa.memory_map(str(source.path)) as f:
                try:
                    reader = pa.ipc.open_stream(f)
                    batches = iter(reader)
                except pa.ArrowInvalid:
                    f.seek(0)
                    reader = pa.ipc.open_file(f)
                    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                cols = columns(reader.schema.names)
                yield from _rows((b.select(cols) for b in batches), 0, start)


def _rows(batches, index: int, start: int):
    for batch in batches:
        if index + batch.num_rows <= start:
            index += batch.num_rows
            continue
        for at in range(0, batch.num_rows, ROWS_BATCH):
            for record in batch.slice(at, ROWS_BATCH).to_pylist():
                if index >= start:
                    yield index, record
                index += 1


def _where(source: _Source, index: int) -> str:
    return f"{source.path}: {'line' if source.fmt.startswith('jsonl') else 'row'} {index + 1}"


def _checked(source: _Source, start: int, columns):
    """``_read``, with a file that breaks off (a corrupt shard, bad Parquet) or holds no record reported
    as a ConfigError naming it and where."""
    index = start - 1
    try:
        for index, record in _read(source, start, columns):
            yield index, record
    except (OSError, EOFError, ValueError, zlib.error) as e:
        if isinstance(e, ConfigError):
            raise
        at = f" past {_where(source, index).split(': ')[1]}" if index >= 0 and source.fmt != "text" else ""
        raise ConfigError(f"{source.path} cannot be read{at}: {first_line(e)}") from None
    if start == 0 and index < 0:
        raise ConfigError(f"{source.path} has no records")


def _detect(record) -> str:
    if isinstance(record, str):
        return "text"
    if isinstance(record.get("messages"), list):
        return "chat"
    if {"prompt", "response"} <= record.keys() or {"instruction", "output"} <= record.keys():
        return "prompt"
    return "text"


def _payload(kind: str, text_field: str, source: _Source, index: int, record):
    """What a record holds for ``kind``: (text, ends a document), (prompt, response) or messages."""
    if isinstance(record, str):
        if kind != "text":
            raise ConfigError(f"{source.path} is plain text, but the corpus holds {kind} data")
        return record, isinstance(record, _DocumentEnd)

    def need(field, of=str):
        value = record.get(field)
        if not isinstance(value, of):
            what = f"field {field!r} is not a {of.__name__}" if field in record else f"has no field {field!r}"
            raise ConfigError(f"{_where(source, index)} {what} (its fields: {', '.join(record) or 'none'})")
        return value

    if kind == "text":
        return need(text_field), True
    if kind == "prompt":
        if "prompt" in record:
            return need("prompt"), need("response")
        extra = record.get("input") or ""
        return need("instruction") + (f"\n\n{extra}" if extra else ""), need("output")
    messages = need("messages", list)
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in messages):
        raise ConfigError(f"{_where(source, index)}: 'messages' must be a list of {{role, content}} strings")
    return messages


def _cursor(epoch: int, file: str, record: int, offset: int) -> dict:
    return {"epoch": epoch, "file": file, "record": record, "offset": offset}


# ---- the corpus

class Corpus:
    """Files, tokenizer and row shape; streams of rows are made by ``train_stream`` and ``validation``."""

    def __init__(self, sources, held, tokenizer, *, seq_len, kind, text_field, val_every, seed, read_ahead,
                 description):
        self.description = description
        self.kind = kind
        self._sources = sources
        self._held = held or None   # None: documents are held out by hash
        self._tok = tokenizer
        self._encode = getattr(tokenizer, "encode_batch", None) or (lambda texts: [tokenizer.encode(t) for t in texts])
        self._seq_len = seq_len
        self._text_field = text_field
        self._val_every = val_every
        self._seed = seed
        self._read_ahead = read_ahead
        self._val_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._val_complete = False
        wanted = {"text": {text_field}, "prompt": {"prompt", "response", "instruction", "input", "output"},
                  "chat": {"messages"}}[kind]
        # Only the columns the kind reads; all of them when none is there, for the error to list them.
        self._columns = lambda names: [n for n in names if n in wanted] or list(names)

    def train_stream(self, cursor: dict | None = None) -> Stream:
        start = cursor or _cursor(0, self._sources[0].name, 0, 0)
        try:
            start = _cursor(int(start["epoch"]), str(start["file"]), int(start["record"]), int(start["offset"]))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"the data cursor {cursor!r} is not one hytrain wrote") from None
        if start["file"] not in {s.name for s in self._sources}:
            raise ConfigError(f"the data cursor points at {start['file']!r}, which is not in the corpus "
                              f"({self._sources[0].name}, ...): was the data changed?")
        return Stream(self._chunks(self._rows(start, train=True)), start, self._read_ahead)

    def validation(self, n_sequences: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``n_sequences`` held-out rows as (tokens [seq_len + 1], loss_mask [seq_len]); fewer
        where the held-out data has fewer. Computed once, so every evaluation sees the same rows."""
        if n_sequences > len(self._val_rows) and not self._val_complete:
            rows = list(islice(self._rows(None, train=False), n_sequences))
            self._val_complete = len(rows) < n_sequences
            if rows:
                tokens, mask, _ = self._tensors(rows)
                self._val_rows = list(zip(tokens, mask))
        if not self._val_rows:
            held = "the held-out split" if self._held else f"every {self._val_every}th document, held out,"
            raise ConfigError(f"the corpus is too small for a validation split: {held} gives no row of "
                              f"{self._seq_len + 1} tokens; pass --val-data")
        return self._val_rows[:n_sequences]

    def _order(self, epoch: int) -> list[_Source]:
        if epoch == 0:
            return self._sources
        order = list(self._sources)
        random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order

    def _records(self, start: dict | None, train: bool):
        """(epoch, source, index, payload) from ``start`` (None: the first record), forever when ``train``
        (the train documents), else one pass over the validation documents."""
        by_hash = self._held is None
        epoch, file, record = (start["epoch"], start["file"], start["record"]) if start else (0, None, 0)
        while True:
            order = self._order(epoch) if train else self._held or self._sources
            found = False
            for source in order[[s.name for s in order].index(file) if file else 0:]:
                for index, rec in _checked(source, record if file else 0, self._columns):
                    key = source.name if source.fmt == "text" else f"{source.name}:{index}"
                    if not by_hash or (zlib.crc32(key.encode()) % self._val_every == 0) != train:
                        found = True
                        yield epoch, source, index, _payload(self.kind, self._text_field, source, index, rec)
                file = None
            if not train:
                return
            if not found and not (start and epoch == start["epoch"]):
                raise ConfigError(f"the corpus ({self._sources[0].path}, ...) has no training documents: "
                                  f"all are held out for validation; pass --val-data")
            epoch += 1

    def _examples(self, records):
        """(epoch, source, index, ids, mask) where the mask is 1 on tokens that count in the loss (None:
        all), tokenizing up to ``TOKENIZE_BATCH`` records (and about 1 M characters) at a time."""
        batch, size = [], 0
        for item in records:
            batch.append(item)
            size += len(item[3][0]) if self.kind == "text" else 1 << 12
            if len(batch) == TOKENIZE_BATCH or size >= 1 << 20:
                yield from self._tokenized(batch)
                batch, size = [], 0
        yield from self._tokenized(batch)

    def _tokenized(self, batch):
        if not batch:
            return
        tok = self._tok
        eos, bos = [] if tok.eos_id is None else [tok.eos_id], [] if tok.bos_id is None else [tok.bos_id]
        if self.kind == "text":
            for (e, s, i, (_, ends)), ids in zip(batch, self._encode([b[3][0] for b in batch])):
                yield e, s, i, ids + eos if ends else ids, None
        elif self.kind == "prompt":
            prompts, responses = self._encode([b[3][0] for b in batch]), self._encode([b[3][1] for b in batch])
            for (e, s, i, _), prompt, response in zip(batch, prompts, responses):
                yield (e, s, i, bos + prompt + response + eos,
                       [0] * (len(bos) + len(prompt)) + [1] * (len(response) + len(eos)))
        else:
            for e, s, i, messages in batch:
                yield e, s, i, *tok.chat(messages)

    def _rows(self, start: dict | None, train: bool):
        """(tokens, loss mask or None for all-True, cursor after the row)."""
        width, first = self._seq_len + 1, start
        last_output = start["epoch"] if start else 0
        pad = self._tok.eos_id if self._tok.eos_id is not None else 0
        buf = []
        for epoch, source, index, ids, mask in self._examples(self._records(start, train)):
            if epoch > last_output + 1:
                raise ConfigError(f"a whole pass over the corpus ({self._sources[0].path}, ...) gave no "
                                  + ("tokens" if self.kind == "text" else f"example that fits --seq-len {self._seq_len}"))
            if self.kind != "text":
                targets = mask[1:width]
                if any(targets):
                    last_output = epoch
                    ids = ids[:width]
                    yield (ids + [pad] * (width - len(ids)), targets + [0] * (width - 1 - len(targets)),
                           _cursor(epoch, source.name, index + 1, 0))
                continue
            base = 0
            if first and (epoch, source.name, index) == (first["epoch"], first["file"], first["record"]):
                base, ids = first["offset"], ids[first["offset"]:]   # resuming inside this record
            first = None
            if ids:
                last_output = epoch
            begin, pos = len(buf), 0
            buf += ids
            while len(buf) - pos >= width:   # a row ends inside this record's tokens: begin < width
                yield buf[pos:pos + width], None, _cursor(epoch, source.name, index, base + pos + width - begin)
                pos += width
            del buf[:pos]

    def _tensors(self, rows):
        tokens = torch.tensor([r[0] for r in rows], dtype=torch.int64)
        if self.kind == "text":
            mask = torch.ones(len(rows), self._seq_len, dtype=torch.bool)
        else:
            mask = torch.tensor([r[1] for r in rows], dtype=torch.bool)
        return tokens, mask, [r[2] for r in rows]

    def _chunks(self, rows):
        per = max(1, CHUNK_TOKENS // (self._seq_len + 1))
        while batch := list(islice(rows, per)):
            yield self._tensors(batch)


class Stream:
    """Rows read ahead by a daemon thread into a bounded queue of chunks; the cursor is that of the rows
    taken, not of the rows read."""

    def __init__(self, chunks, start: dict, read_ahead: int):
        self.wait_seconds = 0.0
        self._cursor = start
        self._chunk, self._taken = None, 0   # the chunk being taken from, and its rows taken
        self._error = None
        self._queue = queue.Queue(read_ahead)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(chunks,), name="hytrain-corpus", daemon=True)
        self._thread.start()

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``n`` rows: (tokens int64 [n, seq_len + 1], loss_mask bool [n, seq_len])."""
        if n < 1 or self._stop.is_set():
            raise ValueError(f"take({n}) on a {'closed ' if self._stop.is_set() else ''}stream")
        tokens, masks = [], []
        while n:
            if self._error is not None:
                raise self._error
            if self._chunk is None:
                t0 = time.perf_counter()
                item = self._queue.get()
                self.wait_seconds += time.perf_counter() - t0
                if isinstance(item, BaseException):
                    self._error = item
                    continue
                self._chunk, self._taken = item, 0
            chunk_tokens, chunk_mask, cursors = self._chunk
            k = min(n, len(cursors) - self._taken)
            tokens.append(chunk_tokens[self._taken:self._taken + k])
            masks.append(chunk_mask[self._taken:self._taken + k])
            self._taken += k
            n -= k
            self._cursor = cursors[self._taken - 1]
            if self._taken == len(cursors):
                self._chunk = None
        return torch.cat(tokens), torch.cat(masks)

    def cursor(self) -> dict:
        """Where the rows after those taken come from: ``train_stream(cursor)`` goes on there."""
        return dict(self._cursor)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=10)

    def _fill(self, chunks):
        try:
            for chunk in chunks:
                if not self._put(chunk):
                    return
        except BaseException as e:   # re-raised by take, in the training thread
            self._put(e)
        finally:
            chunks.close()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False


def formats(spec: str) -> set[str]:
    """The formats of the files at ``spec`` (text, jsonl, jsonl.gz, parquet, arrow)."""
    train, held = _find(spec)
    return {s.fmt for s in train + held}


def open_corpus(spec: str, tokenizer, *, seq_len: int, text_field: str = "text", kind: str = "auto",
                val_spec: str | None = None, val_every: int = 100, seed: int = 0, read_ahead: int = 8) -> Corpus:
    """The corpus at ``spec`` (files, directories, comma-separated), checked as far as its first record."""
    if kind not in KINDS:
        raise ConfigError(f"the data kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if seq_len < 1 or read_ahead < 1:
        raise ConfigError(f"seq_len ({seq_len}) and read_ahead ({read_ahead}) must be at least 1")
    sources, held = _find(spec)
    if val_spec:
        val_sources, val_held = _find(val_spec)
        held = val_held or val_sources
    elif not held and val_every < 2:
        raise ConfigError(f"the validation interval must be at least 2 documents, got {val_every}")
    first = sources[0]
    index, record = next(_checked(first, 0, list))
    kind = _detect(record) if kind == "auto" else kind
    _payload(kind, text_field, first, index, record)
    if kind == "chat" and not getattr(tokenizer, "has_chat_template", False):
        raise ConfigError(f"{first.path} holds chat data (messages), which needs a tokenizer with a chat template; "
                          f"{'the byte tokenizer' if isinstance(tokenizer, ByteTokenizer) else 'this one'} has none")
    formats = Counter(s.fmt for s in sources)
    val = (f"{len(held)} held-out files" if held else f"every {val_every}th document held out")
    description = (f"{spec}: {len(sources)} files ({', '.join(f'{n} {f}' for f, n in formats.items())}), "
                   f"{kind} data{f' (field {text_field!r})' if kind == 'text' else ''}; validation: {val}")
    return Corpus(sources, held, tokenizer, seq_len=seq_len, kind=kind, text_field=text_field,
                  val_every=val_every, seed=seed, read_ahead=read_ahead, description=description)
