"""The tiktoken engine of :class:`~torchtitan_ext.text.tokenize.TextTokenizer`, and the proof that
decides when it gives exactly the ids of Hugging Face ``tokenizers``.

tiktoken encodes 3-4x more tokens per CPU-second than ``tokenizers`` (GPT-2 vocabulary; see
``benchmarks/text_loaders``), but it implements BPE differently, so it is used only for a
tokenizer for which :func:`plan` *proves* equality. Everything else goes to ``tokenizers``.

Pipeline, component by component (what ``tokenizers`` does vs what tiktoken does):

=================  ==========================================  ==================================
component          accepted (anything else: refused)           why it is then the same
=================  ==========================================  ==================================
added tokens       special ones only                           we encode with
                                                               ``encode_special_tokens=True``: a
                                                               special token's text is plain text
                                                               in both; a non-special added token
                                                               is split out by ``tokenizers`` only
normalizer         none                                        (tiktoken has none)
pre-tokenizer      ``ByteLevel(add_prefix_space=False,         both split with the same pattern,
                   use_regex=True)`` (GPT-2), or               which matches every character (no
                   ``Sequence[Split(P, "isolated"),            gaps: ``Split`` keeps gaps, tiktoken
                   ByteLevel(use_regex=False)]`` with P one    drops them); the two regex engines
                   of :data:`KNOWN_PATTERNS` (Llama 3 /        (Oniguruma, fancy-regex) agree on
                   cl100k, GPT-2)                              every code point (tested
                                                               exhaustively)
model              BPE, no dropout, no word prefix/suffix,     see the theorem below
                   no byte fallback, all 256 byte symbols
post-processor     none, ``ByteLevel``, ``TemplateProcessing`` ids are taken with
                   or a ``Sequence`` of these                  ``add_special_tokens=False``: these
                                                               then change offsets only
decoder            anything                                    ids never pass through it
=================  ==========================================  ==================================

The BPE theorem. Both libraries run the same greedy loop on each pre-token: merge the adjacent
pair with the smallest rank, the leftmost one on ties, until no pair has a rank. They differ in
what a pair's rank is, and in one shortcut:

* ``tokenizers`` ranks a *pair of tokens* ``(x, y)`` by its position in the merge list (the last
  one when a pair is listed twice); a pair not in the list never merges.
* tiktoken ranks the *concatenated bytes* ``x + y`` ("rank by string"): any pair whose
  concatenation is a token merges, and before merging at all it returns a pre-token that is
  itself a token as that single token.

Let ``A`` be the tokens BPE can produce: the 256 byte symbols and the result of every merge. Give
the tiktoken engine, for each merge result, the rank of the merge that produces it. Then
tiktoken and ``tokenizers`` give the same ids for every pre-token if:

* **(U) one merge per token** — no token is the result of two different merges;
* **(C) every token encodes to itself** — ``tokenizers``' BPE applied to the string of each token
  of ``A`` alone gives that single token (with ``ignore_merges`` off);
* **(I)** with ``ignore_merges`` on, every vocabulary entry that some text can have as a whole
  pre-token is in ``A``.

Proof. By (U) a listed pair ``(x, y)`` has the same rank in both. The only pairs the two rank
differently are *impostors*: ``(x, y)`` not listed with ``x + y`` in ``A``. Lemma: no state
``tokenizers`` reaches contains an adjacent impostor. Suppose a state on pre-token ``w`` has ``x``
next to ``y``. Every merge so far that touched the span of ``x + y`` lay inside it (``x`` and ``y``
are whole tokens) and was the minimum over all of ``w``, so also over the span; hence
``tokenizers`` on the string ``x + y`` alone makes the same merges in the same order, reaches
``[x, y]``, and stops there since ``(x, y)`` is not listed, contradicting (C). So in every state
either library reaches, both see the same candidate pairs with the same ranks and make the same
merge (induction over steps). Finally tiktoken's shortcut returns ``[w]`` for ``w`` in ``A``,
and so does ``tokenizers`` by (C) (with ``ignore_merges``, by its own shortcut, which by (I)
fires on no pre-token outside ``A``). ∎

How tight. (C) is also *necessary* for every token that can be a whole pre-token (tiktoken's
shortcut returns it, ``tokenizers`` does not): hand-appended merges ``J V``, ``Q J``, ``QJ V`` make
``QJV`` a token that ``tokenizers`` encodes as ``Q`` + ``JV``. Where (U) fails we refuse without
deciding whether the rank difference is reachable: that is every merge list converted from a
tiktoken vocabulary by transformers' ``TikTokenConverter``, which lists *every* split of each
token whose halves are tokens (Meta's Llama 3 ``tokenizer.json`` was made that way; the file
itself cannot be downloaded here, the tests build the same structure), so those tokenizers use
``tokenizers``. Tokenizers trained by ``tokenizers`` or by :mod:`torchtitan_ext.tokenizer`
satisfy (U) by construction and, in practice, (C). Cost: one ``encode_batch`` of the merge
results; GPT-2's 50k merges add ~0.6 s to the first construction in a process (cached after).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer

# Pre-tokenization patterns, verbatim as tokenizers.json spells them. GPT-2's is the one
# ByteLevel(use_regex=True) applies; the others appear in Split pre-tokenizers.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Each matches every character (a letter, a digit, whitespace or anything else starts a match),
# and tests/test_tokenizer_zoo.py checks both regex engines agree on every code point.
KNOWN_PATTERNS: dict[str, str] = {
    GPT2_PATTERN: "GPT-2",
    LLAMA3_PATTERN: "Llama 3 / cl100k",
}


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable stand-in character -> byte."""
    from torchtitan_ext.tokenizer.export import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


@dataclass(frozen=True)
class Refusal:
    """Why the tiktoken engine is not used. ``byte_level`` is False when the tokenizer is not a
    byte-level BPE at all (nothing to prove; expected), True when it is one that the proof refuses
    (the user loses speed and should hear why)."""

    reason: str
    byte_level: bool


def _is_type(node: Any, *types: str) -> bool:
    return isinstance(node, dict) and node.get("type") in types


def _pattern(pre: Any) -> str | Refusal:
    """The split pattern of an accepted pre-tokenizer, else a refusal."""
    if _is_type(pre, "Sequence") and len(pre.get("pretokenizers") or []) == 1:
        pre = pre["pretokenizers"][0]
    if _is_type(pre, "ByteLevel"):
        if pre.get("add_prefix_space"):
            return Refusal("ByteLevel pre-tokenizer with add_prefix_space=True", True)
        if not pre.get("use_regex", True):
            return Refusal("ByteLevel pre-tokenizer with use_regex=False and no Split", True)
        return GPT2_PATTERN
    if not _is_type(pre, "Sequence"):
        kind = pre.get("type") if isinstance(pre, dict) else None
        return Refusal(f"pre-tokenizer {kind!r} is not byte-level", False)
    parts = pre.get("pretokenizers") or []
    if not (len(parts) == 2 and _is_type(parts[0], "Split") and _is_type(parts[1], "ByteLevel")):
        kinds = [p.get("type") for p in parts if isinstance(p, dict)]
        byte_level = any(k == "ByteLevel" for k in kinds)
        return Refusal(f"pre-tokenizer Sequence{kinds} is not Split + ByteLevel", byte_level)
    split, byte_level = parts
    if byte_level.get("use_regex", True) or byte_level.get("add_prefix_space"):
        return Refusal("Split + ByteLevel with use_regex or add_prefix_space on", True)
    pattern = (split.get("pattern") or {}).get("Regex")
    if split.get("behavior") != "Isolated" or split.get("invert") or pattern is None:
        return Refusal("Split pre-tokenizer is not an isolating regex split", True)
    if pattern not in KNOWN_PATTERNS:
        return Refusal(f"Split regex {pattern!r} is not one of the verified patterns", True)
    return pattern


def _post_processor_ok(node: Any) -> bool:
    if node is None or _is_type(node, "ByteLevel", "TemplateProcessing"):
        return True
    return _is_type(node, "Sequence") and all(
        _post_processor_ok(p) for p in node.get("processors") or []
    )


def check_pipeline(spec: dict[str, Any]) -> str | Refusal:
    """Everything but the merges (see the module table): the split pattern, or a refusal."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return Refusal(f"model type {model.get('type')!r} is not BPE", False)
    pattern = _pattern(spec.get("pre_tokenizer"))
    if isinstance(pattern, Refusal):
        return pattern
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        if model.get(key):
            return Refusal(f"BPE {key}={model[key]!r}", True)
    normalizer = spec.get("normalizer")
    if normalizer is not None and not (
        _is_type(normalizer, "Sequence") and not normalizer.get("normalizers")
    ):
        return Refusal(f"has a normalizer ({normalizer.get('type')})", True)
    if not _post_processor_ok(spec.get("post_processor")):
        kind = spec["post_processor"].get("type")
        return Refusal(f"post-processor {kind!r} may change ids", True)
    plain = [t["content"] for t in spec.get("added_tokens") or [] if not t.get("special")]
    if plain:
        shown = ", ".join(repr(s) for s in plain[:5]) + (" ..." if len(plain) > 5 else "")
        return Refusal(f"{len(plain)} non-special added token(s) ({shown})", True)
    return pattern


def _merge_pairs(model: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def check_merges(spec: dict[str, Any]) -> tuple[list[str], list[int]] | Refusal:
    """Conditions (U), (C), (I) of the theorem. Returns the tokens of ``A`` beyond the 256
    bytes in tiktoken rank order, with their ids, or a refusal naming the first offenders."""
    model = spec["model"]
    vocab: dict[str, int] = model["vocab"]
    u2b = _byte_level_decoder()
    if any(c not in vocab for c in u2b):
        missing = sum(c not in vocab for c in u2b)
        return Refusal(f"byte-level vocabulary lacks {missing} of the 256 byte symbols", True)
    pairs = _merge_pairs(model)
    if not {c for a, b in pairs for c in a + b} <= u2b.keys():
        return Refusal("the merges are not over the byte-level alphabet", True)
    # tokenizers' effective rank of a pair is its last position in the list (a dict overwrite).
    rank = {pair: r for r, pair in enumerate(pairs)}
    order = sorted(rank, key=rank.__getitem__) if len(rank) < len(pairs) else pairs
    made_by: dict[str, tuple[str, str]] = {}
    for pair in order:
        result = pair[0] + pair[1]
        other = made_by.setdefault(result, pair)
        if other is not pair:  # (U)
            return Refusal(f"token {result!r} is made by two merges, {other} and {pair}", True)
    tokens = list(made_by)
    # (C): tokenizers' BPE alone (no pre-tokenizer, ignore_merges off) on each token's string.
    bare = dict(spec, normalizer=None, pre_tokenizer=None, post_processor=None, decoder=None)
    bare["added_tokens"] = []
    bare["model"] = dict(model, ignore_merges=False, dropout=None)
    encs = Tokenizer.from_str(json.dumps(bare)).encode_batch_fast(tokens, add_special_tokens=False)
    bad = [(t, e.ids) for t, e in zip(tokens, encs, strict=True) if e.ids != [vocab[t]]]
    if bad:
        by_id = {i: t for t, i in vocab.items()}
        shown = "; ".join(f"{t!r} -> {[by_id.get(i) for i in ids]}" for t, ids in bad[:3])
        return Refusal(
            f"{len(bad)} merge result(s) do not encode to themselves under tokenizers' "
            f"merge order (hand-edited merges?): {shown}",
            True,
        )
    if model.get("ignore_merges"):  # (I)
        produced = set(made_by) | set(u2b)
        pre = Tokenizer.from_str(json.dumps(spec)).pre_tokenizer
        extra = [t for t in vocab if t not in produced and _whole_pre_token(pre, t, u2b)]
        if extra:
            return Refusal(
                f"ignore_merges=True and {len(extra)} vocabulary entries that can be a whole "
                f"pre-token are not merge results (e.g. {extra[:3]})",
                True,
            )
    return tokens, [vocab[t] for t in tokens]


def _whole_pre_token(pre: Any, token: str, u2b: dict[str, int]) -> bool:
    r"""Whether some text has ``token`` (byte-level form) as one whole pre-token. For the accepted
    patterns (matched left to right, lookahead only ``(?!\S)``, which also holds at the end) that
    is exactly when the pre-tokenizer leaves the token's own text in one piece: a match that ends
    at the token's end in a longer text ends there in the text alone too, and a higher-priority
    match in the text alone would have won in the longer text as well."""
    if any(c not in u2b for c in token):
        return False  # e.g. a special token's content outside the byte-level alphabet
    try:
        text = bytes(u2b[c] for c in token).decode("utf-8")
    except UnicodeDecodeError:
        return False  # pre-tokens are pieces of valid text
    return [piece for piece, _ in pre.pre_tokenize_str(text)] == [token]


@dataclass(frozen=True)
class Proof:
    """What the engine is built from once equality is proven: the split pattern, and every
    token tiktoken may emit as bytes, in rank order (the 256 single bytes first, then the merge
    results in tokenizers' merge order), with its id."""

    pattern: str
    ranked: tuple[bytes, ...]
    ids: tuple[int, ...]

    @classmethod
    def of(cls, spec: dict[str, Any], pattern: str, tokens: list[str]) -> Proof:
        u2b = _byte_level_decoder()
        vocab: dict[str, int] = spec["model"]["vocab"]
        b2u = {b: c for c, b in u2b.items()}
        ranked = [bytes([b]) for b in range(256)] + [bytes(u2b[c] for c in t) for t in tokens]
        ids = [vocab[b2u[b]] for b in range(256)] + [vocab[t] for t in tokens]
        return cls(pattern, tuple(ranked), tuple(ids))


@functools.lru_cache(maxsize=8)
def prove(spec_str: str) -> Proof | Refusal:
    """The module's conditions for a ``tokenizer.json`` (as a string): a :class:`Proof`, or
    why not. Cached (immutable): a job builds a tokenizer per loader from the same file."""
    spec = json.loads(spec_str)
    pattern = check_pipeline(spec)
    if isinstance(pattern, Refusal):
        return pattern
    merged = check_merges(spec)
    if isinstance(merged, Refusal):
        return merged
    return Proof.of(spec, pattern, merged[0])


class TiktokenEngine:
    """A tiktoken ``Encoding`` over the proven ranks, plus a rank -> id lookup table."""

    def __init__(self, proof: Proof) -> None:
        import tiktoken

        # Single bytes get ranks 0..255 (tiktoken never ranks them against merges).
        ranks = {b: r for r, b in enumerate(proof.ranked)}
        self.enc = tiktoken.Encoding(
            "torchtitan_ext", pat_str=proof.pattern, mergeable_ranks=ranks, special_tokens={}
        )
        self.lut = np.asarray(proof.ids, dtype=np.int32)  # ids as TextTokenizer returns them

    def encode(self, text: str) -> np.ndarray:
        return self.lut[np.asarray(self.enc.encode_ordinary(text), dtype=np.int64)]


def plan(spec_str: str) -> TiktokenEngine | Refusal:
    """A tiktoken engine for a ``tokenizer.json`` (as a string) if equality with ``tokenizers``
    is proven (module docstring), else why not. Each call builds its own engine (the proof is
    cached), so no tokenizer shares mutable state with another."""
    proof = prove(spec_str)
    if isinstance(proof, Refusal):
        return proof
    try:
        return TiktokenEngine(proof)
    except ImportError:
        return Refusal("tiktoken is not installed", True)
