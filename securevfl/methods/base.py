"""The method interface: what every VFL method provides, and the registry that finds it.

A method is two stages that never share memory:

* `PartyMethod` runs inside a passive party's process and sees only that party's table. It answers
  operations (``op``) the active party asks for, on the rows the active party names, and returns
  named tensors; the role wraps each tensor that feeds a secure sum before it leaves the process.
* `ActiveMethod` runs inside the active party's process (labels, optionally its own columns) and
  drives training through an `ActiveContext`, whose `call` returns *decoded secure sums* only.

Methods never know which secure-sum backend (plain, mask, ckks) or transport carries them.
"""

from __future__ import annotations

import fnmatch
import importlib
import logging
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import numpy as np

from securevfl.methods.options import NoOptions, parse_options

logger = logging.getLogger(__name__)

#: bits of the seed a passive party draws for its initial weights (`PartyMethod.init_seed`)
INIT_SEED_BITS = 256

if TYPE_CHECKING:
    import torch

    from securevfl.config import RunConfig
    from securevfl.data.table import ActiveTable, PartyTable


@dataclass(frozen=True)
class SumSpec:
    """One secure sum the active party asks for: every member of `group` contributes its tensor
    named `tensor`; the active party receives the sum under the name `key`."""

    key: str
    tensor: str
    group: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "group", tuple(sorted(self.group)))
        if len(set(self.group)) != len(self.group):
            raise ValueError(f"sum {self.key!r} lists a contributor twice: {self.group}")


class ActiveContext(Protocol):
    """What an `ActiveMethod` may do: ask parties for operations and secure sums, release
    gradients (through label DP when configured) and mark epochs (checkpoints)."""

    config: RunConfig
    start_epoch: int
    round: int  # the round of the last call sent

    @property
    def parties(self) -> tuple[str, ...]:
        """Passive parties still in the federation."""
        ...

    def call(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any] | None = None,
        inputs: Mapping[str, np.ndarray] | None = None,
        sums: Sequence[SumSpec] = (),
        to: Sequence[str] | None = None,
        collect: Sequence[str] = (),
    ) -> dict[str, np.ndarray]:
        """Run `op` at parties `to` (default: every party in a sum's group, else all) on rows
        `ids`; return the decoded sum of each `SumSpec`, keyed by `SumSpec.key`.

        `collect` names tensors each party sends to the active party *in the clear* (returned
        as ``"name@party"``): only for things the active party may know (e.g. row counts)."""
        ...

    def post(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any] | None = None,
        inputs: Mapping[str, np.ndarray] | None = None,
        sums: Sequence[SumSpec] = (),
        to: Sequence[str] | None = None,
        collect: Sequence[str] = (),
    ) -> Any:
        """Send a call as `call` does without waiting for its result: returns a ticket (its
        `round` is the call's round) for `wait`. With [network] pipeline_depth > 0 a method
        that declares `MethodSpec.tolerates_staleness` keeps several forwards in flight."""
        ...

    def wait(self, ticket: Any) -> dict[str, np.ndarray]:
        """The result of a posted call (what `call` returns), after the results of the updates
        posted before it; raises as `call` does."""
        ...

    def presence(self, ids: np.ndarray) -> np.ndarray:
        """Boolean [len(ids), len(all parties)]: which party holds which row (learnt at set-up,
        as after a private set intersection). Columns follow `config.party_names`."""
        ...

    def sum_allowed(self, group: Sequence[str]) -> bool:
        """Whether a secure sum over `group` may be asked for (the min_group rule: at least
        `min_group` passive parties in secure modes). Ask only for allowed sums."""
        ...

    def return_gradients(
        self,
        grads: Mapping[tuple[str, ...], Mapping[str, np.ndarray]],
        *,
        ids: np.ndarray,
        epoch: int,
        op: str = "backward",
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """Send gradients of a batch-mean loss (as autograd gives them) to the parties (`args`:
        the update call's arguments, e.g. which forward it belongs to):
        ``grads[group][tensor]`` to every party of `group`, one call per group. The context owns
        the batch-size convention and label DP (rows scaled to per-sample gradients, clipped
        jointly, noised, scaled back); a party lost meanwhile is skipped."""
        ...

    def release_gradients(
        self, grads: Mapping[str, np.ndarray], *, epoch: int, ids: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """Apply label DP (if configured) to per-sample values about to leave the active party,
        and record the release in the ledger (`return_gradients` does this for gradients; use
        this for other label-derived values a method sends, all of one step in one call).
        Pass the rows' sample ``ids`` so that each row's uses are counted exactly."""
        ...

    def epoch_done(self, epoch: int, *, stats: Mapping[str, float]) -> None:
        """Commit an epoch: every role writes its checkpoint; progress is reported."""
        ...

    def log(self, message: str) -> None: ...


class PartyMethod(ABC):
    """Passive-party stage of a method. Sees only its own table."""

    # the round of the call being handled (the role sets it before `check_call` and `handle`):
    # a method that keeps state between calls (split-NN's training forwards) keys it by round
    call_round: int = -1

    def __init__(
        self, *, name: str, table: PartyTable, config: RunConfig, device: torch.device
    ) -> None:
        self.name = name
        self.table = table
        self.config = config
        self.device = device

    def setup(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        """Prepare for training (the active party sends e.g. the training row ids)."""
        del args, inputs  # optional hook

    def init_seed(self) -> int:
        """The seed this party's initial weights are drawn from (its models built at set-up
        derive theirs from it, `derived_seed(self.init_seed(), ...)`): 256 bits from the OS
        CSPRNG, drawn once per process and told to nobody. Weights drawn from the config's
        `[run] seed` are known to every role that holds the config: the active party could
        then rebuild the party's first model and invert the first sums it receives (a linear
        encoder wider than the party's columns gives its rows back), and, knowing those rows
        and the gradients it sent, follow the model through training. A resumed run loads its
        weights from the checkpoint, so it needs no seed. `[run] shared_init = true` (tests
        and benchmarks that compare against a model built from the config) uses `[run] seed`
        instead and records in the ledger that the initial model protects nothing."""
        seed = getattr(self, "_init_seed", None)
        if seed is not None:
            return seed
        if not getattr(self.config, "shared_init", False):
            seed = secrets.randbits(INIT_SEED_BITS)
        else:
            seed = int(self.config.seed)
            reason = (
                f"[run] shared_init = true: {self.name}'s initial weights are drawn from "
                f"[run] seed = {seed}, which every role holds, so the active party can rebuild "
                "its first model and invert what it sends before training has moved it (for "
                "tests and benchmarks that compare against a model built from the config)"
            )
            self.record_config_seed(what=f"{self.name} initial model", reason=reason)
        self._init_seed = seed
        return seed

    def record_config_seed(self, *, what: str, reason: str) -> None:
        """Say (log, and ledger once the role's privacy is attached) that `what` is drawn
        from a seed in the config and so protects nothing (`config_seeds`)."""
        logger.warning("%s: %s", self.name, reason)
        privacy = getattr(self, "privacy", None)
        if privacy is not None:
            privacy.record_unprotected_once(what=what, reason=reason)

    @abstractmethod
    def handle(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any],
        inputs: Mapping[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """Run `op` on rows `ids`; return named tensors (contributions to secure sums).

        Raises `UnknownOperation` for an op this method does not implement."""

    def check_call(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any],
        inputs: Mapping[str, np.ndarray],
        groups: Sequence[tuple[str, ...]],
    ) -> str | None:
        """The method's own rule on a call the guard accepted (`groups`: the groups of the sums
        this party contributes to), checked before anything is computed: a reason to refuse
        (the party refuses as for any policy rule, rule "method"), or None. E.g. a method whose
        parties contribute 0 on rows they lack checks that each row keeps `min_group` real
        contributors."""
        del op, ids, args, inputs, groups
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        del state

    def version_state(self) -> Mapping[str, Any] | None:
        """What this party's released values are a function of besides its data, for a model
        not held in torch modules (VFEM's and ridge's coefficients): name -> array or number.
        The party's differencing rule (README, rule 5) keys every sum by this version, so
        leave out what an update may change without changing what the party sends (counters,
        step sizes, moments used only for rows it lacks): a no-op update must keep the
        version. None (the default): the version is the digest of the torch modules the
        method holds; a method with neither keeps one version for the whole session (it then
        refuses more, never less)."""
        return None


class ActiveMethod(ABC):
    """Active-party stage of a method: holds the labels and drives training."""

    def __init__(self, *, table: ActiveTable, config: RunConfig, device: torch.device) -> None:
        self.table = table
        self.config = config
        self.device = device

    @abstractmethod
    def fit(self, ctx: ActiveContext, *, train_ids: np.ndarray) -> None:
        """Train from epoch `ctx.start_epoch` to the configured number of epochs."""

    @abstractmethod
    def evaluate(self, ctx: ActiveContext, *, ids: np.ndarray) -> dict[str, Any]:
        """Metrics on rows `ids` (held out), computed through secure sums."""

    def predict(self, ctx: ActiveContext, *, ids: np.ndarray) -> np.ndarray:
        """The trained model's outputs on rows `ids` ([n] or [n, C]: a logit, class scores,
        a class or a value, as the method defines), through secure sums."""
        raise NotImplementedError(
            f"method {self.config.method!r} cannot score new rows yet (no predict)"
        )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        del state

    def summary(self) -> dict[str, Any]:
        """Extra entries for metrics.json (e.g. coefficients of a statistical method)."""
        return {}

    def report(self, run_dir: Path, out: IO[str]) -> None:
        """Write extra outputs (tables, CSV files) after evaluation. Optional."""
        del run_dir, out

    # how progress lines count (EM iterates to convergence: "iteration 12", no total)
    progress_unit: str = "epoch"

    @property
    def progress_total(self) -> int | None:
        return self.config.epochs

    # A method that can go on without a party that died sets this; others stop cleanly with a
    # resumable checkpoint when a party is lost.
    tolerates_dropout: bool = False


class PartyDropped(RuntimeError):
    """Raised by `ActiveContext.call` when a party stopped answering mid-round and the method
    tolerates dropouts: the party is gone from `ctx.parties`; re-run the step with the survivors
    (a new round, so fresh masks).

    `delivered` says whether the call reached the other recipients (the party died while they
    were answering) or nobody (the party was already known lost): an update such as a backward
    pass must be re-sent to the survivors only when it was not delivered, or they apply it
    twice."""

    def __init__(self, party: str, *, delivered: bool = False) -> None:
        super().__init__(f"party {party!r} was lost; continuing without it")
        self.party = party
        self.delivered = delivered


class UnknownOperation(ValueError):
    def __init__(self, method: str, op: str) -> None:
        super().__init__(f"method {method!r} has no party operation {op!r}")


@dataclass(frozen=True)
class Release:
    """What one tensor a party operation returns may do once it leaves the party.

    ``to = "sum"``: only inside a secure sum over the call's group (never alone);
    ``to = "clear"``: to the active party in the clear (a party's release policy must allow it
    by name, ``op.tensor``). `tensor` may be a pattern (``rep_*``). ``per_row``: the tensor's
    first axis is the call's rows, so embedding DP can clip it per row."""

    tensor: str
    to: str = "sum"
    why: str = ""
    per_row: bool = True

    def __post_init__(self) -> None:
        if self.to not in ("sum", "clear"):
            raise ValueError(f"release of {self.tensor!r}: to must be 'sum' or 'clear'")

    def matches(self, tensor: str) -> bool:
        return fnmatch.fnmatchcase(tensor, self.tensor)


#: The bound on a party representation's values that the methods summing representations
#: (split-NN and the block methods) declare for their CKKS sums (``[secure] ckks.magnitude``
#: unless the config sets it; a CKKS party refuses a contribution beyond what the parameters
#: sized from it hold, `securevfl.secure_sum.CkksParty`): about 40x the largest value seen
#: training split-NN on Credit at 10x the default learning rate (108; 23 at the default), and
#: one data prime for sums of up to 8 parties and the active party.
REPRESENTATION_MAGNITUDE = 4096.0
#: The fixed-point bits after the point of those methods' masked sums (``[secure] frac_bits``
#: unless the config sets it), with ``[secure] bound`` = `REPRESENTATION_MAGNITUDE`: 28 bits a
#: value, so a representation sum of up to 7 contributions travels in the 32-bit ring
#: (`crypto.fixedpoint.FixedPointEncoder.ring_dtype`: half the bytes of Z_2^64) at a
#: resolution of 2**-16 (the CKKS release keeps 12 bits, `[secure] ckks.precision_bits`).
REPRESENTATION_FRAC_BITS = 16
REPRESENTATION_SECURE_DEFAULTS = (
    ("ckks.magnitude", REPRESENTATION_MAGNITUDE),
    ("bound", REPRESENTATION_MAGNITUDE),
    ("frac_bits", REPRESENTATION_FRAC_BITS),
)


@dataclass(frozen=True)
class Operation:
    """A party operation a method may call: what it does, what it may release, which tensors
    the active party may send with it (`inputs`, patterns), and whether it changes the party's
    model (`updates`: sums of the same rows after it are of a new model version)."""

    name: str
    doc: str
    releases: tuple[Release, ...] = ()
    inputs: tuple[str, ...] = ()
    updates: bool = False

    def release_of(self, tensor: str) -> Release | None:
        return next((r for r in self.releases if r.matches(tensor)), None)

    def accepts_input(self, tensor: str) -> bool:
        return any(fnmatch.fnmatchcase(tensor, p) for p in self.inputs)


def _resolve(ref: str | type, what: str) -> type:
    """A class given directly, or as ``"module:Class"`` (imported on first use, so that reading
    a method's declaration never imports its model code)."""
    if isinstance(ref, type):
        return ref
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ValueError(f"{what} {ref!r} must be a class or 'package.module:Class'")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class MethodSpec:
    """A method's declaration: everything the engine reads about it.

    `active` and `party` are its two stages (classes, or ``"module:Class"`` references imported
    on first use); `operations` the party operations it may call, with what each releases (the
    party checks every call against them); `options` its ``[method]`` options class
    (`securevfl.methods.options`); `checks` functions ``(cfg, options)`` raising `ConfigError`
    for settings the method cannot run with. `dp_sgd` says where DP-SGD may be configured
    ("parties": the party models, "active": the active party's trainable part);
    `secure_defaults` gives ``[secure]`` defaults (e.g. more fractional bits, or
    ``ckks.magnitude``: the bound on its sums' values that CKKS parameters are sized from);
    `tolerates_dropout`: the method goes on without a party that died; `example` builds a small
    federation for the conformance suite every method is held to. `encodings` are the ways its
    party models take categorical columns (``"onehot"``, ``"embedding"``: codes embedded by
    `securevfl.methods.blocks.embedding`), the first being its default (``categorical =
    "auto"``); a method whose model needs one input column per category declares one-hot only,
    and asking it for embeddings fails at config load."""

    name: str
    active: str | type
    party: str | type
    operations: tuple[Operation, ...] = ()
    options: type = NoOptions
    tasks: tuple[str, ...] = ("binary", "multiclass", "regression")
    runs_on_sums: bool = True
    description: str = ""
    checks: tuple[Callable[[Any, Any], None], ...] = ()
    secure_defaults: tuple[tuple[str, float], ...] = ()
    dp_sgd: tuple[str, ...] = ()
    tolerates_dropout: bool = False
    # a party that misses a round's deadline (alive, slow) misses that round only and stays in
    # the run (`securevfl.roles.rounds.readmits_late`; needs `tolerates_dropout`)
    readmits_late: bool = False
    # trains on training rows without a label too (with [missing] labeled; otherwise the
    # active party leaves them out of `fit`)
    uses_unlabeled: bool = False
    # trains on rows that no passive party holds (the label and the active party's own columns
    # only): a method that models missing blocks (VFEM) uses them, the others drop them
    uses_unheld_rows: bool = False
    # how its party (and active) models take categorical columns; the first is the default
    encodings: tuple[str, ...] = ("onehot",)
    # (update op, next op) pairs that may share one envelope ([network] fuse_rounds): the
    # update of batch t (answered by an acknowledgement only) rides ahead of the next op of
    # batch t+1 to the same parties, which run them in order, so results are unchanged
    fuse: tuple[tuple[str, str], ...] = ()
    # the method trains correctly when a party's forward of batch t+k is computed before the
    # updates of batches t..t+k-1 reached it ([network] pipeline_depth = k > 0); its party
    # keeps each training forward keyed by round and its update names that round
    tolerates_staleness: bool = False
    # a small federation to run the method on (`securevfl.methods.examples`): writes its data
    # into a folder and returns the raw config; the shared conformance suite runs it
    example: Callable[[Path], dict[str, Any]] | None = None

    def active_class(self) -> type[ActiveMethod]:
        return _resolve(self.active, f"method {self.name!r}: active stage")

    def party_class(self) -> type[PartyMethod]:
        return _resolve(self.party, f"method {self.name!r}: party stage")

    def operation(self, name: str) -> Operation | None:
        return next((op for op in self.operations if op.name == name), None)

    def parse_options(self, raw: Mapping[str, Any]) -> Any:
        return parse_options(self.options, raw, method=self.name)

    def validate_config(self, cfg: RunConfig) -> None:
        from securevfl.errors import ConfigError

        if cfg.task not in self.tasks:
            raise ConfigError(
                "[data] task",
                f"method {self.name!r} supports tasks {', '.join(self.tasks)}, not {cfg.task!r}",
            )
        if not self.runs_on_sums and cfg.aggregation != "plain":
            raise ConfigError(
                "[run] aggregation",
                f"method {self.name!r} cannot run on sums, so {cfg.aggregation!r} cannot protect "
                'it; use aggregation = "plain" (see the README\'s threat model)',
            )
        for party in cfg.parties:
            if party.dp_sgd is not None and "parties" not in self.dp_sgd:
                raise ConfigError(
                    f"[parties.{party.name}] dp_sgd",
                    f"method {self.name!r} has no party model trained by SGD, so DP-SGD cannot "
                    "protect it; remove the key (embedding_dp protects what a party sends)",
                )
        if cfg.head_dp_sgd is not None and "active" not in self.dp_sgd:
            raise ConfigError(
                "[active] dp_sgd",
                f"method {self.name!r} does not support DP-SGD at the active party; remove the "
                "key ([privacy] label_dp protects the labels in what the parties receive)",
            )
        self._check_encodings(cfg)
        options = cfg.options if cfg.options is not None else self.parse_options({})
        for check in self.checks:
            check(cfg, options)

    def _check_encodings(self, cfg: RunConfig) -> None:
        """Refuses a role's `categorical` setting this method does not take, naming the role's
        declared categorical columns (the others are known once its data is read)."""
        from securevfl.config import categorical_setting
        from securevfl.errors import ConfigError

        roles = [(cfg.active_name, cfg.active_columns, cfg.active_types)] + [
            (p.name, p.columns, p.types) for p in cfg.parties
        ]
        for role, columns, types in roles:
            setting, key = categorical_setting(cfg, role)
            if not columns or setting == "auto" or setting in self.encodings:
                continue
            declared = [c for c, kind in types if kind == "categorical"]
            which = (
                f"column{'s' if len(declared) > 1 else ''} {', '.join(map(repr, declared))}"
                if declared
                else f"the categorical columns among {', '.join(map(repr, columns))}"
            )
            raise ConfigError(
                key,
                f"method {self.name!r} takes categorical columns as "
                f"{' or '.join(self.encodings)} only (its model needs one input column per "
                f"category), so {role!r} cannot encode {which} as {setting!r}; remove the key "
                f'or set categorical = "{self.encodings[0]}"',
            )


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method to the registry (built-in modules are found by `securevfl.methods`; third
    parties use the ``securevfl.methods`` entry-point group, or call this)."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"method {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def registry() -> Mapping[str, MethodSpec]:
    return _REGISTRY
