"""The streamed corpus's files and records: finding the files of a ``--data`` spec, reading their
records from an index on (text pieces, JSON lines, Parquet and Arrow rows), what a record holds for
the data kind, a long text cut into pieces for the tokenizer, and each file's fingerprint, which the
data cursor carries so that a resume notices a file rewritten under it."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .options import ConfigError, first_line

TEXT_PIECE = 1 << 18      # characters of a plain-text file read at once
ROWS_BATCH = 256          # Parquet/Arrow rows converted to Python at once
PIECE_CHARS = 1 << 18     # a text longer than twice this goes to the tokenizer in pieces of at most this
FINGERPRINT_BYTES = 1 << 16   # a file's fingerprint hashes this much of its beginning and of its end


class DocumentEnd(str):
    """The last piece of a plain-text file: the document ends (and EOS follows) after it."""


@dataclass(frozen=True)
class Source:
    path: Path
    name: str     # the path the cursor and the hold-out hash use: stable when the corpus moves
    fmt: str      # text, jsonl, jsonl.gz, parquet or arrow


def file_format(path: Path) -> str | None:
    name = path.name.lower()
    for ext, fmt in ((".jsonl.gz", "jsonl.gz"), (".json.gz", "jsonl.gz"), (".jsonl", "jsonl"), (".json", "jsonl"),
                     (".parquet", "parquet"), (".arrow", "arrow")):
        if name.endswith(ext):
            return fmt
    with open(path, "rb") as f:   # anything else is text, unless a NUL byte says binary (images, archives)
        return None if b"\0" in f.read(4096) else "text"


def saved_dataset(d: Path, name: str) -> list[Source]:
    """The Arrow files of a ``Dataset.save_to_disk`` directory, in the order its state.json lists."""
    try:
        files = [f["filename"] for f in json.loads((d / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        files = sorted(p.name for p in d.glob("data-*.arrow"))
    return [Source(d / f, f"{name}/{f}", "arrow") for f in files]


def find_sources(spec: str) -> tuple[list[Source], list[Source]]:
    """(train sources, the held-out split's sources: a DatasetDict's validation/test split, or [])."""
    train, held = [], []

    def walk(d: Path, name: str):
        if (d / "dataset_dict.json").exists():
            splits = json.loads((d / "dataset_dict.json").read_text()).get("splits", [])
            if "train" not in splits:
                raise ConfigError(f"{d} is a DatasetDict without a 'train' split (it has {', '.join(splits)})")
            train.extend(saved_dataset(d / "train", f"{name}/train"))
            val = next((s for s in ("validation", "test") if s in splits), None)
            held.extend(saved_dataset(d / val, f"{name}/{val}") if val else [])
        elif (d / "state.json").exists() or (d / "dataset_info.json").exists():
            train.extend(saved_dataset(d, name))
        else:
            for p in sorted(d.iterdir(), key=lambda p: p.name):
                if p.name.startswith("."):
                    continue
                if p.is_dir():
                    walk(p, f"{name}/{p.name}")
                elif (fmt := file_format(p)) and (fmt != "text" or p.stat().st_size > 0):   # skip empty __init__.py
                    train.append(Source(p, f"{name}/{p.name}", fmt))

    for part in filter(None, (s.strip() for s in spec.split(","))):
        p = Path(part)
        if p.is_dir():
            walk(p, p.name)
        elif p.is_file():
            train.append(Source(p, p.name, file_format(p) or "binary"))
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


def _read(source: Source, start: int, columns):
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
                    yield index, text if after else DocumentEnd(text)
                index, text = index + 1, after
    elif source.fmt in ("jsonl", "jsonl.gz"):
        # Bytes, one line at a time, each decoded by itself: a text-mode reader decodes ahead in blocks,
        # and its decoding error would come before the lines in front of the bad bytes are counted.
        # A long line is read once, in linear time; the bytes are dropped as soon as they are decoded.
        opener = gzip.open if source.fmt == "jsonl.gz" else open
        with opener(source.path, "rb") as f:
            index = -1
            for line in f:   # (not enumerate, whose reused tuple would hold the line's bytes on)
                index += 1
                if index < start or line.isspace():
                    continue
                try:
                    line = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(f"{source.path}: line {index + 1} is not UTF-8 text (byte {e.start + 1} of the "
                                      f"line: {e.reason})") from None
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise ConfigError(f"{source.path}: line {index + 1} is not valid JSON ({first_line(e)})") from None
                del line
                if not isinstance(record, dict):
                    raise ConfigError(f"{source.path}: line {index + 1} is not a JSON object (one object per line "
                                      f"is expected, not a JSON array)")
                yield index, record
                del record
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


def where(source: Source, index: int) -> str:
    return f"{source.path}: {'line' if source.fmt.startswith('jsonl') else 'row'} {index + 1}"


def checked(source: Source, start: int, columns):
    """``_read``, with a file that breaks off (a corrupt shard, bad Parquet) or holds no record reported
    as a ConfigError naming it and where."""
    index = start - 1
    try:
        for index, record in _read(source, start, columns):
            yield index, record
            del record   # (not held while the next record is read)
    except (OSError, EOFError, ValueError, zlib.error) as e:
        if isinstance(e, ConfigError):
            raise
        at = f" past {where(source, index).split(': ')[1]}" if index >= 0 and source.fmt != "text" else ""
        raise ConfigError(f"{source.path} cannot be read{at}: {first_line(e)}") from None
    if start == 0 and index < 0:
        raise ConfigError(f"{source.path} has no records")


def detect_kind(record) -> str:
    if isinstance(record, str):
        return "text"
    if isinstance(record.get("messages"), list):
        return "chat"
    if {"prompt", "response"} <= record.keys() or {"instruction", "output"} <= record.keys():
        return "prompt"
    return "text"


def payload(kind: str, text_field: str, source: Source, index: int, record):
    """What a record holds for ``kind``: (text, ends a document), (prompt, response) or messages."""
    if isinstance(record, str):
        if kind != "text":
            raise ConfigError(f"{source.path} is plain text, but the corpus holds {kind} data")
        return record, isinstance(record, DocumentEnd)

    def need(field, of=str):
        value = record.get(field)
        if not isinstance(value, of):
            what = f"field {field!r} is not a {of.__name__}" if field in record else f"has no field {field!r}"
            raise ConfigError(f"{where(source, index)} {what} (its fields: {', '.join(record) or 'none'})")
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
        raise ConfigError(f"{where(source, index)}: 'messages' must be a list of {{role, content}} strings")
    return messages




def piece_bounds(text: str, size: int | None = None) -> list[tuple[int, int]]:
    """(start, end) of the pieces a text goes to the tokenizer in: the whole text where it is at most
    twice ``size`` (``PIECE_CHARS``) characters long, else pieces of ``size // 2`` to ``size`` characters.
    So the tokenizer's memory and time follow the piece, not the record: handed a 20 MB document whole,
    a transformers tokenizer holds several GB.

    A piece ends after a line break where the window has one, else before a space, else (a window
    without either) at the budget. These are safe places for BPE: byte-level tokenizers (GPT-2's, Llama
    3's, Qwen's) split their input into words before any merge, a word with the space in front of it
    (" word") and line breaks apart, and no merge crosses such a split, so a cut there gives the tokens
    of the whole text. Where it does not (a run of mixed whitespace at the cut, a cut at the budget
    inside a word, a SentencePiece tokenizer marking the start of its input as a word start), a piece
    boundary differs from the whole record's tokens by a token or so: one boundary per ``size``
    characters."""
    size = size or PIECE_CHARS
    if len(text) <= 2 * size:
        return [(0, len(text))]
    bounds, at = [], 0
    while len(text) - at > size:
        lo, hi = at + size // 2, at + size
        cut = text.rfind("\n", lo, hi) + 1       # after a line break
        if cut <= 0:
            cut = text.rfind(" ", lo, hi)        # before a space
        if cut <= at:
            cut = hi
        bounds.append((at, cut))
        at = cut
    bounds.append((at, len(text)))
    return bounds


def fingerprint(path: Path) -> dict:
    """What a data cursor remembers of a file: its size, modification time and a hash of its first
    and last ``FINGERPRINT_BYTES`` (the whole file, where it is not longer than twice that). A file
    rewritten in place (shuffled, edited, regenerated) differs in one of them."""
    st = os.stat(path)
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(FINGERPRINT_BYTES))
        if st.st_size > FINGERPRINT_BYTES:
            f.seek(max(FINGERPRINT_BYTES, st.st_size - FINGERPRINT_BYTES))
            h.update(f.read(FINGERPRINT_BYTES))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "hash": h.hexdigest()}


def changed_files(before: dict, now: dict) -> str | None:
    """What differs between two ``{name: fingerprint}``, as a phrase naming the first file that does and
    how (``a.jsonl (size, contents)``, ``b.jsonl (added)``) and how many more; None where none does."""
    what = []
    for name in sorted(before.keys() | now.keys()):
        a, b = before.get(name), now.get(name)
        if a is None or b is None:
            what.append(f"{name} ({'added' if a is None else 'removed'})")
        elif a != b:
            how = [word for key, word in (("size", "size"), ("hash", "contents"), ("mtime_ns", "modification time"))
                   if not isinstance(a, dict) or a.get(key) != b.get(key)]
            what.append(f"{name} ({', '.join(how)})")
    if not what:
        return None
    return what[0] + (f" and {len(what) - 1} more file{'s' * (len(what) > 2)}" if len(what) > 1 else "")
