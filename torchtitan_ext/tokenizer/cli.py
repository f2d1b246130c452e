"""``train-tokenizer``: train a byte-level BPE with ``train_bpe`` and write it out.

    train-tokenizer --input corpus.txt --vocab-size 32000 \\
        --special-token '<|endoftext|>' --out tokenizer_dir/

Writes ``tokenizer.json`` (Hugging Face), ``vocab.json`` + ``merges.txt`` (GPT-2 format),
``tokenizer_config.json`` and ``train_summary.json``; shows tqdm progress bars and prints where
the time went (pre-tokenization vs merging).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from torchtitan_ext.tokenizer.bpe import BPEStats, native_available, train_bpe
from torchtitan_ext.tokenizer.export import save_tokenizer_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train-tokenizer",
        description="Train a byte-level BPE tokenizer (CS336 / GPT-2 semantics) on a UTF-8 file.",
    )
    p.add_argument(
        "--input", required=True, help="UTF-8 text file (documents separated by a special token)"
    )
    p.add_argument("--vocab-size", type=int, required=True, help="specials + 256 bytes + merges")
    p.add_argument(
        "--special-token",
        action="append",
        default=[],
        metavar="TOKEN",
        help="special token (repeatable); ids 0.. in the order given; the text is split on them",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="pre-tokenization processes (default: CPUs; 0: in-process)",
    )
    p.add_argument(
        "--chunk-mb", type=float, default=None, help="chunk size in MiB (default: auto, <= 1)"
    )
    p.add_argument(
        "--engine",
        choices=["auto", "native", "python"],
        default="auto",
        help="merge loop implementation",
    )
    p.add_argument(
        "--bos-token",
        default=None,
        help="written to tokenizer_config.json (must be a special token)",
    )
    p.add_argument(
        "--eos-token",
        default=None,
        help="written to tokenizer_config.json (must be a special token)",
    )
    p.add_argument(
        "--pad-token",
        default=None,
        help="written to tokenizer_config.json (must be a special token)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    # the flag's earlier name, kept working (hidden): every tool spells it --quiet
    p.add_argument("--no-progress", dest="quiet", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, tok in (
        ("--bos-token", args.bos_token),
        ("--eos-token", args.eos_token),
        ("--pad-token", args.pad_token),
    ):
        if tok is not None and tok not in args.special_token:
            print(
                f"error: {flag} {tok!r} is not one of the --special-token values", file=sys.stderr
            )
            return 2
    out = Path(args.out)
    stats = BPEStats()
    t0 = time.perf_counter()
    try:
        vocab, merges = train_bpe(
            args.input,
            args.vocab_size,
            args.special_token,
            args.workers,
            chunk_bytes=None if args.chunk_mb is None else max(1, int(args.chunk_mb * (1 << 20))),
            engine=args.engine,
            progress=not args.quiet,
            stats=stats,
        )
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t1 = time.perf_counter()
    save_tokenizer_dir(
        vocab,
        merges,
        args.special_token,
        out,
        bos_token=args.bos_token,
        eos_token=args.eos_token,
        pad_token=args.pad_token,
    )
    write_s = time.perf_counter() - t1
    summary = {
        "input": str(args.input),
        "vocab_size": len(vocab),
        "requested_vocab_size": args.vocab_size,
        "special_tokens": args.special_token,
        "native_merge_loop_built": native_available(),
        "total_s": round(t1 - t0, 4),
        "write_s": round(write_s, 4),
        **asdict(stats),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n", "utf-8")
    total = max(t1 - t0, 1e-9)
    mb = stats.bytes_read / 1e6
    asked = args.vocab_size - 256 - len(args.special_token)
    short = "" if stats.merges == asked else ", the corpus ran out of pairs"
    pre, mer = stats.pretokenize_s, stats.merge_s
    print(
        f"\ntrained {len(vocab)} tokens ({stats.merges} merges{short}) "
        f"on {mb:.1f} MB in {total:.2f} s\n"
        f"  pre-tokenization {pre:8.2f} s ({100 * pre / total:4.1f} %)  "
        f"{mb / max(pre, 1e-9):.1f} MB/s, {stats.workers} workers, {stats.chunks} chunks, "
        f"{stats.pretokens} pre-tokens ({stats.unique_pretokens} unique)\n"
        f"  merging          {mer:8.2f} s ({100 * mer / total:4.1f} %)  engine={stats.engine}\n"
        f"  writing          {write_s:8.2f} s\n"
        f"wrote {out}/: tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, "
        "train_summary.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
