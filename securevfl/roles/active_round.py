"""The active party's stage of every round (`ActiveRound`, an `ActiveContext`), and the runs it
drives: set-up, training and evaluation (`train_and_evaluate`), scoring (`score`). Its calls go
through an `exchange` (one call envelope in, its result out): ZeroMQ for the roles, memory for
the direct path."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from crypto import FixedPointOverflow, SumDidNotCancel
from securevfl.config import RunConfig
from securevfl.data.rowarrays import PresenceRows, filter_ids
from securevfl.errors import RunAborted
from securevfl.methods import PartyDropped, SumSpec, method_spec
from securevfl.roles import protocol as P
from securevfl.roles.checkpoint import save_checkpoint
from securevfl.roles.guard import call_tags, run_terms
from securevfl.roles.rounds import Call, Exchange, fuse, readmits_late, sum_arrays
from securevfl.secure_sum import (
    SumSession,
    backend,
    check_group,
    ckks_context_tag,
    ckks_params,
    group_allowed,
)
from transport import Envelope
from transport.errors import quote

# a sum's shape in a result: at most this many dimensions (NumPy allows 64)
MAX_RESULT_DIMS = 32


def malformed_result(what: str, problem: str) -> RunAborted:
    """The stop for a RESULT of `what` that no honest aggregator sends."""
    return RunAborted(
        f"the aggregator sent a malformed result for {what}: {problem}; stopping (check that "
        "the aggregator runs an unmodified securevfl of this version)"
    )


def result_shape(
    shapes: Mapping[str, Any], arrays: Mapping[str, np.ndarray], key: str, *, what: str
) -> tuple[int, ...]:
    """The shape of sum `key` in a result, checked: a list of non-negative ints (no -1) whose
    product is the size of the sum's array (`arrays`, when the backend sends one array; CKKS
    chunks are counted against it on decryption). Raises `RunAborted` (`malformed_result`)."""
    shape = shapes.get(key)
    if (
        type(shape) is not list
        or len(shape) > MAX_RESULT_DIMS
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise malformed_result(
            what, f"the shape of sum {key!r} is {quote(shape)}, not a list of non-negative ints"
        )
    if not arrays:
        raise malformed_result(what, f"it carries no tensor for sum {key!r}")
    size = math.prod(shape)
    single = arrays.get(key)
    if single is not None and single.size != size:
        raise malformed_result(
            what,
            f"sum {key!r} has {single.size} values but its shape {shape} says {size}",
        )
    return tuple(shape)


class PartyLate(PartyDropped):
    """Raised by `ActiveRound.call` when `parties` missed the round's deadline but stay in the
    run (the method declares `readmits_late`): the round's results are discarded, the parties
    are still in `ctx.parties` and are called again in the next round. The call reached every
    recipient (`delivered`): an update such as a backward pass must not be sent again."""

    def __init__(self, parties: Sequence[str]) -> None:
        super().__init__(parties[0], delivered=True)
        self.parties = tuple(parties)
        self.args = (
            f"parties {list(self.parties)} missed the round deadline; they stay in the run",
        )


@runtime_checkable
class PipelinedExchange(Protocol):
    """A transport that sends a call envelope and later receives the result of its round
    (several rounds in flight): `securevfl.roles.connection.RoundExchange` over ZeroMQ."""

    def send(self, env: Envelope) -> None: ...

    def receive(self, round: int, what: str) -> Envelope: ...


@dataclass(eq=False)
class Posted:
    """A call sent by `ActiveRound.post` whose result `ActiveRound.wait` has not taken yet."""

    round: int
    op: str
    sums: tuple[SumSpec, ...]
    to: tuple[str, ...]
    collect: tuple[str, ...]
    held: Call | None  # the update that rode ahead of it
    what: str


class ActiveRound:
    """The active party's stage: an `ActiveContext` whose calls go through `exchange` (one call
    envelope in, its result envelope out) — ZeroMQ for the roles, memory for the direct path.
    An exchange that is a `PipelinedExchange` also lets `post` send calls ahead of their
    results ([network] pipeline_depth)."""

    def __init__(
        self,
        *,
        cfg: RunConfig,
        exchange: Exchange,
        session: bytes,
        method: Any,
        run_dir: Path,
        logger: logging.Logger,
        start_epoch: int = 0,
        out: Any = None,
        mask_keypair: Any = None,
        mask_publics: Mapping[str, bytes] | None = None,
    ) -> None:
        self.config = cfg
        self.exchange = exchange
        self._exchange_kind: tuple[Any, bool] | None = None
        self.session = session
        self.session_hex = session.hex()
        self.method = method
        self.run_dir = Path(run_dir)
        self.logger = logger
        self.start_epoch = start_epoch
        self.out = out
        self.mask_keypair = mask_keypair
        self.mask_publics = dict(mask_publics or {})
        self.round = 0
        self._parties = tuple(cfg.party_names)
        self.privacy: Any = None
        self.key_holder: Any = None
        self.ckks_context: bytes | None = None
        if cfg.aggregation == "ckks":
            from crypto.ckks import CkksKeyHolder, security_level

            params = ckks_params(cfg)
            self.key_holder = CkksKeyHolder(params=params)
            logger.info(
                "ckks: degree %d, chain %s (%s), scale 2^%d (%d-bit security), context %s",
                params.poly_modulus_degree,
                list(params.coeff_mod_bit_sizes),
                "last prime special" if params.special_prime else "data primes only",
                params.scale_bits,
                security_level(params),
                self.key_holder.context_fingerprint,
            )
            self.ckks_context = self.key_holder.public_context_bytes()
        release = None
        if cfg.aggregation == "ckks":
            from crypto.ckks import DecryptionRelease

            release = DecryptionRelease(
                precision_bits=cfg.ckks.precision_bits, flood_bits=cfg.ckks.flood_bits
            )
        sum_session = SumSession(
            name=cfg.active_name,
            session=session,
            min_group=cfg.min_group,
            frac_bits=cfg.frac_bits,
            bound=cfg.bound,
            ckks_release=release,
        )
        stage_cls = backend(cfg.aggregation).active
        self.stage = (
            stage_cls(sum_session, key_holder=self.key_holder)
            if cfg.aggregation == "ckks"
            else stage_cls(sum_session)
        )
        from securevfl.roles.guard import auth_key

        # one call-authentication key per party, which the aggregator cannot derive
        self._auth_keys = (
            {
                p: auth_key(
                    keypair=mask_keypair,
                    me=cfg.active_name,
                    peer=p,
                    peer_public=self.mask_publics[p],
                    session=session,
                )
                for p in cfg.party_names
            }
            if mask_keypair is not None
            else {}
        )
        self.auth_seconds = 0.0  # time spent tagging calls (reported in metrics.json)
        self.exchanges = 0  # envelopes sent (a fused envelope counts once)
        # an update call held back to ride ahead of the next call to the same parties
        # ([network] fuse_rounds, the pairs the method declares in `MethodSpec.fuse`)
        self._held: Call | None = None
        self._fuse = frozenset(method_spec(cfg.method).fuse) if cfg.fuse_rounds else frozenset()
        # calls sent and not yet answered, in round order ([network] pipeline_depth > 0 keeps
        # several forwards and their riding updates in flight); results received ahead of time
        self._in_flight: list[Posted] = []
        self._settled: dict[int, dict[str, np.ndarray]] = {}
        self._results: dict[int, Envelope] = {}
        self.lost: list[str] = []
        self.epoch_seconds: list[float] = []
        self.history: list[dict[str, float]] = []
        self._epoch_started = time.perf_counter()
        self._presence: np.ndarray | PresenceRows | None = None
        # which of the active party's rows each party holds, known from a PSI (`securevfl align`)
        self.shared: dict[str, np.ndarray] | None = None

    # --- ActiveContext

    @property
    def parties(self) -> tuple[str, ...]:
        return self._parties

    def log(self, message: str) -> None:
        self.logger.info("%s", message)

    def sum_allowed(self, group: Sequence[str]) -> bool:
        return group_allowed(self.config, group)

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
        return self.wait(
            self.post(op, ids=ids, args=args, inputs=inputs, sums=sums, to=to, collect=collect)
        )

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
    ) -> Posted:
        """Send a call (with the update held back to ride ahead of it, if it may) and return
        its ticket for `wait`, without waiting for the result."""
        for spec in sums:  # the one check of the active party, before anything is sent
            check_group(self.config, spec.group, key=spec.key, what=f"method op {op!r}")
        if to is None:
            to = sorted({p for s in sums for p in s.group}) or list(self._parties)
        held, self._held = self._held, None
        if held is not None and ((held.op, op) not in self._fuse or set(held.to) != set(to)):
            self._deliver(held)  # anything else goes after it, alone, so nothing changes order
            held = None
        calls = []
        if held is not None:  # it takes the round it would have had alone: the next one
            self.round += 1
            calls.append(replace(held, round=self.round, session=self.session_hex))
        self.round += 1
        call = Call(
            op=op,
            round=self.round,
            session=self.session_hex,
            ids=np.asarray(ids, dtype=np.int64),
            args=dict(args or {}),
            inputs=dict(inputs or {}),
            sums=tuple(sums),
            to=tuple(to),
            collect=tuple(collect),
        )
        calls.append(call)
        env = fuse(calls, sender=self.config.active_name)
        started = time.perf_counter()
        env.meta["auth"] = call_tags(
            env.meta,
            session=self.session,
            round=call.round,
            tensors=env.tensors,
            keys={p: self._auth_keys[p] for p in call.to if p in self._auth_keys},
        )
        self.auth_seconds += time.perf_counter() - started
        self.exchanges += 1
        self._transmit(env)
        posted = Posted(
            round=call.round,
            op=op,
            sums=tuple(sums),
            to=tuple(to),
            collect=tuple(collect),
            held=held,
            what=" + ".join(f"{c.op} (round {c.round})" for c in calls),
        )
        self._in_flight.append(posted)
        return posted

    def wait(self, posted: Posted) -> dict[str, np.ndarray]:
        """The result of a posted call, after those of the calls posted before it (results
        arrive in round order; an earlier call's result is kept until it is waited for).
        Raises as `call` does."""
        if posted.round in self._settled:
            return self._settled.pop(posted.round)
        if posted not in self._in_flight:
            raise ValueError(f"{posted.what}: its result was already taken")
        while True:
            first = self._in_flight.pop(0)
            out = self._settle(first)
            if first is posted:
                return out
            if first.sums or first.collect:
                self._settled[first.round] = out

    def _transmit(self, env: Envelope) -> None:
        exchange = self.exchange
        kind = self._exchange_kind
        if kind is None or kind[0] is not exchange:  # a Protocol isinstance costs µs: once
            kind = self._exchange_kind = (exchange, isinstance(exchange, PipelinedExchange))
        if kind[1]:
            exchange.send(env)
        else:  # one call in, its result out (the direct path): kept until waited for
            self._results[env.round] = exchange(env)

    def _settle(self, posted: Posted) -> dict[str, np.ndarray]:
        """Receive and check the result of `posted`; its decoded sums and clear tensors."""
        if posted.round in self._results:
            result = self._results.pop(posted.round)
        else:
            self.stage.waiting()  # e.g. the next reveal's flooding noise, while the sum comes
            result = self.exchange.receive(posted.round, posted.what)
        held, op, what, to = posted.held, posted.op, posted.what, posted.to
        for listed in ("lost", "late"):  # role names, else the aggregator's result is malformed
            named = result.meta.get(listed)
            if named and (type(named) is not list or not all(type(p) is str for p in named)):
                raise malformed_result(what, f"{listed!r} is {quote(named)}, not a list of roles")
        if result.meta.get("refused"):
            refused = result.meta["refused"]
            raise RunAborted(
                f"{what} was refused by a party's release policy: {refused}; nothing was "
                "released (see that party's log and the ledger)",
                refused=True,
            )
        if result.meta.get("lost"):
            try:
                self._lose(result, op)
            finally:
                if held is not None and not result.meta.get("delivered", False):
                    # nobody ran the update: it still goes, to the survivors, before the next call
                    alive = tuple(p for p in held.to if p in self._parties)
                    self._held = replace(held, to=alive) if alive else None
        if result.meta.get("late"):  # the call reached everyone (a held update rode along)
            if not readmits_late(self.config):  # an honest aggregator never says so
                raise RunAborted(
                    f"the aggregator reported parties {result.meta['late']} late in {what}, "
                    f"but method {self.config.method!r} does not readmit late parties; "
                    "stopping (check the aggregator)"
                )
            late = [p for p in map(str, result.meta["late"]) if p in self._parties]
            self.logger.warning(
                "party %s missed the deadline of %s; it stays in the run", late, what
            )
            raise PartyLate(late or [str(p) for p in result.meta["late"]])
        shapes = result.meta.get("shapes")
        if posted.sums and type(shapes) is not dict:
            given = "it carries no 'shapes'" if shapes is None else f"'shapes' is {quote(shapes)}"
            raise malformed_result(what, f"{given}, not a mapping of sum key to shape")
        out = {}
        for spec in posted.sums:
            arrays = sum_arrays(result.tensors, spec.key)
            shape = result_shape(shapes, arrays, spec.key, what=what)
            try:
                out[spec.key] = self.stage.reveal(
                    arrays, group=spec.group, key=spec.key, shape=shape
                )
            except (SumDidNotCancel, FixedPointOverflow):
                raise
            except (ValueError, TypeError) as exc:  # the tensors do not fit the backend's sum
                raise malformed_result(what, f"sum {spec.key!r}: {exc}") from None
        for name in posted.collect:
            for party in to:
                tensor = result.tensors.get(f"{name}@{party}")
                if tensor is None:
                    raise malformed_result(what, f"it lacks {party}'s clear tensor {name!r}")
                out[f"{name}@{party}"] = tensor
        return out

    def flush(self) -> None:
        """Send the update call held back to ride with the next call, if any, on its own; then
        wait for every call in flight (pipelined updates are acknowledged here at the latest)."""
        self._release_held()
        while self._in_flight:
            first = self._in_flight.pop(0)
            out = self._settle(first)
            if first.sums or first.collect:
                self._settled[first.round] = out

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._deliver(held)

    def _deliver(self, held: Call) -> None:
        """An update call on its own; a party lost meanwhile is skipped, and an update that
        reached the others is never sent twice. Pipelined ([network] pipeline_depth > 0): it is
        posted, and its acknowledgement is checked by the next `wait` (or `flush`)."""
        alive = [p for p in held.to if p in self._parties]
        if self.config.pipeline_depth > 0:
            if alive:
                self.post(held.op, ids=held.ids, args=held.args, inputs=held.inputs, to=alive)
            return
        while alive:
            try:
                self.call(held.op, ids=held.ids, args=held.args, inputs=held.inputs, to=alive)
                break
            except PartyDropped as exc:
                if exc.delivered:  # the survivors have applied it: never twice
                    break
                alive = [p for p in alive if p in self._parties]

    def _lose(self, result: Envelope, op: str) -> None:
        named = [str(p) for p in result.meta["lost"]]
        lost = [p for p in named if p in self._parties]
        self._parties = tuple(p for p in self._parties if p not in lost)
        self.lost.extend(lost)
        self.logger.warning(
            "party %s was lost during round %d (%s); continuing with %s",
            lost,
            self.round,
            op,
            list(self._parties),
        )
        if self.out is not None:
            print(
                f"party {', '.join(lost)} lost; continuing with {', '.join(self._parties)}",
                file=self.out,
                flush=True,
            )
        raise PartyDropped(
            lost[0] if lost else named[0], delivered=bool(result.meta.get("delivered", False))
        )

    def presence(self, ids: np.ndarray) -> np.ndarray:
        positions = self.method.table.positions(ids)
        if isinstance(self._presence, PresenceRows):
            return self._presence.rows(positions)
        return self._presence[positions]

    def set_presence(self, held: Mapping[str, np.ndarray]) -> None:
        table = self.method.table
        n = len(table.ids)
        for party, flags in held.items():
            if flags.dtype != np.bool_ or flags.shape != (n,):
                raise RunAborted(
                    f"{party} answered set-up with a malformed row-presence vector "
                    f"({flags.dtype}, shape {flags.shape}; expected bool of shape ({n},))",
                    lost=party,
                )
        if table.streamed:  # one bit a party and row, in a file of the table's row cache
            self._presence = PresenceRows(table.rowstore.arrays(), held, self.config.party_names)
            return
        self._presence = np.stack(
            [np.asarray(held[p], dtype=bool) for p in self.config.party_names], axis=1
        )

    def unheld_rows(self) -> int:
        """How many of the active party's rows no passive party holds (after set-up)."""
        if isinstance(self._presence, PresenceRows):
            return self._presence.count_unheld()
        return int((~self._presence.any(axis=1)).sum())

    def release_gradients(
        self, grads: Mapping[str, np.ndarray], *, epoch: int, ids: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """Label DP on per-sample gradient rows about to leave: each row clipped jointly over
        every entry of ``grads`` and noised, after the budget check and the ledger event."""
        arrays = {k: np.asarray(v, dtype=np.float32) for k, v in grads.items()}
        if self.privacy is None or not arrays:
            return arrays
        return self.privacy.release_gradients(arrays, ids=ids, epoch=epoch)

    def return_gradients(
        self,
        grads: Mapping[tuple[str, ...], Mapping[str, np.ndarray]],
        *,
        ids: np.ndarray,
        epoch: int,
        op: str = "backward",
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """Send gradients of a batch-mean loss to the parties (`args`: the update call's
        arguments, e.g. the round of the forward it belongs to): ``grads[group][tensor]`` goes to
        every party of `group` (one call per group). Owns the batch-size convention: rows are
        scaled to per-sample gradients (x B), pass label DP together (one joint clip per row),
        and are scaled back (/ B). A party lost meanwhile is skipped; an update that reached the
        others is never sent twice."""
        n = len(ids)
        names = {group: "+".join(group) for group in grads}
        flat = {
            f"{names[group]}/{t}": np.asarray(g) * n
            for group, tensors in grads.items()
            for t, g in tensors.items()
        }
        released = self.release_gradients(flat, epoch=epoch, ids=ids)
        for group, tensors in grads.items():
            inputs = {
                t: np.asarray(released[f"{names[group]}/{t}"], dtype=np.float32) / n
                for t in tensors
            }
            alive = tuple(p for p in group if p in self._parties)
            update = Call(
                op=op,
                round=0,
                session=self.session_hex,
                ids=ids,
                args=dict(args or {}),
                inputs=inputs,
                to=alive,
            )
            if alive and any(u == op for u, _ in self._fuse):
                self._release_held()  # at most one held: an earlier group's goes first, alone
                self._held = update  # rides ahead of the next call to `alive` (or goes alone)
            else:
                self._deliver(update)

    def epoch_done(self, epoch: int, *, stats: Mapping[str, float]) -> None:
        """Commit an epoch: every party saves its checkpoint, then the active party."""
        self.epoch_seconds.append(time.perf_counter() - self._epoch_started)
        self.history.append({"epoch": epoch, **{k: float(v) for k, v in stats.items()}})
        try:
            self.call(
                P.OP_CHECKPOINT,
                ids=np.empty(0, dtype=np.int64),
                args={"epoch": epoch},
                to=self._parties,
            )
        except PartyLate:
            pass  # the call reached every party: a late one commits the epoch when it gets to it
        save_checkpoint(
            self.run_dir,
            self.config.active_name,
            epoch,
            {
                "method": self.method.state_dict(),
                "encoding": self.method.table.encoding_state(),
                "epoch_seconds": list(self.epoch_seconds),
                "history": [dict(h) for h in self.history],
                "round": self.round,
            },
        )
        parts = "  ".join(f"{k} {v:.4g}" for k, v in stats.items())
        total = self.method.progress_total
        step = f"{self.method.progress_unit} {epoch + 1}" + (f"/{total}" if total else "")
        line = f"{step}  {parts}  ({self.epoch_seconds[-1]:.2f} s)"
        if self.privacy is not None and self.privacy.plan.mechanisms:
            spent = ", ".join(f"{m} {e:.3g}" for m, e in self.privacy.spent().items())
            line += f"  epsilon spent: {spent} (delta {self.privacy.delta:g})"
        if self.out is not None:
            print(line, file=self.out, flush=True)
        self.logger.info("%s", line)
        self._epoch_started = time.perf_counter()

    # --- a run

    def start(self, *, train_ids: np.ndarray, ledger: Any) -> None:
        """The active party's privacy plan (N = the training rows the parties are told of)."""
        from securevfl.privacy.runtime import RolePrivacy, plan_role

        cfg = self.config
        self.privacy = RolePrivacy(
            plan=plan_role(cfg, role=cfg.active_name, n_train=len(train_ids)), ledger=ledger
        )
        self.privacy.set_rows(self.method.table.ids)
        self.method.privacy = self.privacy

    def setup(self, *, train_ids: np.ndarray, scoring: bool = False) -> None:
        """The set-up round: every party learns the training rows (and, with ckks, receives the
        authenticated public context); each answers which of the active party's rows it holds.
        `scoring`: a trained model (the checkpoint of epoch start_epoch - 1) scores new rows."""
        cfg = self.config
        inputs: dict[str, np.ndarray] = {}
        if not self.method.table.streamed:  # else: a part at a time (`setup_rows`)
            inputs = {"train_ids": train_ids, "all_ids": self.method.table.ids}
        # what the active party runs: each party compares it with its own config
        args: dict[str, Any] = {"resume_epoch": self.start_epoch - 1, "run": run_terms(cfg)}
        if scoring:
            args["predict"] = True
        if self.ckks_context is not None:
            inputs["ckks_context"] = np.frombuffer(self.ckks_context, dtype=np.uint8)
            args["ckks_tags"] = {
                p: ckks_context_tag(
                    context=self.ckks_context,
                    my_keypair=self.mask_keypair,
                    me=cfg.active_name,
                    peer=p,
                    peer_public=self.mask_publics[p],
                    session=self.session,
                ).hex()
                for p in self.parties
            }
        if self.method.table.streamed:  # its rows a part at a time
            from securevfl.roles.setup_rows import setup_in_parts

            self.set_presence(setup_in_parts(self, train_ids=train_ids, args=args, inputs=inputs))
            return
        if self.shared is None:
            held = self.call(
                P.OP_SETUP,
                ids=np.empty(0, dtype=np.int64),
                args=args,
                inputs=inputs,
                to=self.parties,
                collect=["present"],
            )
            self.set_presence({p: held[f"present@{p}"] for p in self.parties})
            return
        # aligned by PSI: each party learns only the ids it shares with the label holder
        table_ids = self.method.table.ids
        for p in self.parties:
            mine = table_ids[self.shared[p]]
            own = {**inputs, "all_ids": mine, "train_ids": np.intersect1d(train_ids, mine)}
            held = self.call(
                P.OP_SETUP,
                ids=np.empty(0, dtype=np.int64),
                args=args,
                inputs=own,
                to=[p],
                collect=["present"],
            )[f"present@{p}"]
            if held.shape != mine.shape or not held.all():
                raise RunAborted(
                    f"{p} does not hold every row the alignment says it shares; run `securevfl "
                    "align` again with the current files",
                    lost=p,
                )
        self.set_presence({p: self.shared[p] for p in self.parties})

    def held_rows(self, ids: np.ndarray) -> np.ndarray:
        """`ids` without the rows no passive party holds (of a streamed table: in a file of its
        row cache, computed a block at a time)."""
        table = self.method.table
        if table.streamed:
            keep = lambda block: self.presence(block).any(axis=1)  # noqa: E731
            return filter_ids(table.rowstore.arrays(), ids, keep, "held.ids")
        return ids[self.presence(ids).any(axis=1)]


def train_and_evaluate(
    ctx: ActiveRound, *, train_ids: np.ndarray, test_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Set-up, training and evaluation of the method over `ctx`; returns the training and test
    rows used (rows no passive party holds are dropped) and the test metrics."""
    ctx.setup(train_ids=train_ids)
    unheld = ctx.unheld_rows()
    if unheld and method_spec(ctx.config.method).uses_unheld_rows:
        ctx.logger.info("%d rows are held by no passive party; the method uses them", unheld)
    elif unheld:
        ctx.logger.info("%d rows are held by no passive party and are dropped", unheld)
        train_ids, test_ids = ctx.held_rows(train_ids), ctx.held_rows(test_ids)
    table = ctx.method.table
    if not method_spec(ctx.config.method).uses_unlabeled:  # a labeled budget: labeled rows only
        if table.streamed:
            train_ids = filter_ids(table.rowstore.arrays(), train_ids, table.labeled, "labeled")
        else:
            train_ids = train_ids[table.labeled(train_ids)]
    ctx._epoch_started = time.perf_counter()
    ctx.method.fit(ctx, train_ids=train_ids)
    ctx.flush()  # an update held back to ride with a next call that never came
    test = ctx.method.evaluate(ctx, ids=test_ids) if len(test_ids) else {}
    return train_ids, test_ids, test


def score(ctx: ActiveRound) -> tuple[np.ndarray, np.ndarray]:
    """A trained model scoring the active party's rows: set-up in scoring mode, then the
    method's `predict` on the rows some passive party holds. Returns (ids, outputs)."""
    ids = ctx.method.table.ids
    ctx.setup(train_ids=ids, scoring=True)
    ids = ctx.held_rows(ids)
    return ids, np.asarray(ctx.method.predict(ctx, ids=ids))
