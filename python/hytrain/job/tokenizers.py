"""The tokenizers the job's data is read with: bytes (the preset models' alphabet) or a transformers
tokenizer, used without adding special tokens (the corpus places BOS and EOS itself), with chat
rendering that finds the assistant's turns for the loss mask."""

from __future__ import annotations

from pathlib import Path

from .options import ConfigError, first_line


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255: the preset models' alphabet. No special tokens."""
    vocab_size = 256
    eos_id = None
    bos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def token_ids(self, text: str) -> list[int]:
        return self.encode(text)


def with_eos(tokenizer, text: str | None):
    """``tokenizer`` with ``--eos-token TEXT`` as its EOS: the text must be one of its tokens (a token
    of its vocabulary by name, such as ``</s>``, or a text it encodes to one id; for the byte
    tokenizer, one byte). None: the tokenizer as it is."""
    if text is None:
        return tokenizer
    if not isinstance(text, str) or not text:
        raise ConfigError(f"--eos-token must be a non-empty text, got {text!r}")
    ids = tokenizer.token_ids(text)
    if len(ids) != 1:
        byte = isinstance(tokenizer, ByteTokenizer)
        what = f"{len(ids)} {'bytes' if byte else 'tokens'}, not one" if ids else "not in the tokenizer's vocabulary"
        raise ConfigError(f"--eos-token {text!r} is {what}: it must be one token of the "
                          f"{'byte tokenizer (one byte, such as a newline)' if byte else 'tokenizer'}")
    tokenizer.eos_id = ids[0]
    return tokenizer


class HFTokenizer:
    """A transformers tokenizer, used without adding special tokens (the corpus places BOS/EOS)."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.bos_id = tok.bos_token_id
        self.vocab_size = len(tok)

    @classmethod
    def load(cls, path) -> HFTokenizer:
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise ConfigError(f"no tokenizer at {path}: not a directory")
        try:
            return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
        except (OSError, ValueError) as e:
            raise ConfigError(f"no tokenizer at {path}: {first_line(e)}") from None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts) -> list[list[int]]:
        return self.tok(list(texts), add_special_tokens=False)["input_ids"]

    def token_ids(self, text: str) -> list[int]:
        """The ids of ``text``: one where it names a token of the vocabulary (``</s>``), else its encoding
        (none where that is only the unknown token: the text is not in the vocabulary)."""
        vocab = self.tok.get_vocab()
        if text in vocab:
            return [vocab[text]]
        ids = self.encode(text)
        unk = self.tok.unk_token_id
        return [] if unk is not None and ids == [unk] else ids

    def chat(self, messages) -> tuple[list[int], list[int]]:
        """(ids, mask): the conversation through the chat template, mask 1 on the assistant's turns.
        Rendering it one message at a time finds each turn's text without template support for masks;
        the assistant's header (the generation prompt) is not masked in, its end-of-turn is."""
        def render(msgs, prompt=False):
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)

        texts, flags, done = [], [], ""
        for i, m in enumerate(messages):
            parts = [(render(messages[:i], True), 0)] if m.get("role") == "assistant" else []
            for text, flag in parts + [(render(messages[:i + 1]), int(m.get("role") == "assistant"))]:
                if not text.startswith(done):
                    raise ConfigError("the tokenizer's chat template does not render a conversation one message "
                                      "after another; the assistant's turns cannot be found for the loss mask")
                texts.append(text[len(done):])
                flags.append(flag)
                done = text
        ids, mask = [], []
        for part, flag in zip(self.encode_batch(texts), flags):
            ids += part
            mask += [flag] * len(part)
        return ids, mask
