"""The job's data. Plain text (the Python standard library's own sources by default, or a text file or
directory) is read whole, up to ``--max-data-bytes``, split into train and validation by a hash of each
file's name, and the batch of each step is a function of (seed, step) alone, so that a resumed run sees
the same batches. Everything else (JSON lines, C4's gzip shards, Parquet, Arrow, saved datasets,
instruction data) is streamed by corpus.py, and resumed from the cursor kept in the checkpoint."""

from __future__ import annotations

import os
import sysconfig
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from .corpus import TOO_SMALL_FIX, formats, open_corpus
from .models import check_fit, job_tokenizer
from .records import changed_files
from .tokenizers import ByteTokenizer, with_eos
from .options import ConfigError, counted


_NOT_STDLIB = {"site-packages", "dist-packages", "test", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The standard library's own ``.py`` files (the embedded default corpus). The installed packages
    under it are never walked: a concurrent ``pip install`` may remove a directory mid-walk, and
    ``os.walk`` skips what vanished instead of raising."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _NOT_STDLIB]
        found += [Path(here, f) for f in files if f.endswith(".py")]
    return sorted(found)


def load_corpus(spec: str, max_bytes: int, optional: bool = False):
    """(train bytes, validation bytes, the number of files (None: one file, cut 19:1), whether
    ``max_bytes`` cut the reading short). Files are split by a hash of their name, so the split does
    not depend on the order or the number of files. ``optional``: a validation split too small to use
    is none (validation None), its bytes trained on, rather than an error."""
    if spec == "stdlib":
        files, root = stdlib_files(), Path(sysconfig.get_paths()["stdlib"])
    else:
        root = Path(spec)
        if root.is_file():
            data = root.read_bytes()[:max_bytes]
            capped = len(data) == max_bytes
            if len(data) < 4096:
                hint = f" (its first --max-data-bytes {max_bytes}: raise it)" if capped else ""
                raise ConfigError(f"{root} has {counted(len(data), 'byte')}{hint}; at least 4096 are needed")
            cut = len(data) * 19 // 20
            return (torch.frombuffer(bytearray(data[:cut]), dtype=torch.uint8),
                    torch.frombuffer(bytearray(data[cut:]), dtype=torch.uint8), None, capped)
        if not root.is_dir():
            raise ConfigError(f"--data {spec!r} is neither 'stdlib', a file nor a directory")
        files = sorted(p for p in root.rglob("*") if p.is_file())
    train, val, total = bytearray(), bytearray(), 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        name = str(f.relative_to(root)).encode()
        (val if zlib.crc32(name) % 20 == 0 else train).extend(data)
        total += len(data)
        if total >= max_bytes:
            break
    capped = total >= max_bytes
    if optional and (len(val) < 1024 or len(train) < 4096):
        train, val = train + val, None
    if len(train) < 4096 or (val is not None and len(val) < 1024):
        small = f"the corpus {spec!r} is too small ({len(train)} train / {len(val or b'')} validation bytes)"
        if capped:
            raise ConfigError(f"{small}: --max-data-bytes {max_bytes} stopped the reading; raise it")
        if len(train) + len(val or b"") < 4096:
            raise ConfigError(f"{small}: at least 4096 bytes of text are needed")
        raise ConfigError(f"{small} for a validation split (about one file in 20 held out: at least 1024 bytes, "
                          f"and 4096 left to train on); {TOO_SMALL_FIX}")
    return (torch.frombuffer(train, dtype=torch.uint8).clone(),
            torch.frombuffer(val, dtype=torch.uint8).clone() if val is not None else None, len(files), capped)


def _description(spec, n_files, train: int, val) -> str:
    """The in-memory corpus in a few words (``n_files`` None: one file; ``val`` None: no validation)."""
    none = "no validation: too small for a split, and --eval-every 0 needs none"
    if n_files is None:
        return str(spec) if val is not None else f"{spec} ({none})"
    return (f"{spec} ({counted(n_files, 'file')}, {train / 1e6:.1f} MB train, "
            + (f"{val / 1e6:.2f} MB validation)" if val is not None else f"{none})"))


def batch_at(data: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The batch of step ``step``: a function of (seed, step) only, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()


def _as_tokens(data: torch.Tensor, tokenizer) -> torch.Tensor:
    """Bytes as the tokenizer's ids (the bytes themselves for the byte tokenizer)."""
    if isinstance(tokenizer, ByteTokenizer):
        return data
    ids = tokenizer.encode(bytes(data.tolist()).decode("utf-8", errors="replace"))
    return torch.tensor(ids, dtype=torch.int32)


class InMemory:
    """A corpus of plain text read whole (``--max-data-bytes`` at most): each step's global batch is
    a function of (seed, step) -- random windows -- so a resumed run sees the same batches."""

    kind = "text"
    wait_seconds = 0.0

    def __init__(self, spec, tokenizer, *, batch, seq_len, seed, max_bytes, optional=False):
        train, val, n_files, capped = load_corpus(spec, max_bytes, optional)
        self._train = _as_tokens(train, tokenizer)
        self._val = _as_tokens(val, tokenizer) if val is not None else None
        sizes = (len(train), None if val is None else len(val))
        if optional and self._val is not None and len(self._val) < seq_len + 1:  # no room for a sequence
            self._train, self._val, sizes = torch.cat([self._train, self._val]), None, (sum(sizes), None)
        self.description = _description(spec, n_files, *sizes)
        self._batch, self._seq, self._seed = batch, seq_len, seed
        splits = [("training", len(self._train))] + ([("validation", len(self._val))] if self._val is not None else [])
        which, shortest = min(splits, key=lambda s: s[1])
        if seq_len + 1 > shortest:
            fix = ("raise --max-data-bytes or lower --seq-len" if capped else
                   f"lower --seq-len, or {TOO_SMALL_FIX}" if which == "validation" else "lower --seq-len")
            raise ConfigError(f"--seq-len {seq_len} is longer than the data allows: a sequence needs {seq_len + 1} "
                              f"tokens, the {which} split has {shortest} (--data {spec}, --max-data-bytes "
                              f"{max_bytes}); {fix}")

    def batch(self, step):
        return batch_at(self._train, step, self._batch, self._seq, self._seed), None

    def validation(self, n):
        if self._val is None:  # (none needed, and the data too small for it)
            return []
        return [(batch_at(self._val, i, self._batch, self._seq, seed=12345), None) for i in range(n)]

    def cursor(self):
        return None

    def close(self):
        pass


class Streamed:
    """A corpus streamed from its files (corpus.py), the global batch of each step the next
    ``batch`` rows of one stream that every rank reads alike (each keeps its own rows), so the
    rows do not depend on the number of processes; ``cursor()`` is where a resume goes on, with the
    fingerprints of the files (``files``: size, modification time, hash of the first and last 64 KiB)
    taken when they were opened, which ``open_data`` compares on resume."""

    def __init__(self, corpus, *, batch, cursor=None, files=None):
        self.corpus, self.kind, self.description = corpus, corpus.kind, corpus.description
        self._batch = batch
        self._files = corpus.fingerprint() if files is None else files
        self._stream = corpus.train_stream({k: v for k, v in cursor.items() if k != "files"} if cursor else None)

    @property
    def wait_seconds(self):
        return self._stream.wait_seconds

    def batch(self, step):
        return self._stream.take(self._batch)

    def validation(self, n):
        if not self.corpus.has_split():  # (none needed, and the data too small for it)
            return []
        rows = self.corpus.validation(n * self._batch)
        if len(rows) < self._batch:
            raise ConfigError(f"the validation split gives {counted(len(rows), 'row')} of {rows[0][0].numel()} "
                              f"tokens, fewer than one batch (--batch-size {self._batch}); {TOO_SMALL_FIX}")
        return [(torch.stack([r[0] for r in rows[i:i + self._batch]]), torch.stack([r[1] for r in rows[i:i + self._batch]]))
                for i in range(0, len(rows) - self._batch + 1, self._batch)]

    def cursor(self):
        return {**self._stream.cursor(), "files": self._files}

    def close(self):
        self._stream.close()


def _say(line):
    """One line on stdout from the first process (RANK 0 under torchrun); a closed stdout drops it."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        try:
            print(line, flush=True)
        except (OSError, ValueError):
            pass


def open_data(plan, tokenizer, cursor=None, say=None, optional_validation=False):
    """The job's data (``plan``: a DataPlan): the embedded corpus and plain text in memory; JSON lines,
    gzip shards, Parquet, Arrow and saved datasets streamed (``--data-kind``, ``--text-field``,
    ``--val-data``). ``optional_validation`` (``--eval-every 0``): data too small for a validation
    split has none (``validation()`` is empty), every document trained on, rather than an error.

    Streamed documents and responses end with the tokenizer's EOS (``--eos-token`` gives one): a
    tokenizer without one is refused rather than packing documents with nothing between them (the
    byte tokenizer excepted: its 256 symbols are all data). A
    ``cursor`` whose files' fingerprints differ from the files now (a file rewritten, added or removed
    since the checkpoint) is said in one line (``say``, else stdout on the first process) and the data
    is read from its beginning, as when the data options change."""
    tokenizer = with_eos(tokenizer, getattr(plan, "eos_token", None))
    streamed = plan.data != "stdlib" and (plan.val_data or plan.data_kind not in ("auto", "text")
                                          or formats(plan.data) != {"text"})
    if not streamed:
        return InMemory(plan.data, tokenizer, batch=plan.batch_size, seq_len=plan.seq_len, seed=plan.seed,
                        max_bytes=plan.max_data_bytes, optional=optional_validation)
    corpus = open_corpus(plan.data, tokenizer, seq_len=plan.seq_len, text_field=plan.text_field, kind=plan.data_kind,
                         val_spec=plan.val_data, seed=plan.seed)
    # (A chat's template ends its turns itself; the byte alphabet has no token to spare: documents
    # follow each other as bytes, unless --eos-token names one, such as a newline.)
    if corpus.kind != "chat" and tokenizer.eos_id is None and not isinstance(tokenizer, ByteTokenizer):
        raise ConfigError(f"the tokenizer has no EOS token to end each {'document' if corpus.kind == 'text' else 'response'} "
                          f"of {plan.data} with: pass --eos-token TEXT, a text that is one token of it")
    if optional_validation and len(corpus.held_out(plan.eval_batches * plan.batch_size)) < plan.batch_size:
        corpus.drop_validation(f"{corpus.split_name()}: less than a batch; --eval-every 0 needs none: training "
                               "uses every document")
    files = corpus.fingerprint()
    saved = cursor.get("files") if isinstance(cursor, dict) else None
    changed = changed_files(saved, files) if isinstance(saved, dict) else None   # (None: an older checkpoint's)
    if changed:
        (say or _say)(f"hytrain train: the data files differ from the checkpoint's: {changed}; {plan.data} is read "
                      f"from its beginning")
        cursor = None
    return Streamed(corpus, batch=plan.batch_size, cursor=cursor, files=files)


def open_job_data(model, plan, cursor, say, eval_every=1):
    """The open-data phase: the tokenizer (``model``, a ModelPlan: ``--tokenizer``, else the model's
    own), checked against the model before anything is read; the data read with it from ``cursor``
    (a resumed run's, or None) by ``plan`` (a DataPlan); and the validation batches (none where
    ``eval_every`` is 0 and the data is too small for a validation split). Returns (data, validation
    batches)."""
    tokenizer = job_tokenizer(model)
    check_fit(model, tokenizer)
    data = open_data(plan, tokenizer, cursor, say=say, optional_validation=eval_every == 0)
    return data, data.validation(plan.eval_batches)


def inputs_and_targets(tokens, mask, ranks, device):
    """This rank's rows of a global batch (seq_len + 1 tokens each) as (inputs, targets), already
    shifted: the inputs are tokens 0 .. seq_len - 1, the target of input t is token t + 1. Targets that
    carry no loss (prompts, padding) are -100, which cross-entropy ignores. :func:`step_loss` scores
    them; they are not the models' ``labels``, which the models shift themselves."""
    b = ranks.rows(tokens).to(device, non_blocking=True)
    targets = b[:, 1:]
    if mask is not None:
        targets = targets.masked_fill(~ranks.rows(mask).to(device, non_blocking=True), -100)
    return b[:, :-1], targets


def step_loss(model, inputs, targets):
    """The next-token loss of one batch (fp32 mean over the targets that are not -100). The targets
    are shifted already (:func:`inputs_and_targets`), so the model is asked for its logits only:
    given them as ``labels`` it would shift them once more. Each of the seq_len inputs has its
    target: the loss equals transformers' ``model(input_ids=rows, labels=rows).loss`` on the whole
    rows of seq_len + 1 tokens (-100 where the mask says so)."""
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
