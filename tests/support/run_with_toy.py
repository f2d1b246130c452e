"""``python -m tests.support.run_with_toy ARGS`` = the train launcher with the toy loader registered."""

import sys

from torchtitan_ext.registry import register_loader

register_loader("toy", "tests.support.toy_loader:ToyLoader.Config", overwrite=True)

from torchtitan_ext.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
