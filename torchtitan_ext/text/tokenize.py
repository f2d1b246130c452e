"""Tokenizer loading and batched encoding for the text loaders.

One thin wrapper, :class:`TextTokenizer`, over Hugging Face ``tokenizers`` (Rust). We use
``encode_batch_fast`` — no offsets, and the Rust side releases the GIL while it encodes a batch, so
a background thread tokenizing here does not stall the training loop's Python. Special tokens
(BOS/EOS/PAD) are inserted as ids, never by formatting ``"<|bos|>" + text`` into the string: a
document that happens to *contain* the literal text "<|bos|>" must not gain a control token.

The wrapper accepts a directory or a ``tokenizer.json`` path (with BOS/EOS/PAD read from
``tokenizer_config.json`` like transformers does, or given explicitly), a ``tokenizers.Tokenizer``,
or torchtitan's ``HuggingFaceTokenizer`` (whatever the Trainer built from ``hf_assets_path``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class TextTokenizer:
    """Batched, GIL-releasing encoding with explicit BOS/EOS ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None = None,
        source: str = "<in-memory>",
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.source = source
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_path(
        cls,
        path: str | Path,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> TextTokenizer:
        """Load from a directory holding tokenizer.json (+ tokenizer_config.json) or a file."""
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.exists():
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        tok = Tokenizer.from_file(str(file))
        cfg_file = file.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        bos_token = bos_token or _token_str(cfg.get("bos_token"))
        eos_token = eos_token or _token_str(cfg.get("eos_token"))
        pad_token = pad_token or _token_str(cfg.get("pad_token"))

        def tid(tokstr: str | None, what: str) -> int | None:
            if tokstr is None:
                return None
            i = tok.token_to_id(tokstr)
            if i is None:
                raise ValueError(f"{file}: {what} token {tokstr!r} is not in the vocabulary")
            return i

        return cls(
            tok, tid(bos_token, "BOS"), tid(eos_token, "EOS"), tid(pad_token, "PAD"), str(file)
        )

    @classmethod
    def coerce(cls, obj: Any) -> TextTokenizer:
        """Accept a TextTokenizer, a path, a ``tokenizers.Tokenizer`` or torchtitan's
        ``HuggingFaceTokenizer`` (duck-typed: ``.tokenizer`` + ``bos_id``/``eos_id``)."""
        if isinstance(obj, TextTokenizer):
            return obj
        if isinstance(obj, (str, Path)):
            return cls.from_path(obj)
        if isinstance(obj, Tokenizer):
            return cls(obj, None, None)
        inner = getattr(obj, "tokenizer", None)
        if isinstance(inner, Tokenizer):
            return cls(inner, getattr(obj, "bos_id", None), getattr(obj, "eos_id", None))
        raise TypeError(f"cannot use {type(obj).__name__} as a tokenizer")

    # ------------------------------------------------------------------ encoding
    def encode_batch(
        self, texts: list[str], add_bos: bool = True, add_eos: bool = False
    ) -> list[list[int]]:
        """Encode ``texts`` (no special tokens added by the tokenizer's post-processor), then
        prefix BOS / suffix EOS ids as asked."""
        if add_bos and self.bos_id is None:
            raise ValueError(f"{self.source}: add_bos=True but the tokenizer has no BOS token")
        if add_eos and self.eos_id is None:
            raise ValueError(f"{self.source}: add_eos=True but the tokenizer has no EOS token")
        encs = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        pre = [self.bos_id] if add_bos else []
        post = [self.eos_id] if add_eos else []
        return [pre + e.ids + post for e in encs]

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        return self.encode_batch([text], add_bos=add_bos, add_eos=add_eos)[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(i)

    def __repr__(self) -> str:
        return (
            f"TextTokenizer({self.source}, vocab={self.vocab_size}, bos={self.bos_id}, "
            f"eos={self.eos_id}, pad={self.pad_id})"
        )
