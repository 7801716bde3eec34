"""Categorical columns as learned embeddings in front of a role's model.

A role whose categorical columns are encoded as codes (`securevfl.data.columns.ColumnEncoder`
with ``categorical = "embedding"``: one column per categorical column, 1..n for its n training
categories, n + 1 for ``other``, NaN for a missing cell) feeds its model through
`EmbeddingInput`: each code column goes through an `nn.Embedding` of its own, concatenated with
the role's other, scaled columns. A missing cell (code 0) and a value unseen in training (the
last code, ``other``, which no training row can have) read as the zero vector: the neutral
input, as a zero-filled block is; they are never trained, DP-SGD noise included.

The embeddings are parameters of the role's model: trained by its optimizer, clipped and noised
with it under DP-SGD (Opacus has a per-sample gradient for `nn.Embedding`), saved in its
checkpoint. What leaves the role is still only its model's output, through the method's sums.

Imported inside functions only (this module imports torch at import time).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from securevfl.data.columns import CODE_MISSING
from securevfl.methods.blocks.nets import derived_seed

MAX_DIM = 16  # the rule's cap (fast.ai's rule of thumb, capped for tabular VFL models)


def embedding_dim(n_codes: int, *, fixed: int | None = None) -> int:
    """The width of a column's embedding: `fixed` ([model] embedding_dim) when set, else
    ``min(16, round(1.6 * n_codes ** 0.56))``, at least 1 (`n_codes` counts the missing and
    ``other`` codes)."""
    if fixed is not None:
        return int(fixed)
    return max(1, min(MAX_DIM, round(1.6 * n_codes**0.56)))


def code_columns(table: Any) -> tuple[tuple[int, str, int], ...]:
    """(position, column, number of codes) of each code column of `table` (none for a table
    without categorical columns, or one-hot ones)."""
    encoder = getattr(table, "encoder", None)
    return () if encoder is None else encoder.code_columns()


def input_width(table: Any, cfg: Any) -> int:
    """The width of what the role's model reads after its embeddings: the other columns plus
    the embedding of each code column (`len(table.columns)` without code columns)."""
    codes = code_columns(table)
    fixed = getattr(cfg, "embedding_dim", None)
    return len(table.columns) - len(codes) + sum(embedding_dim(n, fixed=fixed) for _, _, n in codes)


def keep_codes(scaler: Any, table: Any) -> Any:
    """`scaler` (a fitted `Standardizer`) made to leave `table`'s code columns as they are
    (mean 0, scale 1: a code stays an integer, a missing cell becomes 0). Returns it."""
    for position, _, _ in code_columns(table):
        scaler.mean = np.array(scaler.mean, dtype=np.float64, copy=True)
        scaler.std = np.array(scaler.std, dtype=np.float64, copy=True)
        scaler.mean[position] = 0.0
        scaler.std[position] = 1.0
    return scaler


class EmbeddingInput(nn.Module):
    """Rows of a role's scaled columns in, its model's input out: the non-code columns, then
    one embedding per code column (in column order), concatenated. A code outside 0..n-1 is
    clipped into it; code 0 (a missing cell) and n - 1 (``other``) give the zero vector and no
    gradient."""

    def __init__(
        self, *, width: int, columns: tuple[tuple[int, str, int], ...], dims: list[int], seed: int
    ) -> None:
        super().__init__()
        coded = {position for position, _, _ in columns}
        self.columns = tuple(column for _, column, _ in columns)
        self.code_at = [position for position, _, _ in columns]
        self.sizes = [n for _, _, n in columns]
        self.register_buffer(
            "numeric_at",
            torch.tensor([j for j in range(width) if j not in coded], dtype=torch.long),
            persistent=False,
        )
        self.tables = nn.ModuleList(
            nn.Embedding(n, d) for n, d in zip(self.sizes, dims, strict=True)
        )
        g = torch.Generator()
        g.manual_seed(seed)
        with torch.no_grad():  # torch's default N(0, 1), from a generator of this model's own
            for table in self.tables:
                nn.init.normal_(table.weight, generator=g)
        self.out_dim = len(self.numeric_at) + sum(dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [x.index_select(1, self.numeric_at)]
        for position, size, table in zip(self.code_at, self.sizes, self.tables, strict=True):
            code = x[:, position].round().long().clamp(0, size - 1)
            # a missing cell and `other` are the zero vector: multiplied out, so that no update
            # (DP-SGD noise included) ever changes what they read
            held = ((code != CODE_MISSING) & (code != size - 1)).to(x.dtype).unsqueeze(1)
            parts.append(table(code) * held)
        return torch.cat(parts, dim=1)


def with_embeddings(table: Any, cfg: Any, model: nn.Module, *, seed: int) -> nn.Module:
    """`model` (built for `input_width(table, cfg)` inputs) behind the embeddings of `table`'s
    code columns, as one module (``Sequential(EmbeddingInput, model)``); `model` itself when
    the table has no code column, so one-hot models and their checkpoints are unchanged."""
    codes = code_columns(table)
    if not codes:
        return model
    fixed = getattr(cfg, "embedding_dim", None)
    front = EmbeddingInput(
        width=len(table.columns),
        columns=codes,
        dims=[embedding_dim(n, fixed=fixed) for _, _, n in codes],
        seed=derived_seed(seed, "embedding"),
    )
    return nn.Sequential(front, model)


def embedding_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """column -> its embedding table, of every `EmbeddingInput` in `model` (copies)."""
    out: dict[str, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, EmbeddingInput):
            for column, table in zip(module.columns, module.tables, strict=True):
                out[column] = table.weight.detach().clone()
    return out


__all__ = [
    "EmbeddingInput",
    "code_columns",
    "embedding_dim",
    "embedding_weights",
    "input_width",
    "keep_codes",
    "with_embeddings",
]
