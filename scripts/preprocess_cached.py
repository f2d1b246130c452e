#!/usr/bin/env python
"""Build the packed Qwen3-VL cache (same as ``preprocess-cached`` / ``python -m torchtitan_ext.vl.preprocess``)."""

import sys

from torchtitan_ext.vl.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
