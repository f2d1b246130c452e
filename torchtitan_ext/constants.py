"""Constants every system shares (a leaf module: imports nothing).

``IGNORE_INDEX`` is the label that takes no loss. It must equal torchtitan's
(``torchtitan/components/loss.py:27``, the ``ignore_index`` of its cross-entropy and the value its
``train_step`` excludes when it counts valid tokens) and Hugging Face's (``-100``, the default
``ignore_index`` of ``torch.nn.functional.cross_entropy``); ``tests/test_constants.py`` checks both,
so a change upstream fails a test rather than silently training on padding.
"""

IGNORE_INDEX = -100
