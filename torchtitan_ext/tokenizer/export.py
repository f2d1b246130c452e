"""Export a trained byte-level BPE (``train_bpe``'s ``vocab``/``merges``) to standard formats.

- ``save_tokenizer_json``: a Hugging Face ``tokenizer.json`` built with the ``tokenizers``
  library itself (BPE model, ByteLevel pre-tokenizer without prefix space using GPT-2's regex,
  ByteLevel decoder, special tokens registered under their own ids). Loadable by
  ``tokenizers.Tokenizer.from_file`` and ``transformers.PreTrainedTokenizerFast``.
- ``save_gpt2_files`` / ``read_gpt2_vocab`` / ``read_gpt2_merges``: GPT-2's ``vocab.json`` +
  ``merges.txt`` (tokens in GPT-2's byte-to-unicode alphabet), the format of CS336's reference
  fixtures.
- ``tiktoken_encoding``: the same ranks as a ``tiktoken.Encoding`` (a second, independent BPE
  encoder; the tests check that both give identical ids).

Why both a vocab and merges: HF's BPE model applies merges by their rank in the list, tiktoken by
the rank of the merged bytes; for a vocabulary learned by ``train_bpe`` the two orders agree
because merge k creates token ``len(specials) + 256 + k``.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

from torchtitan_ext.tokenizer.bpe import GPT2_PATTERN

__all__ = [
    "bytes_to_unicode",
    "read_gpt2_merges",
    "read_gpt2_vocab",
    "save_gpt2_files",
    "save_tokenizer_dir",
    "save_tokenizer_json",
    "tiktoken_encoding",
    "to_hf_tokenizer",
]


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (as in ``encoder.py``)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _to_str(token: bytes) -> str:
    m = bytes_to_unicode()
    return "".join(m[b] for b in token)


def _from_str(s: str, where: str) -> bytes:
    inv = {c: b for b, c in bytes_to_unicode().items()}
    try:
        return bytes(inv[c] for c in s)
    except KeyError as e:
        raise ValueError(
            f"{where}: {s!r} has a character outside GPT-2's byte alphabet: {e}"
        ) from None


def _special_ids(vocab: dict[int, bytes], special_tokens: list[str]) -> dict[str, int]:
    by_bytes: dict[bytes, int] = {}
    for i, t in vocab.items():
        by_bytes.setdefault(t, i)
    out = {}
    for s in special_tokens:
        i = by_bytes.get(s.encode("utf-8"))
        if i is None:
            raise ValueError(f"special token {s!r} is not in the vocabulary")
        out[s] = i
    return out


def to_hf_tokenizer(
    vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]], special_tokens: list[str]
):
    """A ``tokenizers.Tokenizer`` equivalent to ``(vocab, merges)`` (see module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = _special_ids(vocab, list(special_tokens))
    special_ids = set(specials.values())
    model_vocab: dict[str, int] = {}
    # Specials keep their raw text as the key (what HF's GPT-2 tokenizer.json does too).
    for s, i in specials.items():
        model_vocab[s] = i
    for i in sorted(vocab):
        if i in special_ids:
            continue
        key = _to_str(vocab[i])
        if key in model_vocab:
            if model_vocab[key] in special_ids:
                raise ValueError(
                    f"token id {i} ({vocab[i]!r}) spells the same as special token {key!r} in "
                    "GPT-2's byte alphabet; rename the special token"
                )
            # The same bytes learned twice (merge (a, bc) and later (ab, c)): one string can
            # only have one id in tokenizer.json; the first (lower) id is the one any encoder
            # produces, so the later one is unreachable anyway.
            continue
        model_vocab[key] = i
    hf_merges = [(_to_str(a), _to_str(b)) for a, b in merges]
    tok = Tokenizer(models.BPE(vocab=model_vocab, merges=hf_merges, fuse_unk=False))
    # The standard byte-level pre-tokenizer (as GPT-2's own tokenizer.json): its built-in split
    # regex is GPT-2's pattern (the tests check encodings against tiktoken with GPT2_PATTERN).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in sorted(specials, key=specials.get)]
    )
    for s, i in specials.items():
        got = tok.token_to_id(s)
        if got != i:  # add_special_tokens reuses the model's id; guard against API drift
            raise RuntimeError(f"special token {s!r} registered as id {got}, expected {i}")
    return tok


def save_tokenizer_json(
    vocab: dict[int, bytes],
    merges: list[tuple[bytes, bytes]],
    special_tokens: list[str] | tuple[str, ...],
    path: str | os.PathLike,
) -> Path:
    """Write a Hugging Face ``tokenizer.json`` for ``(vocab, merges)``; returns its path.

    ``path`` may be a directory (then ``<path>/tokenizer.json`` is written). Byte-level, no
    prefix space, GPT-2's pre-tokenization regex, special tokens registered with their ids.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    tok = to_hf_tokenizer(vocab, merges, list(special_tokens))
    tmp = p.with_name(p.name + ".tmp")
    tok.save(str(tmp), pretty=True)
    os.replace(tmp, p)  # atomic: a reader never sees half a file
    return p


def save_tokenizer_dir(
    vocab: dict[int, bytes],
    merges: list[tuple[bytes, bytes]],
    special_tokens: list[str] | tuple[str, ...],
    out_dir: str | os.PathLike,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    gpt2_files: bool = True,
) -> Path:
    """Write a tokenizer directory loadable by torchtitan's ``HuggingFaceTokenizer`` and
    ``transformers.AutoTokenizer``: ``tokenizer.json``, ``tokenizer_config.json`` (BOS/EOS/PAD
    named there, nothing added automatically) and, with ``gpt2_files``, ``vocab.json`` +
    ``merges.txt``. BOS/EOS/PAD must be among ``special_tokens``. Returns ``out_dir``.
    """
    specials = list(special_tokens)
    for name, tok in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token)):
        if tok is not None and tok not in specials:
            raise ValueError(f"{name} {tok!r} is not one of the special tokens {specials}")
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    save_tokenizer_json(vocab, merges, specials, d / "tokenizer.json")
    if gpt2_files:
        save_gpt2_files(vocab, merges, d)
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1 << 30,
    }
    for name, tok in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token)):
        if tok is not None:
            config[name] = tok
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
    return d


def save_gpt2_files(
    vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]], out_dir: str | os.PathLike
) -> tuple[Path, Path]:
    """Write GPT-2 style ``vocab.json`` (token string -> id) and ``merges.txt``."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    vocab_json = {_to_str(t): i for i, t in sorted(vocab.items())}
    (d / "vocab.json").write_text(json.dumps(vocab_json, ensure_ascii=False, indent=1), "utf-8")
    lines = ["#version: 0.2"] + [f"{_to_str(a)} {_to_str(b)}" for a, b in merges]
    (d / "merges.txt").write_text("\n".join(lines) + "\n", "utf-8")
    return d / "vocab.json", d / "merges.txt"


def read_gpt2_merges(path: str | os.PathLike) -> list[tuple[bytes, bytes]]:
    """Read a GPT-2 ``merges.txt`` (optional ``#version`` header) into byte pairs."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or (n == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected two space-separated tokens, got {line!r}")
            out.append((_from_str(parts[0], f"{path}:{n}"), _from_str(parts[1], f"{path}:{n}")))
    return out


def read_gpt2_vocab(path: str | os.PathLike) -> dict[int, bytes]:
    """Read a GPT-2 ``vocab.json`` (token string -> id) into id -> bytes.

    Special tokens such as ``<|endoftext|>`` are plain ASCII, which GPT-2's alphabet maps to
    itself, so they decode to their own UTF-8 bytes.
    """
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return {int(i): _from_str(s, f"{path}: key {s!r}") for s, i in raw.items()}


def tiktoken_encoding(
    vocab: dict[int, bytes], special_tokens: list[str] | tuple[str, ...], name: str = "bpe"
):
    """A ``tiktoken.Encoding`` with the same ranks (ids) and GPT-2's pattern.

    Needs the optional ``tiktoken`` package (a test dependency). Where the same bytes were learned
    twice the lower id is kept (see ``to_hf_tokenizer``).
    """
    import tiktoken

    specials = _special_ids(vocab, list(special_tokens))
    special_ids = set(specials.values())
    ranks: dict[bytes, int] = {}
    for i in sorted(vocab):
        if i not in special_ids:
            ranks.setdefault(vocab[i], i)
    return tiktoken.Encoding(
        name=name,
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=specials,
        explicit_n_vocab=None,
    )
