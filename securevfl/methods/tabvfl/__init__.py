"""TabVFL and TabVFL-LE: TabNet's pretraining autoencoder split across guests (the passive
parties) and the host (the active party, labels only), as Rashad et al., "TabVFL: Improving
Latent Representation in Vertical Federated Learning" (SRDS 2024); notes
shared/methods/tabvfl.md; docs/tabvfl.md.

* ``tabvfl``: each guest runs BN + a secret FC layer (d_k -> d_k; drawn from the guest's own
  OS-random seed, which no other role holds: `.party`) on its columns and sends the result h_k
  **in the clear** to the host, which runs TabNet's encoder and decoder over the concatenation;
  TabNet's attention selects per column, so the host needs each guest's columns, not a sum
  over guests: it cannot run on secure sums (``mask``/``ckks`` are refused, pointing to
  tabvfl-le), and every guest's release policy must name its clear releases
  (`TABVFL_CLEAR`). The host keeps each guest's latest output per batch position and serves an
  offline guest from it (simulated failures, ``failure_p``; a guest lost for good).
* ``tabvfl-le``: each guest runs a complete TabNet encoder; the host needs the step outputs
  and the latents only summed over the guests, so everything a guest sends is a secure sum
  (plain, mask or ckks).

Both pretrain with TabNet's masked-reconstruction objective, fine-tune with the sparsity
regulariser, stop early on a validation split carved from the training rows, and report the
paper's latent evaluation (downstream classifiers on the latents) in metrics.json. The LT and
CT baselines run in one process (`securevfl.methods.tabvfl.baselines`, bench/tabvfl.py).

This module declares; the stages live in `.party` and `.active`, the model in `.tabnet`,
`.split` (imported on first use, never at registry time).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from securevfl.errors import ConfigError
from securevfl.methods import examples
from securevfl.methods.base import MethodSpec, Operation, Release
from securevfl.methods.options import option

CLASSIFIERS = ("logistic", "tree", "forest", "mlp", "svm", "xgboost")
DEFAULT_CLASSIFIERS = ("logistic", "tree", "forest", "mlp", "svm")


@dataclass(frozen=True)
class TabNetOptions:
    """The `[method]` options of tabvfl-le (tabvfl adds the failure options). Batch size,
    learning rate, weight decay, optimizer and the most fine-tuning epochs are ``[train]``'s."""

    n_d: int = option(5, "latent width (tabvfl: at least the number of guests)", minimum=1)
    n_a: int = option(2, "attention width", minimum=1, maximum=1024)
    n_steps: int = option(4, "TabNet decision steps", minimum=1, maximum=32)
    gamma: float = option(1.5, "relaxation: how freely steps reuse a column", minimum=1.0)
    lambda_sparse: float = option(
        1e-4, "weight of the attention-entropy (sparsity) term in fine-tuning", minimum=0.0
    )
    pretraining_ratio: float = option(
        0.5,
        "share of entries each guest hides in pretraining",
        minimum=0.0,
        maximum=1.0,
        exclusive_minimum=True,
        exclusive_maximum=True,
    )
    virtual_batch_size: int = option(128, "ghost batch norm chunk (rows)", minimum=2)
    momentum: float = option(
        0.02, "ghost batch norm momentum", minimum=0.0, maximum=1.0, exclusive_minimum=True
    )
    mask_type: str = option(
        "sparsemax", "attention map: sparsemax or 1.5-entmax", choices=("sparsemax", "entmax")
    )
    pretrain_epochs: int = option(
        50, "most pretraining epochs ([train] epochs: the most fine-tuning epochs)", minimum=0
    )
    patience: int = option(
        10,
        "end a phase after this many epochs without a better validation score (0: no early "
        "stopping and no validation split)",
        minimum=0,
    )
    valid_fraction: float = option(
        0.15,
        "share of the training rows held out (stratified) for early stopping",
        minimum=0.0,
        maximum=0.5,
        exclusive_minimum=True,
    )
    restore_best: bool = option(True, "end each phase with its best validation epoch's weights")
    latent_classifiers: tuple[str, ...] = option(
        DEFAULT_CLASSIFIERS,
        "downstream classifiers of the latent evaluation (the paper's six, xgboost if installed)",
        choices=CLASSIFIERS,
    )
    guest_seed: int | None = option(
        None,
        "TESTS ONLY, NOT PRIVATE: draw every guest's weights (tabvfl: its secret FC layer) and "
        "masks from this number, not from the guest's own OS-random seed, so that two runs "
        "compare; whoever has the config then rebuilds each guest's model, and each guest "
        "records that in the ledger",
        minimum=0,
    )


@dataclass(frozen=True)
class TabVFLOptions(TabNetOptions):
    failure_p: float = option(
        0.0,
        "simulated failures: each guest is offline for a whole epoch with this probability "
        "(from each phase's second epoch)",
        minimum=0.0,
        maximum=1.0,
        exclusive_maximum=True,
    )
    failure_fill: str = option(
        "cache",
        "what stands in for an offline guest: its latest output at the same batch position "
        "(cache) or zeros",
        choices=("cache", "zeros"),
    )


H_WHY = (
    "the guest's per-feature output FC_k(BN_k(x_k)) per row: TabNet's attention selects per "
    "column, so the host needs each guest's own columns, not a sum; protected only by the "
    "secret FC layer (drawn from the guest's own OS-random seed: a linear map with no formal "
    "guarantee) and embedding DP when configured, not by a secure sum"
)
# L_k and dL_k/dr_k leave as computed: the guest's embedding DP noises h only
NOT_NOISED = (
    "sent without noise: embedding DP, when configured, noises h only, so its epsilon does "
    "not cover this release (no formal guarantee)"
)

OPERATIONS = (
    Operation(
        "pretrain_forward",
        "mask this guest's columns (its own Bernoulli draw) and return h_k = FC_k(BN_k(masked "
        "x_k)) and the mask on rows `ids` (train: kept for the backward)",
        releases=(
            Release("h", to="clear", why=H_WHY),
            Release(
                "prior",
                to="clear",
                why="1 - obf_k per row: which entries the guest hid (its random draw, "
                "independent of the data); the host's attention prior",
            ),
        ),
    ),
    Operation(
        "pretrain_reconstruct",
        "reconstruct x_k from the decoder slice r_k; the guest's loss L_k and dL_k/dr_k",
        inputs=("r",),
        releases=(
            Release(
                "loss",
                to="clear",
                why="L_k, the guest's reconstruction loss of the batch (one number), " + NOT_NOISED,
                per_row=False,
            ),
            Release(
                "grad_r",
                to="clear",
                why="dL_k/dr_k per row, a function of the guest's own columns on the entries "
                "it hid (the host backpropagates it through its decoder), " + NOT_NOISED,
            ),
        ),
    ),
    Operation(
        "pretrain_backward",
        "dL/dh_k of the last pretraining forward; the guest steps BN_k, FC_k and Rec_k",
        inputs=("grad",),
        updates=True,
    ),
    Operation(
        "forward",
        "h_k = FC_k(BN_k(x_k)) on rows `ids`, no masking (train: kept for the backward)",
        releases=(Release("h", to="clear", why=H_WHY),),
    ),
    Operation(
        "backward",
        "dL/dh_k of the last training forward (label-derived); the guest steps BN_k and FC_k",
        inputs=("grad",),
        updates=True,
    ),
    Operation("keep_best", "remember the current bottom model as this phase's best"),
    Operation("restore_best", "go back to this phase's best bottom model", updates=True),
)

# what every guest's policy must allow in clear_releases to run tabvfl
TABVFL_CLEAR = tuple(
    f"{op.name}.{r.tensor}" for op in OPERATIONS for r in op.releases if r.to == "clear"
)

LE_OPERATIONS = (
    Operation(
        "pretrain_forward",
        "mask this guest's columns (its own draw; the mask stays here) and run its TabNet "
        "encoder on rows `ids`: the step outputs (train: kept for the backward)",
        releases=(
            Release(
                "steps",
                why="the n_steps step outputs (B, n_steps * n_d): only inside the step-wise "
                "sum over the guests",
            ),
        ),
    ),
    Operation(
        "pretrain_reconstruct",
        "reconstruct x_k from the decoder output r; per-row terms of L_k and dL_k/dr",
        inputs=("r",),
        releases=(
            Release("grad_r", why="B dL_k/dr per row: only inside the sum over the guests"),
            Release("loss_rows", why="per-row terms of L_k: only inside the sum over the guests"),
        ),
    ),
    Operation(
        "pretrain_backward",
        "dL/d(summed step outputs) of the last pretraining forward (the same for every "
        "guest); the guest steps its encoder and Rec_k",
        inputs=("grad",),
        updates=True,
    ),
    Operation(
        "forward",
        "this guest's latent z_k = sum of its step outputs on rows `ids` (train: kept)",
        releases=(Release("z", why="the guest's latent: only inside the sum over the guests"),),
    ),
    Operation(
        "backward",
        "dL/dz of the last training forward (label-derived, the same for every guest); the "
        "guest adds its own sparsity term and steps its encoder",
        inputs=("grad",),
        updates=True,
    ),
    Operation("keep_best", "remember the current encoder as this phase's best"),
    Operation("restore_best", "go back to this phase's best encoder", updates=True),
)


def check_tabnet(cfg: Any, opts: TabNetOptions) -> None:
    """Refuses what the split cannot run: active-party columns (the host holds labels only),
    tabvfl with n_d below the number of guests (each guest needs a decoder slice)."""
    if cfg.active_columns:
        raise ConfigError(
            "[active] columns",
            f"{cfg.method!r}: the host (active party) holds the labels only, as in the paper; "
            "give these columns to a passive party (a guest)",
        )
    if cfg.method == "tabvfl" and opts.n_d < len(cfg.parties):
        raise ConfigError(
            "[method] n_d",
            f"tabvfl cuts the decoder output into one slice per guest, so n_d must be at least "
            f"the number of guests ({len(cfg.parties)}), got {opts.n_d}",
        )


@dataclass(frozen=True)
class ClearReleaseSpec(MethodSpec):
    """A method that releases per-guest values in the clear: refuses secure aggregation with
    the reason and the alternative before the generic checks."""

    refusal: str = ""

    def validate_config(self, cfg: Any) -> None:
        if cfg.aggregation != "plain":
            raise ConfigError("[run] aggregation", self.refusal.format(agg=cfg.aggregation))
        super().validate_config(cfg)


TABVFL_REFUSAL = (
    "method 'tabvfl' sends each guest's per-feature outputs h_k (and its masks) to the host in "
    "the clear: TabNet's attention selects per column, so the host needs every guest's own "
    "columns and cannot work on a sum over guests, which is all {agg!r} could protect; use "
    "aggregation = \"plain\" (tabvfl's protection is the guests' secret FC layer and "
    'embedding DP), or method = "tabvfl-le", whose guest-side encoders send step outputs the '
    "host needs only summed (plain, mask or ckks)"
)


def tabvfl_example(directory: Path, *, method: str) -> dict[str, Any]:
    """The conformance example: three guests of two columns, one epoch per phase."""
    raw = examples.classification(directory, method=method)
    raw["train"] = {"epochs": 1, "batch_size": 32, "lr": 0.02}
    raw["method"] = {"pretrain_epochs": 1, "patience": 2, "latent_classifiers": ["logistic"]}
    if method == "tabvfl":
        raw["run"]["aggregation"] = "plain"
        raw["policy"] = {"aggregations": ["plain"], "clear_releases": list(TABVFL_CLEAR)}
    return raw


SPECS = [
    ClearReleaseSpec(
        name="tabvfl",
        active="securevfl.methods.tabvfl.active:TabVFLActive",
        party="securevfl.methods.tabvfl.party:TabVFLParty",
        operations=OPERATIONS,
        options=TabVFLOptions,
        tasks=("binary", "multiclass"),
        runs_on_sums=False,
        description="TabVFL: TabNet autoencoder split across guests and host (clear per-feature "
        "outputs), failure cache",
        checks=(check_tabnet,),
        tolerates_dropout=True,
        readmits_late=True,  # the failure cache serves a late guest for the rounds it misses
        example=partial(tabvfl_example, method="tabvfl"),
        refusal=TABVFL_REFUSAL,
    ),
    MethodSpec(
        name="tabvfl-le",
        active="securevfl.methods.tabvfl.le_active:LEActive",
        party="securevfl.methods.tabvfl.party:LEParty",
        operations=LE_OPERATIONS,
        options=TabNetOptions,
        tasks=("binary", "multiclass"),
        description="TabVFL-LE: guest-side TabNet encoders, step outputs on secure sums",
        checks=(check_tabnet,),
        example=partial(tabvfl_example, method="tabvfl-le"),
    ),
]
