"""Train a byte-level BPE tokenizer: thin wrapper over ``torchtitan_ext.tokenizer.cli:main``.

python scripts/train_tokenizer.py --input F --vocab-size N --special-token '<|endoftext|>' --out DIR
"""

import sys

from torchtitan_ext.tokenizer.cli import main

if __name__ == "__main__":
    sys.exit(main())
