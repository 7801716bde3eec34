"""torch modules of the encoder + head methods that need a class of their own. Imported inside
functions only (this module imports torch at import time)."""

from __future__ import annotations

import torch
from torch import nn


class Fusion(nn.Module):
    """``head(S + own(x))``: the active party's trainable part as one module, so that DP-SGD
    (``[active] dp_sgd``) wraps the head and the active party's own encoder together."""

    def __init__(self, head: nn.Module, own: nn.Module | None) -> None:
        super().__init__()
        self.head = head
        self.own = own

    def forward(self, s: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(s if self.own is None else s + self.own(x))
