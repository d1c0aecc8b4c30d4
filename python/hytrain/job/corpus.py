"""The job's streamed corpus: real training data (text files, JSON lines, C4's gzip shards, Parquet,
Arrow, a ``datasets.save_to_disk`` directory) tokenized on the fly, with host memory independent of the
corpus size. ``data.py`` reads a small corpus whole; this module is for corpora that do not fit, and
``records.py`` finds and reads their files.

The rows are a pure function of (files, tokenizer, seq_len, kind, text_field, seed, validation split),
and ``Stream.cursor()`` names the position after the rows taken, so a resumed run reads exactly the rows
an uninterrupted one would. A cursor is ``{"epoch", "file", "record", "offset"}``: the stream goes on
with token ``offset`` of record ``record`` of ``file`` (records are re-tokenized on resume, so no
tokens need to be carried in the cursor). The first epoch reads the files in sorted order; each later
epoch in a permutation drawn from (seed, epoch); records within a file always in order.

Kinds: "text" documents are tokenized, each followed by EOS (when the tokenizer has one), concatenated
and cut into rows of seq_len + 1 tokens; a long document goes to the tokenizer in pieces of at most
``records.PIECE_CHARS`` characters (the cursor's offset still counts the record's tokens). "prompt"
(prompt/response, or Alpaca's instruction[/input]/output, the prompt being ``instruction + "\\n\\n" +
input``) and "chat" (``messages``) give one example per row: [BOS] prompt response EOS, without a chat
template for "prompt"; a chat is rendered by the tokenizer's template. Only the response's (the
assistant's) tokens count in the loss; rows are truncated to seq_len + 1 and padded with EOS (or 0); an
example with no response token left is skipped.

Validation is ``val_spec`` if given, else a DatasetDict's validation/test split, else every
``val_every``-th document by a hash of (file, record), which the train stream then skips."""

from __future__ import annotations

import queue
import random
import threading
import time
import zlib
from collections import Counter
from itertools import islice

import torch

from .options import ConfigError, counted
from .records import Source, checked, detect_kind, find_sources, fingerprint, payload, piece_bounds
from .tokenizers import ByteTokenizer

KINDS = ("auto", "text", "prompt", "chat")
# What lifts a validation split the data is too small for (the corpus's, and data.py's in-memory one).
TOO_SMALL_FIX = ("pass --val-data FILE (validation data of its own), or --eval-every 0 (then no validation where "
                 "the data has no room for it: training uses every document)")
TOKENIZE_BATCH = 64       # records per encode_batch call
CHUNK_TOKENS = 1 << 15    # tokens per read-ahead chunk of rows


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
        self._split = True          # False: no validation split (drop_validation), every document trains
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

    def fingerprint(self) -> dict:
        """{name: size, modification time and hash} of the train files, which the data cursor carries:
        a resume compares them with the files it finds (``records.changed_files``)."""
        return {s.name: fingerprint(s.path) for s in self._sources}

    def validation(self, n_sequences: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``n_sequences`` held-out rows as (tokens [seq_len + 1], loss_mask [seq_len]); fewer
        where the held-out data has fewer. Computed once, so every evaluation sees the same rows."""
        if not self.held_out(n_sequences):
            raise ConfigError(f"the corpus is too small for a validation split ({self.split_name()}): no row of "
                              f"{self._seq_len + 1} tokens; {TOO_SMALL_FIX}")
        return self._val_rows[:n_sequences]

    def held_out(self, n_sequences: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`validation`'s rows, none (no error) where the held-out data has no whole row."""
        if self._split and n_sequences > len(self._val_rows) and not self._val_complete:
            rows = list(islice(self._rows(None, train=False), n_sequences))
            self._val_complete = len(rows) < n_sequences
            if rows:
                tokens, mask, _ = self._tensors(rows)
                self._val_rows = list(zip(tokens, mask))
        return self._val_rows[:n_sequences] if self._split else []

    def has_split(self) -> bool:
        """Whether there is a validation split (not dropped: :meth:`drop_validation`)."""
        return self._split

    def split_name(self) -> str:
        return "the held-out files" if self._held else f"every {self._val_every}th document held out"

    def drop_validation(self, why: str) -> None:
        """No validation split (a run that does not need one, whose data is too small for it): the
        train stream reads every document, none held out; :meth:`validation` has no rows. Before the
        first ``train_stream``."""
        self._split, self._held, self._val_rows = False, None, []
        self.description = self.description.rsplit("; validation: ", 1)[0] + f"; validation: none ({why})"

    def _order(self, epoch: int) -> list[Source]:
        if epoch == 0:
            return self._sources
        order = list(self._sources)
        random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order

    def _records(self, start: dict | None, train: bool):
        """(epoch, source, index, payload) from ``start`` (None: the first record), forever when ``train``
        (the train documents), else one pass over the validation documents."""
        by_hash = self._held is None and self._split
        epoch, file, record = (start["epoch"], start["file"], start["record"]) if start else (0, None, 0)
        while True:
            order = self._order(epoch) if train else self._held or self._sources
            found = False
            for source in order[[s.name for s in order].index(file) if file else 0:]:
                for index, rec in checked(source, record if file else 0, self._columns):
                    key = source.name if source.fmt == "text" else f"{source.name}:{index}"
                    if not by_hash or (zlib.crc32(key.encode()) % self._val_every == 0) != train:
                        found = True
                        yield epoch, source, index, payload(self.kind, self._text_field, source, index, rec)
                    del rec   # (not held while the next record is read)
                file = None
            if not train:
                return
            if not found and not (start and epoch == start["epoch"]):
                raise ConfigError(f"the corpus ({self._sources[0].path}, ...) has no training documents: "
                                  f"all are held out for validation; pass --val-data")
            epoch += 1

    def _examples(self, records):
        """(epoch, source, index, ids, mask) where the mask is 1 on tokens that count in the loss (None:
        all), tokenizing up to ``TOKENIZE_BATCH`` records (and about 1 M characters) at a time. A long
        text document goes to the tokenizer in pieces (``piece_bounds``), each its own item with the
        record's index, EOS after the last: memory and time follow the piece, not the record."""
        batch, size = [], 0
        for item in records:
            for part in self._pieces(item):
                batch.append(part)
                size += len(part[3][0]) if self.kind == "text" else 1 << 12
                if len(batch) == TOKENIZE_BATCH or size >= 1 << 20:
                    yield from self._tokenized(batch)
                    batch, size = [], 0
            del item   # (not held while the next record is read)
        yield from self._tokenized(batch)

    def _pieces(self, item):
        bounds = piece_bounds(item[3][0]) if self.kind == "text" else ()
        if len(bounds) < 2:
            yield item
            return
        e, s, i, (text, ends) = item
        for a, b in bounds:
            yield e, s, i, (text[a:b], ends and b == len(text))

    def _encode_long(self, texts, limit: int):
        """``encode_batch``, a long text tokenized in pieces, and only as far as its first ``limit``
        tokens (an example is cut to a row: the rest would be dropped)."""
        long = {j: bounds for j, t in enumerate(texts) if len(bounds := piece_bounds(t)) > 1}
        out = self._encode(["" if j in long else t for j, t in enumerate(texts)])
        for j, bounds in long.items():
            out[j] = []
            for a, b in bounds:
                if len(out[j]) >= limit:
                    break
                out[j] += self._encode([texts[j][a:b]])[0]
        return out

    def _tokenized(self, batch):
        if not batch:
            return
        tok = self._tok
        eos, bos = [] if tok.eos_id is None else [tok.eos_id], [] if tok.bos_id is None else [tok.bos_id]
        if self.kind == "text":
            for (e, s, i, (_, ends)), ids in zip(batch, self._encode([b[3][0] for b in batch])):
                yield e, s, i, ids + eos if ends else ids, None
        elif self.kind == "prompt":
            prompts = self._encode_long([b[3][0] for b in batch], self._seq_len + 1)
            responses = self._encode_long([b[3][1] for b in batch], self._seq_len + 1)
            for (e, s, i, _), prompt, response in zip(batch, prompts, responses):
                yield (e, s, i, bos + prompt + response + eos,
                       [0] * (len(bos) + len(prompt)) + [1] * (len(response) + len(eos)))
        else:
            for e, s, i, messages in batch:
                yield e, s, i, *tok.chat(messages)

    def _rows(self, start: dict | None, train: bool):
        """(tokens, loss mask or None for all-True, cursor after the row). A text record's tokens may
        come in several pieces (items with the same record): ``base`` counts the record's tokens before
        this piece, so the cursor's offset is within the record, whatever its pieces."""
        width, first = self._seq_len + 1, start
        last_output = start["epoch"] if start else 0
        pad = self._tok.eos_id if self._tok.eos_id is not None else 0
        buf, record, base = [], None, 0
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
            base = base if (epoch, source.name, index) == record else 0   # (the previous piece's end)
            record, n = (epoch, source.name, index), len(ids)
            if first and record == (first["epoch"], first["file"], first["record"]):
                skip = min(max(first["offset"] - base, 0), n)   # resuming inside this record
                ids = ids[skip:]
                base += skip
                n -= skip
            else:
                first = None
            if ids:
                last_output = epoch
            begin, pos = len(buf), 0
            buf += ids
            while len(buf) - pos >= width:   # a row ends inside this piece's tokens: begin < width
                yield buf[pos:pos + width], None, _cursor(epoch, source.name, index, base + pos + width - begin)
                pos += width
            del buf[:pos]
            base += n

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
    train, held = find_sources(spec)
    return {s.fmt for s in train + held}


def open_corpus(spec: str, tokenizer, *, seq_len: int, text_field: str = "text", kind: str = "auto",
                val_spec: str | None = None, val_every: int = 100, seed: int = 0, read_ahead: int = 8) -> Corpus:
    """The corpus at ``spec`` (files, directories, comma-separated), checked as far as its first record."""
    if kind not in KINDS:
        raise ConfigError(f"the data kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if seq_len < 1 or read_ahead < 1:
        raise ConfigError(f"seq_len ({seq_len}) and read_ahead ({read_ahead}) must be at least 1")
    sources, held = find_sources(spec)
    if val_spec:
        val_sources, val_held = find_sources(val_spec)
        held = val_held or val_sources
    elif not held and val_every < 2:
        raise ConfigError(f"the validation interval must be at least 2 documents, got {val_every}")
    first = sources[0]
    index, record = next(checked(first, 0, list))
    kind = detect_kind(record) if kind == "auto" else kind
    payload(kind, text_field, first, index, record)
    if kind == "chat" and not getattr(tokenizer, "has_chat_template", False):
        raise ConfigError(f"{first.path} holds chat data (messages), which needs a tokenizer with a chat template; "
                          f"{'the byte tokenizer' if isinstance(tokenizer, ByteTokenizer) else 'this one'} has none")
    formats = Counter(s.fmt for s in sources)
    val = (counted(len(held), "held-out file") if held else f"every {val_every}th document held out")
    description = (f"{spec}: {counted(len(sources), 'file')} ({', '.join(f'{n} {f}' for f, n in formats.items())}), "
                   f"{kind} data{f' (field {text_field!r})' if kind == 'text' else ''}; validation: {val}")
    return Corpus(sources, held, tokenizer, seq_len=seq_len, kind=kind, text_field=text_field,
                  val_every=val_every, seed=seed, read_ahead=read_ahead, description=description)
