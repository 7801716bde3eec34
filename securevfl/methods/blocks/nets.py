"""Neural building blocks of the encoder + head methods: MLPs, standardisation, losses, seeds,
batches. Torch is imported on first use (`securevfl.lazy`)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from securevfl.lazy import nn, torch

if TYPE_CHECKING:
    from securevfl.config import RunConfig


def derived_seed(seed: int, *names: str | int) -> int:
    """A 63-bit seed derived from the run seed and names (so every role seeds independently
    but reproducibly)."""
    h = hashlib.sha256(repr((seed, *names)).encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def torch_generator(seed: int, *names: str | int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derived_seed(seed, *names))
    return g


def mlp(in_dim: int, hidden: Sequence[int], out_dim: int, *, seed: int) -> nn.Sequential:
    """Linear-ReLU stack with a linear output, initialised from `seed` only: the values torch's
    default initialisation gives after ``torch.manual_seed(seed)``, drawn from a generator of
    its own, so that roles building models in threads of one process never share a stream."""
    g = torch.Generator()
    g.manual_seed(seed)
    layers: list[nn.Module] = []
    prev = in_dim
    for h in hidden:
        layers += [nn.Linear(prev, h), nn.ReLU()]
        prev = h
    layers.append(nn.Linear(prev, out_dim))
    with torch.no_grad():
        for layer in layers:
            if isinstance(layer, nn.Linear):  # as nn.Linear.reset_parameters, in its order
                nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=g)
                bound = 1.0 / math.sqrt(layer.weight.shape[1])
                nn.init.uniform_(layer.bias, -bound, bound, generator=g)
    return nn.Sequential(*layers)


def run_backward(out: torch.Tensor, grad: torch.Tensor | None = None) -> None:
    """``out.backward(grad)``, straight into autograd's engine where torch's Python checks have
    nothing to do: a plain tensor that requires grad, and a gradient of its shape, dtype and
    device (or none, for a one-element output: ones, as torch makes them). The engine runs the
    same backward; skipped is only the Python around it, which costs most in a role whose
    caches another role has evicted (`bench/cold_cache.py`: a party's backward and Adam step
    0.97 against 0.89 ms cold, 0.33 against 0.28 ms warm). Anything else, and a torch without
    that engine entry, goes through ``out.backward`` as before."""
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    plain = (
        engine is not None
        and type(out) is torch.Tensor
        and out.requires_grad
        and not torch.overrides.has_torch_function_unary(out)
    )
    if plain and grad is None and out.numel() == 1:
        grad = torch.ones_like(out, memory_format=torch.preserve_format)
    elif not (
        plain
        and type(grad) is torch.Tensor
        and grad.shape == out.shape
        and grad.dtype == out.dtype
        and grad.device == out.device
        and not grad.requires_grad
    ):
        out.backward(grad)
        return
    # (tensors, grad_tensors, retain_graph, create_graph, inputs, allow_unreachable,
    # accumulate_grad): what torch.autograd.backward passes for out.backward(grad)
    engine.run_backward((out,), (grad,), False, False, (), True, True)


def make_optimizer(params: Iterable[torch.nn.Parameter], cfg: RunConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":  # torch's Adam, bit for bit, at less Python cost a step
        from securevfl.methods.blocks.lean_adam import LeanAdam

        return LeanAdam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)


class Standardizer:
    """Per-column z-scores fitted on training rows; empty cells (NaN) become 0 after scaling."""

    def __init__(self) -> None:
        self.mean: np.ndarray | None = None
        self.std: np.ndarray | None = None

    def fit(self, values: np.ndarray) -> Standardizer:
        with np.errstate(all="ignore"):
            mean = np.nanmean(values, axis=0) if len(values) else np.zeros(values.shape[1])
            std = np.nanstd(values, axis=0) if len(values) else np.ones(values.shape[1])
        self.mean = np.nan_to_num(mean)
        self.std = np.where(np.nan_to_num(std) > 1e-12, np.nan_to_num(std), 1.0)
        return self

    def fit_table(self, table: Any, ids: np.ndarray) -> Standardizer:
        """Fitted on the encoded rows of `ids` in `table`. A table streamed from disk is
        summarised a block at a time (`column_summary`), never read whole into memory; the
        result equals `fit(table.rows(ids))` to rounding (~1e-15 relative)."""
        if not getattr(table, "streamed", False):
            return self.fit(table.rows(ids))
        return self.fit_summary(table.column_summary(ids))

    def fit_summary(self, summary: Mapping[str, np.ndarray]) -> Standardizer:
        """Fitted from a column summary (`PartyTable.column_summary`: mean, population std)."""
        std = np.nan_to_num(summary["std"])
        self.mean = np.nan_to_num(summary["mean"])
        self.std = np.where(std > 1e-12, std, 1.0)
        return self

    def transform(self, values: np.ndarray) -> np.ndarray:
        if self.mean is None:
            raise RuntimeError("Standardizer.transform before fit")
        return np.nan_to_num((values - self.mean) / self.std).astype(np.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"mean": torch.as_tensor(self.mean), "std": torch.as_tensor(self.std)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.mean = np.asarray(state["mean"])
        self.std = np.asarray(state["std"])


class ScaledBatches:
    """The scaled rows of a table by id, batch after batch. A table held in memory is scaled
    once, whole, and each batch then only picks its rows (elementwise the same float32 values
    as scaling the batch); it is scaled again when the scaler's statistics or the table's
    matrix change (a fit, a checkpoint loaded). A table streamed from disk is read and scaled
    batch by batch, so its memory stays bounded by the batch."""

    def __init__(self, table: Any, scaler: Standardizer) -> None:
        self.table = table
        self.scaler = scaler
        self._key: tuple[Any, bytes, bytes] | None = None
        self._scaled: np.ndarray | None = None

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), n_columns]: `scaler.transform(table.rows(ids))`."""
        matrix = None if getattr(self.table, "streamed", False) else self.table.values
        if matrix is None or self.scaler.mean is None:
            return self.scaler.transform(self.table.rows(ids))
        stats = (np.asarray(self.scaler.mean).tobytes(), np.asarray(self.scaler.std).tobytes())
        if self._key is None or self._key[0] is not matrix or self._key[1:] != stats:
            self._scaled = self.scaler.transform(matrix)
            self._key = (matrix, *stats)
        return self._scaled[self.table.positions(ids)]


def scaled_rows(owner: Any, ids: np.ndarray, *, scaler: Standardizer | None = None) -> np.ndarray:
    """`scaler.transform(owner.table.rows(ids))` (`scaler` defaults to `owner.scaler`) through
    the owner's `ScaledBatches`, made again when the owner's table or scaler is another object
    (a new set-up); a loaded checkpoint's statistics are seen by `ScaledBatches` itself."""
    scaler = owner.scaler if scaler is None else scaler
    batches = getattr(owner, "_scaled_batches", None)
    if batches is None or batches.table is not owner.table or batches.scaler is not scaler:
        batches = owner._scaled_batches = ScaledBatches(owner.table, scaler)
    return batches.rows(ids)


def float_tensors(arrays: Mapping[str, Any], device: Any) -> dict[str, Any]:
    """Received arrays (sums, gradients) as float32 tensors on `device`, by name."""
    return {
        k: torch.tensor(np.asarray(v, dtype=np.float32), device=device) for k, v in arrays.items()
    }


def output_dim(task: str, n_classes: int) -> int:
    return n_classes if task == "multiclass" else 1


def task_loss(
    task: str, output: torch.Tensor, y: torch.Tensor, *, reduction: str = "mean"
) -> torch.Tensor:
    if task == "binary":
        return nn.functional.binary_cross_entropy_with_logits(
            output.reshape(-1), y.float(), reduction=reduction
        )
    if task == "multiclass":
        return nn.functional.cross_entropy(output, y.long(), reduction=reduction)
    return nn.functional.mse_loss(output.reshape(-1), y.float(), reduction=reduction)


def class_count(task: str, labels: np.ndarray) -> int:
    """Number of classes; refuses labels that are not 0..C-1 integers for classification."""
    if task == "regression":
        return 1
    from securevfl.errors import DataError

    values = np.unique(labels[~np.isnan(labels)])  # unlabeled rows (a labeled budget) left out
    shown = f"{len(values)} distinct label(s), read as {values[:10].tolist()}"
    if not len(values):
        raise DataError(
            "the label column holds no label in these rows; check [data] label (and, with "
            "[missing] labeled, that the labeled budget leaves some labeled rows)"
        )
    if not np.all(np.isfinite(values)):
        raise DataError(f"task {task!r} needs finite class labels; the label column has {shown}")
    if task == "binary":
        if set(values.tolist()) <= {0.0, 1.0}:
            return 2
        if len(values) == 2:
            top = values[-1]
            name = str(int(top)) if top == round(top) else repr(float(top))
            hint = f'set [data] positive to the label that is class 1 (e.g. positive = "{name}")'
        else:
            hint = "set [data] task = 'multiclass' for more than two classes"
        raise DataError(
            f"task 'binary' needs labels 0 and 1, but the label column has {shown} (text labels "
            f"are numbered in sorted order); {hint}, or recode them as 0/1"
        )
    if not np.all(values == np.round(values)) or values.min() < 0:
        raise DataError(
            f"task {task!r} needs class labels 0..C-1 (or text labels), but the label column has "
            f"{shown}; recode them as 0..C-1, or set [data] task = 'regression' for a numeric "
            "target"
        )
    n = int(values.max()) + 1
    if n > 10 * len(values) + 100:  # the output layer has one unit per class id up to the top
        raise DataError(
            f"task {task!r}: class ids run up to {n - 1} for only {len(values)} distinct labels "
            f"(an output of {n} classes); recode them as 0..C-1"
        )
    return max(n, 2)


def table_class_count(task: str, table: Any) -> int:
    """`class_count` of the labels of `table`; a table streamed from disk is read a block of
    labels at a time (only each block's distinct values are kept)."""
    if not getattr(table, "streamed", False):
        return class_count(task, table.labels)
    seen = [np.unique(b[~np.isnan(b)]) for b in table.rowstore.label_blocks()]
    return class_count(task, np.unique(np.concatenate(seen)) if seen else np.empty(0))


def batches(ids: np.ndarray, batch_size: int, *, seed: int, epoch: int) -> list[np.ndarray]:
    """The epoch's shuffled batches, reproducible from (seed, epoch) so a resumed run replays
    the same order."""
    rng = np.random.default_rng([seed, epoch, 0xBA7C])
    perm = rng.permutation(ids)
    return [perm[i : i + batch_size] for i in range(0, len(perm), batch_size)]


def table_batches(
    table: Any, ids: np.ndarray, batch_size: int, *, seed: int, epoch: int
) -> Iterable[np.ndarray]:
    """`batches` of `ids`; for a table streamed from disk the same batches one at a time from
    an order kept in a file of its row cache (`rowarrays.shuffled_batches`), so an epoch keeps
    nothing per row in memory."""
    if not getattr(table, "streamed", False):
        return batches(ids, batch_size, seed=seed, epoch=epoch)
    from securevfl.data.rowarrays import shuffled_batches

    arrays = table.rowstore.arrays()
    return shuffled_batches(ids, batch_size, seed=seed, epoch=epoch, arrays=arrays)
