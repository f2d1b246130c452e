"""The shared constants agree with the libraries that consume them."""

import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX as TORCHTITAN_IGNORE_INDEX

from torchtitan_ext.constants import IGNORE_INDEX


def test_ignore_index_is_torchtitans_and_torchs_default():
    assert IGNORE_INDEX == TORCHTITAN_IGNORE_INDEX
    logits = torch.randn(3, 5)
    labels = torch.tensor([1, IGNORE_INDEX, 2])
    # F.cross_entropy's default ignore_index (what HF models use) skips exactly our label
    assert torch.allclose(
        F.cross_entropy(logits, labels), F.cross_entropy(logits[[0, 2]], labels[[0, 2]])
    )
