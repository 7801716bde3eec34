"""Federation and run configuration: TOML in, a validated, frozen `RunConfig` out.

Everything a run needs is checked here, before any process starts: a bad value raises
`ConfigError` naming the key (``[section] key``) and what to do about it; the CLI turns it into
exit status 2.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from securevfl.errors import ConfigError

AGGREGATIONS = ("plain", "mask", "ckks")
TASKS = ("binary", "multiclass", "regression")
TRANSPORTS = ("zmq", "inproc")
DEVICES = ("cpu", "cuda")
OPTIMIZERS = ("adam", "sgd")
# how a role's categorical columns reach its model ("auto": the method's default, the first of
# its `MethodSpec.encodings`); `securevfl.data.columns.ENCODINGS` are the two encodings
CATEGORICAL = ("auto", "onehot", "embedding")
ROLE_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_-")
RESERVED_ROLE_NAMES = ("aggregator",)
# [network] pipeline_depth: each call in flight holds a batch at every party and the aggregator
MAX_PIPELINE_DEPTH = 64


@dataclass(frozen=True)
class ReleasePolicy:
    """What a passive party lets leave it, whatever the active party or the aggregator asks
    (`[policy]` for every party, `[parties.NAME.policy]` for one). The party enforces it on every
    call; the defaults release nothing in the clear and accept only secure aggregation."""

    methods: tuple[str, ...] | None = None  # None: any method
    aggregations: tuple[str, ...] = ("mask", "ckks")
    min_group: int = 2
    clear_releases: tuple[str, ...] = ()  # "op.tensor" patterns a method may release in clear
    share_presence: bool = True  # answer set-up with which rows it holds (what a PSI gives)
    # accept a run whose aggregator is a thread of the active party's process ([network]
    # aggregator_in_active; plain and mask only): the active party then sees every masked
    # contribution, which hides the party's value as well as a separate aggregator does
    aggregator_in_active: bool = True
    # accept a run in which the party draws what protects it from a seed in the config, which
    # every role holding the config knows (`config_seeds`: [run] shared_init, [privacy]
    # noise_seed with embedding DP, [method] guest_seed): for tests and benchmarks only
    config_seeds: bool = False
    on_refusal: str = "stop"  # "stop": stop cleanly; "skip": refuse the call, keep serving


@dataclass(frozen=True)
class PartyConfig:
    name: str
    columns: tuple[str, ...]
    embedding_dp: DPConfig | None = None
    dp_sgd: DPConfig | None = None
    max_epsilon: float | None = None
    policy: ReleasePolicy = field(default_factory=ReleasePolicy)
    # column -> numeric|boolean|categorical; columns not named are inferred from the data
    types: tuple[tuple[str, str], ...] = ()
    # onehot | embedding | auto for this party's categorical columns; None: [data] categorical
    categorical: str | None = None


@dataclass(frozen=True)
class DPConfig:
    """One Gaussian mechanism: either a noise multiplier or a target epsilon (calibrated later)."""

    clip: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None


@dataclass(frozen=True)
class CkksConfig:
    # None (default): sized to the sums (`securevfl.secure_sum.ckks_params`): the smallest
    # degree and chain giving `precision_bits` released bits for sums of every party's values up
    # to [secure] ckks.magnitude (default: the method's declared magnitude, e.g. 4096 for the
    # representation sums of split-NN and the block methods, else [secure] bound) at
    # `security_bits`; set all three to fix
    poly_modulus_degree: int | None = None
    coeff_mod_bit_sizes: tuple[int, ...] | None = None
    scale_bits: int | None = None
    # with fixed parameters: whether the chain's last prime is SEAL's special prime (default,
    # SEAL's layout) or every prime holds data (sums never key-switch; sized chains have none)
    special_prime: bool = True
    # decrypted sums are flooded (2^flood_bits x the error bound) and rounded (2^-precision_bits)
    precision_bits: int = 12
    flood_bits: int = 10
    security_bits: int = 128
    magnitude: float | None = None


@dataclass(frozen=True)
class MissingSpec:
    kind: str = "none"
    params: tuple[tuple[str, float], ...] = ()

    def get(self, key: str, default: float | None = None) -> float | None:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class RunConfig:
    # [run]
    method: str = "splitnn"
    aggregation: str = "mask"
    seed: int = 0
    device: str = "cpu"
    min_group: int = 2
    transport: str = "zmq"
    # compute threads of each role process (torch, BLAS, OpenMP); None: `securevfl.threads`
    # picks 1 when roles share the machine (`run`), else half the cores (at most 4)
    threads: int | None = None
    # roles started together on one machine (run, predict, demo) pinned one core each,
    # round-robin (`securevfl.threads`); false leaves their placement to the system
    pin_cores: bool = True
    # each passive party's initial weights from `seed` (tests and benchmarks that compare
    # against a model built from the config): whoever has the config then knows them; false,
    # the default, has each party draw its own seed from the OS (`PartyMethod.init_seed`)
    shared_init: bool = False
    # [data]
    data_path: Path = Path("data.csv")
    id_column: str = "ID"
    label: str = "Y"
    task: str = "binary"
    test_fraction: float = 0.2
    standardize: bool = True
    na_tokens: tuple[str, ...] = ("", "NA", "N/A", "NaN", "nan", "null", "NULL", "?")
    delimiter: str | None = None  # None: sniffed from the header line
    # [data] stream: None ("auto") streams role files over 256 MiB from a row cache on disk
    stream: bool | None = None
    positive: str | None = None  # binary task: the label value that is class 1
    # [data] categorical: every role's categorical columns (a role's own key overrides it)
    categorical: str = "auto"
    # which of the active party's ids each party holds, from `securevfl align` (presence.csv):
    # set-up then sends each party only the ids it shares with the label holder
    presence_path: Path | None = None
    # [active], [parties.*]
    active_name: str = "active"
    active_columns: tuple[str, ...] = ()
    active_types: tuple[tuple[str, str], ...] = ()  # column -> numeric|boolean|categorical
    active_categorical: str | None = None  # [active] categorical; None: [data] categorical
    parties: tuple[PartyConfig, ...] = ()
    # [train]
    epochs: int = 10
    batch_size: int = 256
    lr: float = 1e-3
    optimizer: str = "adam"
    weight_decay: float = 0.0
    # [model]
    hidden: tuple[int, ...] = (64,)
    width: int = 16
    head_hidden: tuple[int, ...] = ()
    # [model] embedding_dim: the width of each categorical column's embedding; None: the rule
    # min(16, round(1.6 * n ** 0.56)) of its n codes (`securevfl.methods.blocks.embedding`)
    embedding_dim: int | None = None
    # [secure]
    frac_bits: int = 20
    bound: float = 2.0**20
    ckks: CkksConfig = field(default_factory=CkksConfig)
    # [network]
    aggregator_address: str = "tcp://127.0.0.1:5555"
    bind_address: str | None = None
    keys_dir: Path = Path("keys")
    heartbeat_interval: float = 1.0
    peer_timeout: float = 10.0
    round_timeout: float = 120.0
    startup_timeout: float = 120.0
    aggregator_in_active: bool = False
    # a batch's update call rides in the envelope of the next batch's call to the same parties
    # when the method declares the pair (`MethodSpec.fuse`): one round trip per batch, not two
    fuse_rounds: bool = True
    # training forwards the active party keeps in flight beyond the one it waits for (methods
    # that declare `MethodSpec.tolerates_staleness` only); 0: one batch at a time, as before
    pipeline_depth: int = 0
    # [missing]
    missing_train: MissingSpec = field(default_factory=MissingSpec)
    missing_test: MissingSpec = field(default_factory=MissingSpec)
    # a labeled budget (FALSE-VFL's setting): only `labeled` training rows keep their label,
    # `aligned` of them held by every party; None: every training row is labeled
    labeled: int | None = None
    aligned: int = 0
    # [privacy]
    label_dp: DPConfig | None = None
    head_dp_sgd: DPConfig | None = None
    active_max_epsilon: float | None = None
    delta: float | None = None
    accountant: str = "rdp"
    record_received: bool = False
    # reproducible DP noise for tests: not private (the ledger says so)
    noise_seed: int | None = None
    # method-specific options: the [method] table as written, and the method's options object
    # parsed from it (`MethodSpec.options`, validated from the method's declaration)
    method_options: tuple[tuple[str, Any], ...] = ()
    options: Any = None
    # where the file was read from (relative paths are resolved against it)
    source: Path | None = None

    @property
    def party_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parties)

    @property
    def role_names(self) -> tuple[str, ...]:
        """Every role that connects to the aggregator: the active party first, then the passives."""
        return (self.active_name, *self.party_names)

    def party(self, name: str) -> PartyConfig:
        for p in self.parties:
            if p.name == name:
                return p
        raise KeyError(f"no passive party named {name!r}; the config has {list(self.party_names)}")


class _Defaults:
    """`RunConfig`'s field defaults, so that each default is written once (on the dataclass)."""

    def __getattr__(self, name: str) -> Any:
        f = RunConfig.__dataclass_fields__[name]
        return f.default_factory() if f.default_factory is not MISSING else f.default


D = _Defaults()


# --------------------------------------------------------------------------------------------
# Reading and validation


def env_switch(name: str, *, default: bool) -> bool:
    """An on/off environment variable: "1" on, "0" off, unset or empty `default`; any other
    value is a `ConfigError` naming the variable and its values."""
    import os

    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    raise ConfigError(name, f"is {value!r}; set 1 (on), 0 (off) or leave it unset")


def load_config(path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Read and validate a TOML config. Raises `ConfigError` (naming the key) on any problem.

    `overrides` maps dotted keys (``"run.aggregation"``) to values that replace the file's.
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8-sig")
        raw = tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError("config", f"file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError("config", f"{path} is a directory, not a TOML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "config", f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML ({exc}); fix the syntax") from None
    for dotted, value in (overrides or {}).items():
        section, sep, key = str(dotted).partition(".")
        if not sep or not section or not key:
            raise ConfigError("--set", f"expected SECTION.KEY=VALUE, got {dotted!r}")
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {dotted}", f"[{section}] is not a table in {path}")
        table[key] = value
    return parse_config(raw, source=path)


def parse_config(raw: Mapping[str, Any], *, source: Path | None = None) -> RunConfig:
    """Validate a config already parsed into dicts (the TOML structure)."""
    known_sections = {
        "run",
        "data",
        "active",
        "parties",
        "train",
        "model",
        "secure",
        "network",
        "missing",
        "privacy",
        "method",
        "policy",
    }
    for section in raw:
        if section not in known_sections:
            raise ConfigError(
                f"[{section}]", f"unknown section; known sections are {sorted(known_sections)}"
            )
    base = source.parent if source is not None else Path.cwd()
    r = _Section(
        raw,
        "run",
        {
            "method",
            "aggregation",
            "seed",
            "device",
            "min_group",
            "transport",
            "threads",
            "pin_cores",
            "shared_init",
        },
    )
    d = _Section(
        raw,
        "data",
        {
            "path",
            "id",
            "label",
            "task",
            "test_fraction",
            "standardize",
            "na",
            "delimiter",
            "stream",
            "positive",
            "presence",
            "categorical",
        },
    )
    a = _Section(
        raw, "active", {"name", "columns", "dp_sgd", "max_epsilon", "types", "categorical"}
    )
    t = _Section(raw, "train", {"epochs", "batch_size", "lr", "optimizer", "weight_decay"})
    m = _Section(raw, "model", {"hidden", "width", "head_hidden", "embedding_dim"})
    s = _Section(raw, "secure", {"frac_bits", "bound", "ckks"})
    n = _Section(
        raw,
        "network",
        {
            "aggregator",
            "bind",
            "keys",
            "heartbeat_interval",
            "peer_timeout",
            "round_timeout",
            "startup_timeout",
            "aggregator_in_active",
            "fuse_rounds",
            "pipeline_depth",
        },
    )
    mi = _Section(raw, "missing", {"train", "test", "labeled", "aligned"})
    p = _Section(
        raw,
        "privacy",
        {"label_dp", "delta", "accountant", "record_received", "max_epsilon", "noise_seed"},
    )

    from securevfl.methods import known_method, method_names, method_spec  # no torch

    method = r.values.get("method", D.method)
    if not isinstance(method, str) or not known_method(method):
        r.choice("method", D.method, method_names())  # refuses it, naming every method
    secure_defaults = dict(method_spec(method).secure_defaults)
    method_table = raw.get("method", {})
    if not isinstance(method_table, Mapping):
        raise ConfigError("[method]", f"must be a table, got {type(method_table).__name__}")
    aggregation = r.choice("aggregation", D.aggregation, AGGREGATIONS)
    cfg = RunConfig(
        method=method,
        aggregation=aggregation,
        seed=r.integer("seed", D.seed, minimum=0),
        device=r.choice("device", D.device, DEVICES),
        min_group=r.integer("min_group", D.min_group, minimum=1),
        transport=r.choice("transport", D.transport, TRANSPORTS),
        threads=(
            None if r.raw("threads") is None else r.integer("threads", 1, minimum=1, maximum=1024)
        ),
        pin_cores=r.boolean("pin_cores", D.pin_cores),
        shared_init=r.boolean("shared_init", D.shared_init),
        data_path=_resolve(base, d.string("path", None, required=True)),
        id_column=d.string("id", D.id_column),
        label=d.string("label", D.label),
        task=d.choice("task", D.task, TASKS),
        test_fraction=d.number("test_fraction", D.test_fraction, minimum=0.0, maximum=0.9),
        standardize=d.boolean("standardize", D.standardize),
        na_tokens=_na(d.raw("na")),
        delimiter=_delimiter(d.raw("delimiter")),
        stream=_stream(d.raw("stream")),
        positive=d.string("positive", None),
        categorical=d.choice("categorical", D.categorical, CATEGORICAL),
        presence_path=(
            None if d.raw("presence") is None else _resolve(base, d.string("presence", None))
        ),
        active_name=_role_name(a.string("name", D.active_name), "[active] name"),
        active_columns=a.string_list("columns", []),
        active_types=_types(a.raw("types"), "[active] types"),
        active_categorical=(
            None if a.raw("categorical") is None else a.choice("categorical", "auto", CATEGORICAL)
        ),
        parties=_parties(raw.get("parties"), _policy_table(raw.get("policy"), "[policy]")),
        epochs=t.integer("epochs", D.epochs, minimum=1),
        batch_size=t.integer("batch_size", D.batch_size, minimum=1),
        lr=t.number("lr", D.lr, minimum=0.0, exclusive_minimum=True),
        optimizer=t.choice("optimizer", D.optimizer, OPTIMIZERS),
        weight_decay=t.number("weight_decay", D.weight_decay, minimum=0.0),
        hidden=tuple(m.int_list("hidden", list(D.hidden), minimum=1)),
        width=m.integer("width", D.width, minimum=1),
        head_hidden=tuple(m.int_list("head_hidden", list(D.head_hidden), minimum=1)),
        embedding_dim=(
            None
            if m.raw("embedding_dim") is None
            else m.integer("embedding_dim", 1, minimum=1, maximum=1024)
        ),
        frac_bits=s.integer(
            "frac_bits", int(secure_defaults.get("frac_bits", D.frac_bits)), minimum=1, maximum=52
        ),
        bound=s.number(
            "bound",
            float(secure_defaults.get("bound", D.bound)),
            minimum=0.0,
            exclusive_minimum=True,
        ),
        ckks=_ckks(s.table("ckks", {}), magnitude=secure_defaults.get("ckks.magnitude")),
        aggregator_address=n.string("aggregator", D.aggregator_address),
        bind_address=n.string("bind", None),
        keys_dir=_resolve(base, n.string("keys", str(D.keys_dir))),
        heartbeat_interval=n.number("heartbeat_interval", D.heartbeat_interval, minimum=0.01),
        peer_timeout=n.number("peer_timeout", D.peer_timeout, minimum=0.1),
        round_timeout=n.number("round_timeout", D.round_timeout, minimum=0.1),
        startup_timeout=n.number("startup_timeout", D.startup_timeout, minimum=0.1),
        aggregator_in_active=n.boolean("aggregator_in_active", D.aggregator_in_active),
        fuse_rounds=n.boolean("fuse_rounds", D.fuse_rounds),
        pipeline_depth=n.integer(
            "pipeline_depth", D.pipeline_depth, minimum=0, maximum=MAX_PIPELINE_DEPTH
        ),
        missing_train=_missing(mi.raw("train"), "[missing] train"),
        missing_test=_missing(mi.raw("test"), "[missing] test"),
        labeled=None if mi.raw("labeled") is None else mi.integer("labeled", 0, minimum=1),
        aligned=mi.integer("aligned", 0, minimum=0),
        label_dp=_dp(p.raw("label_dp"), "[privacy] label_dp"),
        head_dp_sgd=_dp(a.raw("dp_sgd"), "[active] dp_sgd"),
        active_max_epsilon=_positive_or_none(a.raw("max_epsilon"), "[active] max_epsilon"),
        delta=_delta(p.raw("delta")),
        accountant=p.choice("accountant", D.accountant, ("rdp", "prv")),
        record_received=p.boolean("record_received", D.record_received),
        noise_seed=(None if p.raw("noise_seed") is None else p.integer("noise_seed", 0, minimum=0)),
        method_options=tuple(sorted(method_table.items())),
        options=method_spec(method).parse_options(method_table),
        source=source,
    )
    if p.raw("max_epsilon") is not None:
        raise ConfigError(
            "[privacy] max_epsilon",
            "budgets are per role: set max_epsilon in [active] or in [parties.NAME]",
        )
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Cross-field checks; raises `ConfigError`. Also run on configs built in code."""
    if not cfg.parties:
        raise ConfigError("[parties]", "at least one passive party ([parties.NAME]) is required")
    names = [cfg.active_name, *cfg.party_names]
    if len(set(names)) != len(names):
        raise ConfigError("[parties]", f"role names must be unique, got {names}")
    owners: dict[str, str] = {}
    for owner, cols in [(cfg.active_name, cfg.active_columns)] + [
        (p.name, p.columns) for p in cfg.parties
    ]:
        for col in cols:
            if col in owners:
                raise ConfigError(
                    f"[parties.{owner}] columns",
                    f"column {col!r} is already held by {owners[col]!r}; "
                    "each column belongs to exactly one role",
                )
            if col in (cfg.id_column, cfg.label):
                raise ConfigError(
                    f"[parties.{owner}] columns",
                    f"{col!r} is the id or label column and cannot be a feature",
                )
            owners[col] = owner
    if cfg.aligned and cfg.labeled is None:
        raise ConfigError(
            "[missing] aligned", "needs [missing] labeled (the aligned rows are labeled)"
        )
    if cfg.labeled is not None and cfg.aligned > cfg.labeled:
        raise ConfigError(
            "[missing] aligned",
            f"{cfg.aligned} aligned rows cannot be more than the {cfg.labeled} labeled ones",
        )
    for party in cfg.parties:
        if not party.columns:
            raise ConfigError(f"[parties.{party.name}] columns", "a passive party needs columns")
    secure = cfg.aggregation != "plain"
    if secure and len(cfg.parties) < cfg.min_group:
        raise ConfigError(
            "[run] min_group",
            f"a secure sum needs at least {cfg.min_group} passive contributors but the config "
            f"has {len(cfg.parties)} passive part{'y' if len(cfg.parties) == 1 else 'ies'}; "
            "add parties, or set min_group = 1 to accept unprotected sums explicitly",
        )
    _check_pipeline(cfg)
    if cfg.aggregation == "ckks" and cfg.aggregator_in_active:
        raise ConfigError(
            "[network] aggregator_in_active",
            "ckks needs the aggregator in a separate process from the active party: the "
            "aggregator sees every individual ciphertext and the active party holds the secret "
            "key, so together they could decrypt each party's contribution",
        )
    if cfg.transport == "inproc" and cfg.aggregation == "ckks":
        raise ConfigError(
            "[run] transport",
            "inproc runs every role in one process, which would put the CKKS secret key next to "
            'every ciphertext; use transport = "zmq" with ckks',
        )
    encoded_bits = math.log2(cfg.bound) + cfg.frac_bits
    if encoded_bits > 58:
        raise ConfigError(
            "[secure] bound",
            f"bound 2^{math.log2(cfg.bound):.1f} with frac_bits {cfg.frac_bits} needs "
            f"{encoded_bits:.0f} bits, leaving too little headroom in the 64-bit ring for sums; "
            "lower bound or frac_bits so that log2(bound) + frac_bits <= 58",
        )
    if cfg.aggregation == "ckks":
        from securevfl.secure_sum import ckks_params

        ckks_params(cfg)  # sized to the sums, or the fixed ones checked; ConfigError otherwise
    from securevfl.methods import method_spec

    spec = method_spec(cfg.method)
    spec.validate_config(cfg)
    for party in cfg.parties:
        refusal = policy_refusal(cfg, party.policy, spec, party=party.name)
        if refusal is not None:
            raise ConfigError(f"[parties.{party.name}.policy] {refusal[0]}", refusal[1])


def _check_pipeline(cfg: RunConfig) -> None:
    """[network] pipeline_depth > 0 only for a method that declares it tolerates stale updates
    (`MethodSpec.tolerates_staleness`), with fused rounds (the backward rides the next forward)."""
    if cfg.pipeline_depth == 0:
        return
    from securevfl.methods import method_spec  # declarations only, no torch

    spec = method_spec(cfg.method)
    if not spec.tolerates_staleness:
        raise ConfigError(
            "[network] pipeline_depth",
            f"method {cfg.method!r} does not declare that it tolerates stale updates (a party's "
            "forward computed before the updates of the batches in flight arrived), so it "
            f"cannot pipeline batches; set pipeline_depth = 0 for {cfg.method!r}, or use a "
            "method that declares it (splitnn)",
        )
    if spec.tolerates_dropout:
        raise ConfigError(
            "[network] pipeline_depth",
            f"method {cfg.method!r} goes on without a lost party, which a pipelined run cannot "
            "(the rounds in flight were masked for the old group); set pipeline_depth = 0",
        )
    if not cfg.fuse_rounds:
        raise ConfigError(
            "[network] pipeline_depth",
            f"pipeline_depth = {cfg.pipeline_depth} needs fuse_rounds = true (each batch's "
            "backward rides in the envelope of the next forward); set fuse_rounds = true or "
            "pipeline_depth = 0",
        )


def config_seeds(cfg: RunConfig, party: str) -> list[str]:
    """The settings of `cfg` under which passive party `party` draws from a seed in the config
    what would otherwise protect it (every role that holds the config can then redraw it):
    `[run] shared_init` (its initial weights), `[privacy] noise_seed` when it noises its
    contributions (embedding DP: the noise could be subtracted), `[method] guest_seed` (a
    TabVFL guest's weights, secret layer and masks)."""
    found = []
    if cfg.shared_init:
        found.append("[run] shared_init = true")
    if cfg.noise_seed is not None and any(
        p.name == party and p.embedding_dp is not None for p in cfg.parties
    ):
        found.append(f"[privacy] noise_seed = {cfg.noise_seed} (with embedding DP)")
    guest = getattr(cfg.options, "guest_seed", None)
    if guest is not None:
        found.append(f"[method] guest_seed = {guest}")
    return found


def policy_refusal(
    cfg: RunConfig, policy: ReleasePolicy, spec: Any, *, party: str
) -> tuple[str, str] | None:
    """(policy key, reason) if passive party `party` with `policy` would refuse this run; None
    if it accepts it. The party checks the same at run time, against its own config."""
    import fnmatch

    if policy.methods is not None and cfg.method not in policy.methods:
        return "methods", (
            f"this party accepts methods {list(policy.methods)}, not {cfg.method!r}; add it to "
            "the party's policy if the party agrees to what it releases (`securevfl methods "
            f"{cfg.method}`)"
        )
    if cfg.aggregation not in policy.aggregations:
        why = (
            "plain sends the party's representations in the clear to the aggregator and the "
            "active party"
            if cfg.aggregation == "plain"
            else f"{cfg.aggregation} is not in its list"
        )
        return "aggregations", (
            f"this party does not accept aggregation {cfg.aggregation!r} ({why}); add it to "
            "the party's policy aggregations to allow it"
        )
    if cfg.aggregator_in_active and not policy.aggregator_in_active:
        return "aggregator_in_active", (
            "the run puts the aggregator in the active party's process ([network] "
            "aggregator_in_active = true), which this party's policy does not accept; run the "
            "aggregator as its own process (aggregator_in_active = false), or set the policy's "
            "aggregator_in_active = true if the party accepts that the active party sees its "
            "masked contributions"
        )
    if cfg.aggregation != "plain" and cfg.min_group < policy.min_group:
        return "min_group", (
            f"this party asks for groups of at least {policy.min_group} passive parties but the "
            f"run uses [run] min_group = {cfg.min_group}: it would refuse the smaller sums the "
            "run asks for; raise [run] min_group, or lower the party's policy min_group to "
            "accept them"
        )
    clear = [
        f"{op.name}.{r.tensor}" for op in spec.operations for r in op.releases if r.to == "clear"
    ]
    refused = [
        c for c in clear if not any(fnmatch.fnmatchcase(c, pat) for pat in policy.clear_releases)
    ]
    if refused:
        return "clear_releases", (
            f"method {cfg.method!r} releases {refused} in the clear to the active party, which "
            "this party's policy does not allow (by default nothing leaves in the clear); add "
            "them to the policy's clear_releases if the party accepts (see `securevfl methods "
            f"{cfg.method}` for what each is)"
        )
    seeded = config_seeds(cfg, party) if not policy.config_seeds else []
    if seeded:
        return "config_seeds", (
            f"the run has {party} draw from a seed in the config ({'; '.join(seeded)}), which "
            "every role holding the config knows: the active party could redraw it and undo "
            "what it protects. Remove the setting (each party then draws its own from the "
            "OS), or, for a test or a benchmark only, set the party's policy config_seeds = true"
        )
    return None


# --------------------------------------------------------------------------------------------
# helpers


class _Section:
    def __init__(self, raw: Mapping[str, Any], name: str, known: set[str]) -> None:
        value = raw.get(name, {})
        if not isinstance(value, Mapping):
            raise ConfigError(f"[{name}]", f"must be a table, got {type(value).__name__}")
        for key in value:
            if key not in known:
                raise ConfigError(f"[{name}] {key}", f"unknown key; known keys are {sorted(known)}")
        self.name = name
        self.values = value

    def key(self, k: str) -> str:
        return f"[{self.name}] {k}"

    def raw(self, k: str) -> Any:
        return self.values.get(k)

    def string(self, k: str, default: str | None, *, required: bool = False) -> Any:
        v = self.values.get(k, default)
        if v is None:
            if required:
                raise ConfigError(self.key(k), "is required")
            return None
        if not isinstance(v, str) or not v:
            raise ConfigError(self.key(k), f"must be a non-empty string, got {v!r}")
        return v

    def choice(self, k: str, default: str, options: tuple[str, ...] | list[str]) -> str:
        v = self.values.get(k, default)
        if v not in options:
            raise ConfigError(
                self.key(k), f"unknown value {v!r}; choose one of {', '.join(options)}"
            )
        return v

    def boolean(self, k: str, default: bool) -> bool:
        v = self.values.get(k, default)
        if not isinstance(v, bool):
            raise ConfigError(self.key(k), f"must be true or false, got {v!r}")
        return v

    def integer(
        self, k: str, default: int, *, minimum: int | None = None, maximum: int | None = None
    ) -> int:
        v = self.values.get(k, default)
        return _integer(v, self.key(k), minimum=minimum, maximum=maximum)

    def number(
        self,
        k: str,
        default: float,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_minimum: bool = False,
    ) -> float:
        v = self.values.get(k, default)
        return _number(
            v, self.key(k), minimum=minimum, maximum=maximum, exclusive_minimum=exclusive_minimum
        )

    def string_list(self, k: str, default: list[str]) -> tuple[str, ...]:
        v = self.values.get(k, default)
        return _string_list(v, self.key(k))

    def int_list(self, k: str, default: list[int], *, minimum: int) -> list[int]:
        v = self.values.get(k, default)
        if not isinstance(v, list):
            raise ConfigError(self.key(k), f"must be a list of integers, got {v!r}")
        return [_integer(x, self.key(k), minimum=minimum) for x in v]

    def table(self, k: str, default: dict) -> dict:
        v = self.values.get(k, default)
        if not isinstance(v, Mapping):
            raise ConfigError(self.key(k), f"must be a table, got {v!r}")
        return dict(v)


def _integer(v: Any, key: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(key, f"must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ConfigError(key, f"must be <= {maximum}, got {v}")
    return v


def _number(
    v: Any,
    key: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(key, f"must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise ConfigError(key, f"must be finite, got {v}")
    if minimum is not None and (v <= minimum if exclusive_minimum else v < minimum):
        raise ConfigError(key, f"must be {'>' if exclusive_minimum else '>='} {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ConfigError(key, f"must be <= {maximum}, got {v}")
    return v


def _string_list(v: Any, key: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ConfigError(key, f"must be a list of column names (strings), got {v!r}")
    if len(set(v)) != len(v):
        raise ConfigError(key, f"lists a column twice: {v!r}")
    return tuple(v)


def _role_name(name: str, key: str) -> str:
    if not isinstance(name, str):
        raise ConfigError(key, f'a role name is a string, got {name!r}; e.g. name = "bank"')
    if not name:
        raise ConfigError(key, "a role name cannot be empty; name it, e.g. [parties.bureau]")
    if not set(name) <= ROLE_NAME_CHARS or len(name) > 64:
        raise ConfigError(
            key,
            f"role name {name!r} may use only lower-case letters, digits, '_' and '-' "
            "(at most 64 characters)",
        )
    if name in RESERVED_ROLE_NAMES:
        raise ConfigError(key, f"{name!r} is reserved for the aggregator; pick another name")
    return name


def _parties(raw: Any, policy_defaults: Mapping[str, Any]) -> tuple[PartyConfig, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise ConfigError("[parties]", "must be a table of [parties.NAME] tables")
    out = []
    for name, table in raw.items():
        key = f"[parties.{name}]"
        _role_name(name, key)
        if not isinstance(table, Mapping):
            raise ConfigError(key, "must be a table with a `columns` list")
        known = {
            "columns",
            "embedding_dp",
            "dp_sgd",
            "max_epsilon",
            "policy",
            "types",
            "categorical",
        }
        for k in table:
            if k not in known:
                raise ConfigError(f"{key} {k}", f"unknown key; known keys are {sorted(known)}")
        if "columns" not in table:
            raise ConfigError(f"{key} columns", "is required")
        own = _policy_table(table.get("policy"), f"[parties.{name}.policy]")
        out.append(
            PartyConfig(
                name=name,
                columns=_string_list(table["columns"], f"{key} columns"),
                embedding_dp=_dp(table.get("embedding_dp"), f"{key} embedding_dp"),
                dp_sgd=_dp(table.get("dp_sgd"), f"{key} dp_sgd"),
                max_epsilon=_positive_or_none(table.get("max_epsilon"), f"{key} max_epsilon"),
                policy=_policy({**policy_defaults, **own}, name),
                types=_types(table.get("types"), f"{key} types"),
                categorical=_categorical(table.get("categorical"), f"{key} categorical"),
            )
        )
    return tuple(out)


def _categorical(raw: Any, key: str) -> str | None:
    if raw is None:
        return None
    if raw not in CATEGORICAL:
        raise ConfigError(key, f"unknown value {raw!r}; choose one of {', '.join(CATEGORICAL)}")
    return str(raw)


def categorical_setting(cfg: RunConfig, role: str) -> tuple[str, str]:
    """(the `categorical` setting that applies to `role`'s categorical columns, the key it was
    written under): the role's own key, else `[data] categorical`."""
    active = role == cfg.active_name
    own = getattr(cfg if active else cfg.party(role), f"{'active_' if active else ''}categorical")
    if own is not None:
        key = "[active]" if active else f"[parties.{role}]"
        return own, f"{key} categorical"
    return cfg.categorical, "[data] categorical"


def categorical_encoding(cfg: RunConfig, role: str) -> str:
    """How `role` encodes its categorical columns: ``"onehot"`` or ``"embedding"`` (`auto`: the
    method's default, the first of its `MethodSpec.encodings`)."""
    setting, _ = categorical_setting(cfg, role)
    if setting != "auto":
        return setting
    from securevfl.methods import method_spec  # declarations only, no torch

    return method_spec(cfg.method).encodings[0]


def _types(raw: Any, key: str) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise ConfigError(key, 'must be a table like { job = "categorical", age = "numeric" }')
    kinds = ("numeric", "boolean", "categorical")
    for col, kind in raw.items():
        if kind not in kinds:
            raise ConfigError(f"{key}.{col}", f"must be one of {', '.join(kinds)}, got {kind!r}")
    return tuple(sorted(raw.items()))


def _na(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return D.na_tokens
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise ConfigError(
            "[data] na", f'must be a list of strings like ["", "NA", "?"], got {raw!r}'
        )
    return tuple(raw)


def _delimiter(raw: Any) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or len(raw) != 1 or raw in '\r\n"':
        raise ConfigError(
            "[data] delimiter", f'must be one character such as "," or ";", got {raw!r}'
        )
    return raw


def _stream(raw: Any) -> bool | None:
    if raw is None or raw == "auto":
        return None
    if not isinstance(raw, bool):
        raise ConfigError("[data] stream", f'must be "auto", true or false, got {raw!r}')
    return raw


_POLICY_KEYS = {
    "methods",
    "aggregations",
    "min_group",
    "clear_releases",
    "share_presence",
    "aggregator_in_active",
    "config_seeds",
    "on_refusal",
}


def _policy_table(raw: Any, key: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(key, f"must be a table of policy keys, got {type(raw).__name__}")
    for k in raw:
        if k not in _POLICY_KEYS:
            raise ConfigError(f"{key} {k}", f"unknown key; known keys are {sorted(_POLICY_KEYS)}")
    return {k: (v, key) for k, v in raw.items()}


def _policy(values: Mapping[str, tuple[Any, str]], party: str) -> ReleasePolicy:
    """A party's policy from `[policy]` overridden by `[parties.NAME.policy]`; each value
    carries the table it came from, so an error names it."""

    def get(k: str, default: Any) -> tuple[Any, str]:
        return values.get(k, (default, f"[parties.{party}.policy]"))

    d = ReleasePolicy()
    methods, mkey = get("methods", None)
    if methods is not None:
        methods = _string_list(methods, f"{mkey} methods")
    aggs, akey = get("aggregations", list(d.aggregations))
    aggs = _string_list(aggs, f"{akey} aggregations")
    for a in aggs:
        if a not in AGGREGATIONS:
            raise ConfigError(f"{akey} aggregations", f"unknown aggregation {a!r}")
    min_group, gkey = get("min_group", d.min_group)
    clear, ckey = get("clear_releases", list(d.clear_releases))
    if not isinstance(clear, list) or not all(isinstance(c, str) and "." in c for c in clear):
        raise ConfigError(
            f"{ckey} clear_releases",
            f'must be a list of "operation.tensor" names (patterns allowed), got {clear!r}',
        )
    share, skey = get("share_presence", d.share_presence)
    if not isinstance(share, bool):
        raise ConfigError(f"{skey} share_presence", f"must be true or false, got {share!r}")
    colocated, ikey = get("aggregator_in_active", d.aggregator_in_active)
    if not isinstance(colocated, bool):
        raise ConfigError(
            f"{ikey} aggregator_in_active", f"must be true or false, got {colocated!r}"
        )
    seeds, skey2 = get("config_seeds", d.config_seeds)
    if not isinstance(seeds, bool):
        raise ConfigError(f"{skey2} config_seeds", f"must be true or false, got {seeds!r}")
    refusal, rkey = get("on_refusal", d.on_refusal)
    if refusal not in ("stop", "skip"):
        raise ConfigError(f"{rkey} on_refusal", f'must be "stop" or "skip", got {refusal!r}')
    return ReleasePolicy(
        methods=methods,
        aggregations=aggs,
        min_group=_integer(min_group, f"{gkey} min_group", minimum=1),
        clear_releases=tuple(clear),
        share_presence=share,
        aggregator_in_active=colocated,
        config_seeds=seeds,
        on_refusal=refusal,
    )


def _ckks(raw: Mapping[str, Any], *, magnitude: float | None = None) -> CkksConfig:
    """[secure] ckks; `magnitude`: the method's declared bound on its sums' values
    (`MethodSpec.secure_defaults` ``ckks.magnitude``), used where the table sets none."""
    manual = ("poly_modulus_degree", "coeff_mod_bit_sizes", "scale_bits")
    known = {*manual, "special_prime", "precision_bits", "flood_bits", "security_bits", "magnitude"}
    for k in raw:
        if k not in known:
            raise ConfigError(f"[secure] ckks.{k}", f"unknown key; known keys are {sorted(known)}")
    given = [k for k in manual if k in raw]
    if given and len(given) != len(manual):
        missing = [k for k in manual if k not in raw]
        raise ConfigError(
            f"[secure] ckks.{given[0]}",
            f"fixed CKKS parameters need all of {list(manual)}; add {missing}, or remove "
            f"{given} to let securevfl size them to the sums",
        )
    default = CkksConfig()
    degree = bits_t = scale = None
    if given:
        degree = _integer(
            raw["poly_modulus_degree"], "[secure] ckks.poly_modulus_degree", minimum=1024
        )
        bits = raw["coeff_mod_bit_sizes"]
        if not isinstance(bits, list) or not bits:
            raise ConfigError("[secure] ckks.coeff_mod_bit_sizes", f"must be a list, got {bits!r}")
        bits_t = tuple(_integer(b, "[secure] ckks.coeff_mod_bit_sizes", minimum=17) for b in bits)
        scale = _integer(raw["scale_bits"], "[secure] ckks.scale_bits", minimum=10)
    special = raw.get("special_prime", True)
    if "special_prime" in raw and not given:
        raise ConfigError(
            "[secure] ckks.special_prime",
            f"only applies to fixed parameters; add {list(manual)} or remove it (sized "
            "parameters never have a special prime)",
        )
    if not isinstance(special, bool):
        raise ConfigError("[secure] ckks.special_prime", f"must be true or false, got {special!r}")
    precision = _integer(
        raw.get("precision_bits", default.precision_bits),
        "[secure] ckks.precision_bits",
        minimum=0,
        maximum=40,
    )
    flood = _integer(
        raw.get("flood_bits", default.flood_bits), "[secure] ckks.flood_bits", minimum=0, maximum=40
    )
    security = _integer(
        raw.get("security_bits", default.security_bits), "[secure] ckks.security_bits"
    )
    if security not in (128, 192, 256):
        raise ConfigError("[secure] ckks.security_bits", f"must be 128, 192 or 256, got {security}")
    magnitude = raw.get("magnitude", magnitude)
    if magnitude is not None:
        if isinstance(magnitude, bool) or not isinstance(magnitude, int | float):
            raise ConfigError("[secure] ckks.magnitude", f"must be a number, got {magnitude!r}")
        if not (math.isfinite(magnitude) and 0 < magnitude <= 2.0**40):
            raise ConfigError("[secure] ckks.magnitude", f"must be in (0, 2^40], got {magnitude!r}")
        magnitude = float(magnitude)
    return CkksConfig(
        poly_modulus_degree=degree,
        coeff_mod_bit_sizes=bits_t,
        scale_bits=scale,
        special_prime=special,
        precision_bits=precision,
        flood_bits=flood,
        security_bits=security,
        magnitude=magnitude,
    )


# kind -> {parameter: default (None: required)}; generators add theirs (`register_missing_kind`)
_MISSING_KINDS: dict[str, dict[str, float | None]] = {
    "none": {},
    "mcar": {"p": None},
    "beta": {"a": None, "b": None},
}


def register_missing_kind(kind: str, params: Mapping[str, float | None] | set[str]) -> None:
    """Let a missingness generator declare its parameters (name -> default, None = required)
    to config validation."""
    if not isinstance(params, Mapping):
        params = dict.fromkeys(params)
    _MISSING_KINDS[kind] = dict(params)


def _missing(raw: Any, key: str) -> MissingSpec:
    import securevfl.data.missing  # noqa: F401  (registers the generators' parameters)

    if raw is None:
        return MissingSpec()
    if not isinstance(raw, Mapping) or "kind" not in raw:
        raise ConfigError(key, f'must be a table like {{ kind = "mcar", p = 0.5 }}, got {raw!r}')
    kind = raw["kind"]
    if not isinstance(kind, str) or kind not in _MISSING_KINDS:
        raise ConfigError(key, f"unknown kind {kind!r}; choose one of {sorted(_MISSING_KINDS)}")
    params = {k: v for k, v in raw.items() if k != "kind"}
    declared = _MISSING_KINDS[kind]
    unknown = sorted(set(params) - set(declared))
    required = sorted(k for k, d in declared.items() if d is None and k not in params)
    if unknown or required:
        raise ConfigError(
            key,
            f"kind {kind!r} takes {sorted(declared) or 'no parameters'}"
            + (f"; unknown: {unknown}" if unknown else "")
            + (f"; missing: {required}" if required else ""),
        )
    values = {k: _number(v, f"{key}.{k}", minimum=0.0) for k, v in params.items()}
    values.update({k: float(d) for k, d in declared.items() if k not in values and d is not None})
    if kind == "mcar" and not values["p"] < 1.0:
        raise ConfigError(f"{key}.p", "must be < 1 (p = 1 would leave no data)")
    return MissingSpec(kind=kind, params=tuple(sorted(values.items())))


def _dp(raw: Any, key: str) -> DPConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(
            key, f"must be a table like {{ noise_multiplier = 1.0, clip = 1.0 }}, got {raw!r}"
        )
    known = {"noise_multiplier", "clip", "target_epsilon"}
    for k in raw:
        if k not in known:
            raise ConfigError(f"{key}.{k}", f"unknown key; known keys are {sorted(known)}")
    if "clip" not in raw:
        raise ConfigError(f"{key}.clip", "is required (the L2 clipping norm C)")
    clip = _number(raw["clip"], f"{key}.clip", minimum=0.0, exclusive_minimum=True)
    sigma = raw.get("noise_multiplier")
    target = raw.get("target_epsilon")
    if (sigma is None) == (target is None):
        raise ConfigError(key, "give exactly one of noise_multiplier and target_epsilon")
    if sigma is not None:
        sigma = _number(sigma, f"{key}.noise_multiplier", minimum=0.0, exclusive_minimum=True)
    if target is not None:
        target = _number(target, f"{key}.target_epsilon", minimum=0.0, exclusive_minimum=True)
    return DPConfig(clip=clip, noise_multiplier=sigma, target_epsilon=target)


def _positive_or_none(raw: Any, key: str) -> float | None:
    if raw is None:
        return None
    return _number(raw, key, minimum=0.0, exclusive_minimum=True)


def _delta(raw: Any) -> float | None:
    if raw is None:
        return None
    v = _number(raw, "[privacy] delta", minimum=0.0, exclusive_minimum=True)
    if v >= 1:
        raise ConfigError("[privacy] delta", f"must be < 1, got {v}")
    return v


def _resolve(base: Path, value: str | None) -> Path:
    if value is not None and "\x00" in value:
        raise ConfigError("path", f"{value!r} contains a NUL character; fix the path")
    p = Path(value) if value is not None else Path()
    return p if p.is_absolute() else (base / p).resolve()


def dump_toml(raw: Mapping[str, Any]) -> str:
    """A config dict as TOML text, for the subset configs use: one table per section,
    ``[parties.NAME]`` per party, values scalars, lists and inline tables. ``load_config`` of
    the written file gives back ``raw``."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, Mapping):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return repr(v)

    lines: list[str] = []
    for section, table in raw.items():
        if section == "parties":
            for name, party in table.items():
                lines.append(f"[parties.{name}]")
                lines += [f"{k} = {value(v)}" for k, v in party.items()]
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
