#!/usr/bin/env python
"""Summarise / verify / render a VL cache (same as ``inspect-cache`` / ``python -m torchtitan_ext.vl.inspect``)."""

import sys

from torchtitan_ext.vl.inspect import main

if __name__ == "__main__":
    sys.exit(main())
