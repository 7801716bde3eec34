"""FALSE-VFL (Hong, Park & Hwang, arXiv 2505.11035) on secure sums: a deep latent-variable model
``z -> h -> x^k`` over the parties that hold a row, trained on every training row (labeled or not,
aligned or not), with a discriminator ``y | h`` trained on the labeled rows.

Every cross-party quantity is a secure sum; each row's sum holds the data of the parties present
in that row only. `batching = "pattern"` (default): pattern-homogeneous batches, each summed
over exactly the parties holding its rows (a party is called only on rows it holds);
`batching = "mixed"` (opt-in, faster): one call per batch of rows of any presence, summed over
every party, a party adding exact zeros on the rows it lacks (the call carries the presence,
which every party checks against what it holds, with min_group present parties per row; every
party sees the ids, presence and h of every row of the batch).

* ``encode``: each present party's Gaussian expert of q(h | x^k), summed: ``prec_mu`` and
  ``prec`` (or ``mu`` and ``prec`` under ``aggregation = "mean"``), each [n, d_h];
* the active party draws h ~ q(h | x^obs) [n, S, d_h] from those sums and sends it to the group;
* ``decode``: ``loglik`` [n, S] = sum_k log p(x^k | h) (FALSE-VFL-II: over every party, with the
  mask log-likelihoods) and, in stage 1, ``dloglik_dh`` [n, S, d_h];
* ``backward`` (stage 1): d loss / d each sum a party contributed to; the party steps.

Stage 2 (the discriminator, on labeled rows) and prediction send parties nothing but h. The model
is `model.py`, the stages `party.py` and `active.py`; see docs/false-vfl.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from securevfl.errors import ConfigError
from securevfl.methods import examples
from securevfl.methods.base import MethodSpec, Operation, Release
from securevfl.methods.blocks.options import CLASSIFICATION
from securevfl.methods.options import option

VARIANTS = ("mar", "mnar")
AGGREGATIONS = ("poe", "mean")
BATCHINGS = ("mixed", "pattern")


@dataclass(frozen=True)
class FalseVFLOptions:
    variant: str = option(
        "mar",
        "mar: FALSE-VFL-I (MAR, MCAR included); mnar: FALSE-VFL-II (a per-party self-masking "
        "model p(m^k | x^k) in the bound; every party takes part in every likelihood sum)",
        choices=VARIANTS,
    )
    aggregation: str = option(
        "poe",
        "posterior over the present parties: poe = product of their Gaussian experts and the "
        "N(0, I) prior; mean = the paper's Eq. (1) (average of the means, summed precisions)",
        choices=AGGREGATIONS,
    )
    d_h: int = option(
        32, "dimension of the latent h (what the sums carry)", minimum=1, maximum=4096
    )
    d_z: int = option(16, "dimension of the top latent z", minimum=1, maximum=4096)
    hidden: tuple[int, ...] = option(
        (128, 128), "hidden widths of the party and global encoders/decoders", minimum=1
    )
    mask_hidden: tuple[int, ...] = option(
        (64, 64), "hidden widths of each party's mask model (variant mnar)", minimum=1
    )
    disc_hidden: tuple[int, ...] = option(
        (128,), "hidden widths of the discriminator p(y | h)", minimum=1
    )
    kappa: int = option(
        10, "importance samples in the training bounds (the paper's kappa)", minimum=1, maximum=1000
    )
    n_predict: int = option(
        50, "importance samples at prediction (the paper's L)", minimum=1, maximum=10000
    )
    stage1_epochs: int = option(
        30, "stage 1: epochs of the marginal bound on every training row", minimum=0
    )
    stage2_epochs: int = option(
        30, "stage 2: epochs of the conditional bound on the labeled rows", minimum=0
    )
    stage1_lr: float = option(
        1e-3, "stage 1 Adam learning rate", minimum=0.0, exclusive_minimum=True
    )
    stage2_lr: float = option(
        1e-3, "stage 2 Adam learning rate", minimum=0.0, exclusive_minimum=True
    )
    weight_decay: float = option(1e-4, "Adam weight decay of every model", minimum=0.0)
    stage1_batch: int = option(256, "stage 1 batch size", minimum=1)
    stage2_batch: int = option(64, "stage 2 batch size", minimum=1)
    batching: str = option(
        "pattern",
        "pattern: one call per presence pattern, over the parties holding its rows (a party is "
        "called only on rows it holds and, mar, sees h only of those; many small calls); "
        "mixed: one call per batch of rows with any present parties, over every party (a party "
        "adds exact zeros on rows it lacks; every party then sees the ids, presence and h of "
        "every row of the batch, also rows it lacks: faster, and reveals to each party which "
        "rows the others hold)",
        choices=BATCHINGS,
    )


_WHY_POSTERIOR = (
    "a party's Gaussian expert of q(h | x^k) per row: only inside the sum over the parties "
    "holding the rows"
)
_WHY_LOGLIK = "a party's log-likelihood per row and sample of h: only inside the sum over the group"

OPERATIONS = (
    Operation(
        "encode",
        "this party's expert of the posterior on rows `ids`: precision-weighted mean and "
        "precision (mean and precision under aggregation = mean), exact zeros on the rows input "
        "`present` marks it absent on (without `present`: rows it must all hold); a training "
        "encode is kept for the backward",
        releases=(
            Release("prec_mu", why=_WHY_POSTERIOR),
            Release("mu", why=_WHY_POSTERIOR),
            Release("prec", why=_WHY_POSTERIOR),
        ),
        inputs=("present",),
    ),
    Operation(
        "decode",
        "log p(x^k | h) per row and sample of the input h (variant mnar: plus the mask "
        "log-likelihood, also on rows the party lacks; mar: exact zeros on rows it lacks); in "
        "training also its gradient in h",
        releases=(
            Release("loglik", why=_WHY_LOGLIK),
            Release("dloglik_dh", why=_WHY_LOGLIK + " (its gradient in h)"),
        ),
        inputs=("h", "present"),
    ),
    Operation(
        "backward",
        "d loss / d the sums this party contributed to in the last training encode and decode; "
        "the party steps its models",
        inputs=("d_prec_mu", "d_mu", "d_prec", "d_loglik"),
        updates=True,
    ),
)


def check_false_vfl(cfg: Any, opts: FalseVFLOptions) -> None:
    """Refuses columns at the active party (every block is a passive party's, as the
    missingness generators draw them)."""
    if cfg.active_columns:
        raise ConfigError(
            "[active] columns",
            "false-vfl models the blocks of passive parties only (the missingness generators "
            "draw passive blocks); give these columns to a passive party of their own",
        )


def example(directory: Path) -> dict[str, Any]:
    """The conformance suite's federation: three passive blocks, MCAR 0.2, a tiny model."""
    raw = examples.classification(directory, method="false-vfl", p_missing=0.2)
    raw["method"] = {
        "d_h": 4,
        "d_z": 2,
        "hidden": [8],
        "mask_hidden": [8],
        "disc_hidden": [8],
        "kappa": 3,
        "n_predict": 8,
        "stage1_epochs": 1,
        "stage2_epochs": 1,
        "stage1_batch": 32,
        "stage2_batch": 32,
        "stage1_lr": 0.01,
        "stage2_lr": 0.01,
    }
    return raw


SPEC = MethodSpec(
    name="false-vfl",
    active="securevfl.methods.false_vfl.active:FalseVFLActiveMethod",
    party="securevfl.methods.false_vfl.party:FalseVFLPartyMethod",
    operations=OPERATIONS,
    options=FalseVFLOptions,
    tasks=CLASSIFICATION,
    uses_unlabeled=True,
    description="FALSE-VFL: a latent-variable model over any present parties, trained on "
    "unlabeled and unaligned rows too (variant mar or mnar; poe or mean posterior)",
    checks=(check_false_vfl,),
    example=example,
)
