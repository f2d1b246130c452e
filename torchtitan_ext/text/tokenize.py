"""Tokenizer loading and batched encoding for the text loaders.

One thin wrapper, :class:`TextTokenizer`, over a Hugging Face ``tokenizer.json``. Special tokens
(BOS/EOS/PAD) are inserted as ids, never by formatting ``"<|bos|>" + text`` into the string, and
special-token *strings* inside a document are encoded as plain text
(``Tokenizer.encode_special_tokens = True``): a document that happens to contain "<|bos|>" must
not gain a control token.

Two engines give the same ids:

* **tiktoken** (default where it applies) — only for a tokenizer for which
  :mod:`torchtitan_ext.text.fast_bpe` *proves* equality with ``tokenizers`` from the
  ``tokenizer.json`` alone (byte-level BPE, GPT-2 or Llama-3-style split pattern, no normalizer,
  no non-special added token, and a merge list that tiktoken's rank-by-string merging
  reproduces: see that module's theorem). A lookup table maps tiktoken's ranks back to the
  tokenizer's ids. It encodes 3-4x more tokens per CPU-second than ``tokenizers`` (GPT-2: see
  ``benchmarks/text_loaders``) and releases the GIL per document; tokenization is most of a text
  loader's CPU cost. Where the proof refuses, the reason is logged once per process and kept in
  ``engine_reason``. Two tripwires stay as defence in depth (not the proof): a probe text set at
  construction and the first ``verify_docs`` (256) documents actually encoded are compared with
  ``tokenizers``; a difference (only a library change could cause one) switches to
  ``tokenizers`` for good, with a warning.
* **tokenizers** (``engine="hf"``, or when tiktoken is refused) — ``encode_batch_fast`` (Rust,
  GIL released, no offsets).

The wrapper accepts a directory or a ``tokenizer.json`` path (with BOS/EOS/PAD read from
``tokenizer_config.json`` like transformers does, or given explicitly), a ``tokenizers.Tokenizer``,
or torchtitan's ``HuggingFaceTokenizer`` (whatever the Trainer built from ``hf_assets_path``); the
wrapped tokenizer is a private copy, so torchtitan's own object is never changed.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tokenizers import Tokenizer

from torchtitan_ext.text import fast_bpe
from torchtitan_ext.text.fast_bpe import TiktokenEngine

log = logging.getLogger(__name__)

Engine = Literal["auto", "tiktoken", "hf"]

PROBE_TEXTS = (
    "Hello world! It's a test: don't, we'll, they've, I'm, you're, he'd. IT'S DON'T",
    "Numbers 12345 and 3.14159, dates 2026-11-21; $100 & 50% off!!!",
    "   leading spaces, trailing spaces   \n\n\ttabs\tand\r\nnewlines\n\n\n",
    "Accents: café naïve résumé Ångström; Cyrillic: Война и мир; Greek: λόγος.",
    "CJK 東京 中文字符 日本語のテキスト; emoji 👩\u200d👩\u200d👧 🚀 ✓; math ∑∫√∞",
    "Special strings stay text: <|begin_of_text|> <|end_of_text|> <|endoftext|> <|pad|>",
    "MixedCASE CamelCaseWords snake_case_words kebab-case-words URL https://x.org/a?b=c",
    "",
    " ",
    "a",
)

_logged: set[tuple[str, str]] = set()
_logged_lock = threading.Lock()


def _log_once(level: int, source: str, reason: str) -> None:
    """Why the fast engine is off, once per process for each tokenizer source and reason (a
    loader per rank, worker and split would otherwise repeat it)."""
    with _logged_lock:
        if (source, reason) in _logged:
            return
        _logged.add((source, reason))
    log.log(level, "%s: tokenizing with `tokenizers`, not tiktoken: %s", source, reason)


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
        engine: Engine = "auto",
        verify_docs: int = 256,
    ) -> None:
        spec_str = tokenizer.to_str()
        # A private copy: we switch special-token matching off, and must not change the
        # caller's (e.g. torchtitan's) tokenizer object.
        self.tokenizer = Tokenizer.from_str(spec_str)
        self.tokenizer.encode_special_tokens = True
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.source = source
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._tt: TiktokenEngine | None = None
        self._verify_left = verify_docs
        self._lock = threading.Lock()
        self.engine_reason = "engine='hf' requested"
        if engine not in ("auto", "tiktoken", "hf"):
            raise ValueError(f"engine must be 'auto', 'tiktoken' or 'hf', got {engine!r}")
        if engine != "hf":
            self._tt, self.engine_reason = self._try_tiktoken(spec_str)
            if self._tt is None and engine == "tiktoken":
                raise ValueError(f"{source}: tiktoken engine not applicable: {self.engine_reason}")

    def _try_tiktoken(self, spec_str: str) -> tuple[TiktokenEngine | None, str]:
        got = fast_bpe.plan(spec_str)
        if isinstance(got, fast_bpe.Refusal):
            # INFO when tiktoken cannot apply at all (e.g. WordPiece: nothing lost); WARNING when
            # a byte-level BPE is refused (the user loses the fast engine and should hear why).
            _log_once(logging.WARNING if got.byte_level else logging.INFO, self.source, got.reason)
            return None, got.reason
        for text in PROBE_TEXTS:  # a tripwire for library changes, not the proof
            if got.encode(text).tolist() != self._hf_ids([text])[0]:
                reason = f"probe text differs between engines: {text!r}"
                _log_once(logging.WARNING, self.source, reason)
                return None, reason
        return got, "tiktoken engine: equality with tokenizers proven (see fast_bpe)"

    @property
    def engine(self) -> str:
        """``"tiktoken"`` or ``"hf"``: which engine encodes."""
        return "tiktoken" if self._tt is not None else "hf"

    def _hf_ids(self, texts: list[str]) -> list[list[int]]:
        encs = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encs]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_path(
        cls,
        path: str | Path,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        engine: Engine = "auto",
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
            tok,
            tid(bos_token, "BOS"),
            tid(eos_token, "EOS"),
            tid(pad_token, "PAD"),
            str(file),
            engine=engine,
        )

    @classmethod
    def coerce(
        cls, obj: Any, engine: Engine = "auto", bos_token: str | None = None
    ) -> TextTokenizer:
        """Accept a TextTokenizer, a path, a ``tokenizers.Tokenizer`` or torchtitan's
        ``HuggingFaceTokenizer`` (duck-typed: ``.tokenizer`` + ``bos_id``/``eos_id``).
        ``bos_token`` (a token string) replaces the BOS the tokenizer declares."""
        if isinstance(obj, (str, Path)):
            return cls.from_path(obj, bos_token=bos_token, engine=engine)
        if isinstance(obj, TextTokenizer):
            tok = obj
        elif isinstance(obj, Tokenizer):
            tok = cls(obj, None, None, engine=engine)
        elif isinstance(getattr(obj, "tokenizer", None), Tokenizer):
            bos, eos = getattr(obj, "bos_id", None), getattr(obj, "eos_id", None)
            tok = cls(obj.tokenizer, bos, eos, engine=engine)
        else:
            raise TypeError(f"cannot use {type(obj).__name__} as a tokenizer")
        if bos_token is None:
            return tok
        bos = tok.tokenizer.token_to_id(bos_token)
        if bos is None:
            raise ValueError(f"{tok.source}: BOS token {bos_token!r} is not in the vocabulary")
        if tok is obj and bos != tok.bos_id:  # never change the caller's object
            tok = cls(tok.tokenizer, bos, tok.eos_id, tok.pad_id, tok.source, engine=engine)
        tok.bos_id = bos
        return tok

    # ------------------------------------------------------------------ encoding
    def encode_arrays(
        self, texts: list[str], add_bos: bool = True, add_eos: bool = False
    ) -> list[np.ndarray]:
        """Encode ``texts`` to ``int32`` arrays with BOS prefixed / EOS appended as asked (the
        loaders' hot path: no Python lists of ints; ``int32``, half of ``int64``, because the
        packers buffer ~1000 documents and a checkpoint copies them — an id past 2**31 raises
        ``OverflowError``, and no vocabulary is that large)."""
        if add_bos and self.bos_id is None:
            raise ValueError(f"{self.source}: add_bos=True but the tokenizer has no BOS token")
        if add_eos and self.eos_id is None:
            raise ValueError(f"{self.source}: add_eos=True but the tokenizer has no EOS token")
        tt = self._tt
        if tt is None:
            bodies = [np.asarray(ids, dtype=np.int32) for ids in self._hf_ids(texts)]
        else:
            bodies = [tt.encode(t) for t in texts]
            if self._verify_left > 0:
                bodies = self._verify(texts, bodies)
        if not add_bos and not add_eos:
            return bodies
        pre = np.asarray([self.bos_id] if add_bos else [], dtype=np.int32)
        post = np.asarray([self.eos_id] if add_eos else [], dtype=np.int32)
        return [np.concatenate((pre, b, post)) for b in bodies]

    def _verify(self, texts: list[str], bodies: list[np.ndarray]) -> list[np.ndarray]:
        with self._lock:
            n = min(self._verify_left, len(texts))
            self._verify_left -= n
        ref = self._hf_ids(texts[:n])
        for i in range(n):
            if bodies[i].tolist() != ref[i]:
                log.warning(
                    "%s: tiktoken and tokenizers disagree on a document (%r...); using the "
                    "tokenizers engine from now on",
                    self.source,
                    texts[i][:60],
                )
                self._tt = None
                self.engine_reason = "switched to tokenizers after a verification mismatch"
                return [np.asarray(ids, dtype=np.int32) for ids in self._hf_ids(texts)]
        return bodies

    def encode_batch(
        self, texts: list[str], add_bos: bool = True, add_eos: bool = False
    ) -> list[list[int]]:
        """Like :meth:`encode_arrays`, as lists of ints."""
        return [a.tolist() for a in self.encode_arrays(texts, add_bos=add_bos, add_eos=add_eos)]

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        return self.encode_batch([text], add_bos=add_bos, add_eos=add_eos)[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(i)

    def __repr__(self) -> str:
        return (
            f"TextTokenizer({self.source}, vocab={self.vocab_size}, bos={self.bos_id}, "
            f"eos={self.eos_id}, pad={self.pad_id}, engine={self.engine})"
        )
