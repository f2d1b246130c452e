#!/usr/bin/env python
"""Write the VL sample dataset (Parquet, HF-datasets loadable) derived from torchtitan_ext/data/vl_src.

python scripts/make_vl_sample_data.py OUT_DIR [--n 300] [--bad-rows] [--seed 0]
"""

import argparse
import sys

from torchtitan_ext.vl.sample_data import make_sample_dataset


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--n", type=int, default=300, help="number of image variants")
    ap.add_argument("--bad-rows", action="store_true", help="append the bad-input rows")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = make_sample_dataset(a.out_dir, n=a.n, bad_rows=a.bad_rows, seed=a.seed)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
