"""Text <-> token ids through the optional `tokenizers` package, and streaming detokenization."""

from __future__ import annotations

from pathlib import Path


def tokenizers_available() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


class Tokenizer:
    """A tokenizer.json loaded with `tokenizers` (its post-processor adds BOS where the model
    expects it)."""

    def __init__(self, path):
        from tokenizers import Tokenizer as HFTokenizer
        self._tok = HFTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when there is no tokenizer.json or no `tokenizers`."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file() or not tokenizers_available():
        return None
    return Tokenizer(path)


class TextStream:
    """Turns a growing list of ids into text deltas.

    Decoding token by token breaks multi-byte characters and merged spaces, so each call decodes a
    short window of recent ids and emits only what is new and complete (a trailing U+FFFD means a
    character is still cut in half, so it waits for the next token).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.prefix_start = 0   # window start: ids before it are already fully emitted
        self.read_start = 0     # ids from here on have not been emitted yet

    def push(self, ids: list[int]) -> str:
        decode = self.tokenizer.decode
        prefix = decode(ids[self.prefix_start:self.read_start])
        text = decode(ids[self.prefix_start:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_start, self.read_start = self.read_start, len(ids)
        return text[len(prefix):]
