"""One round implementation: the three stages of every call, written once and moved by any
transport.

    active  `ActiveRound.call`  --call envelope-->  aggregator `AggregatorRound.open`
    party   `PartyRound.answer` --contribution-->   aggregator `AggregatorRound.accept`
    active  `ActiveRound.call`  <--result--         aggregator `AggregatorRound.result`

None of them touches a socket: the roles (`roles/active.py`, `roles/aggregator.py`,
`roles/party.py`) move envelopes over ZeroMQ (TCP between processes or inproc between threads),
and `securevfl.direct` moves the same envelopes in memory. So DP, the ledger, budgets, the
min_group rule and checkpoints are the same on every path.

Several rounds may be in flight ([network] pipeline_depth > 0, for a method that declares
`MethodSpec.tolerates_staleness`): the active party posts the forwards of the next batches
before a batch's sum returns (`ActiveRound.post` / `wait`), the aggregator routes each
contribution to its round by round id (`Aggregator._serve_pipelined`), and every party still
runs its calls one by one in round order, each checked here as its own call. A round's sums
combine only that round's contributions (its own masks).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from securevfl.config import RunConfig, env_switch
from securevfl.errors import RunAborted
from securevfl.methods import SumSpec, method_spec
from securevfl.roles import protocol as P
from securevfl.roles.checkpoint import epochs, load_checkpoint, save_checkpoint
from securevfl.roles.setup_rows import held_count
from securevfl.secure_sum import (
    ContributionError,
    GroupTooSmall,
    SumSession,
    backend,
    check_group,
    ckks_context_tag,
)
from transport import Envelope
from transport.errors import quote

Exchange = Callable[[Envelope], Envelope]


# ------------------------------------------------------------------------------------ calls


@dataclass(frozen=True)
class Call:
    """What the active party asks of the parties in one round."""

    op: str
    round: int
    session: str
    ids: np.ndarray
    args: Mapping[str, Any] = field(default_factory=dict)
    inputs: Mapping[str, np.ndarray] = field(default_factory=dict)
    sums: tuple[SumSpec, ...] = ()
    to: tuple[str, ...] = ()
    collect: tuple[str, ...] = ()

    def envelope(self, *, sender: str) -> Envelope:
        return Envelope(
            kind=P.CALL,
            sender=sender,
            session=self.session,
            round=self.round,
            tensors={"ids": np.asarray(self.ids, dtype=np.int64), **dict(self.inputs)},
            meta={
                "op": self.op,
                "args": dict(self.args),
                "to": list(self.to),
                "sums": [[s.key, s.tensor, list(s.group)] for s in self.sums],
                "collect": list(self.collect),
            },
        )


def parse_call(env: Envelope) -> Call:
    """The call an envelope carries; raises ValueError naming what is malformed."""
    meta = env.meta
    op, args = meta.get("op"), meta.get("args", {})
    to, collect, raw_sums = meta.get("to", []), meta.get("collect", []), meta.get("sums", [])
    if not isinstance(op, str) or not isinstance(args, dict):
        raise ValueError("a call needs a string op and a table of args")
    for what, value in (("to", to), ("collect", collect)):
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ValueError(f"a call's {what!r} must be a list of names")
    if "ids" not in env.tensors:
        raise ValueError("a call carries no sample ids")
    sums = []
    for item in raw_sums if isinstance(raw_sums, list) else [None]:
        ok = (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[0], str)
            and isinstance(item[1], str)
            and isinstance(item[2], list)
            and all(isinstance(g, str) for g in item[2])
        )
        if not ok:
            raise ValueError(f"malformed sum in a call: {item!r}")
        sums.append(SumSpec(key=item[0], tensor=item[1], group=tuple(item[2])))
    return Call(
        op=op,
        round=env.round,
        session=env.session,
        ids=np.asarray(env.tensors["ids"]),
        args=args,
        inputs={k: v for k, v in env.tensors.items() if k != "ids"},
        sums=tuple(sums),
        to=tuple(to),
        collect=tuple(collect),
    )


# ------------------------------------------------------------------------------------ fused calls

# A fused call is one envelope carrying several calls to the same parties, run by each party in
# order, each checked by its guard as its own call: the update of batch t (e.g. `backward`)
# rides ahead of the forward of batch t+1, saving one round trip per batch. The envelope is the
# last call; the earlier ones travel in meta[AHEAD] (their round, op, args and recipients; no
# sums, no clear collects: they are acknowledged only) with their tensors named
# ``ahead<i>:<name>``. The active party's tag covers the whole envelope, so every part's round,
# op, args and tensors are authenticated together.
AHEAD = "ahead"
MAX_AHEAD = 4
_AHEAD_TENSOR = re.compile(r"^ahead(\d+):(.+)$")


def _increasing(rounds: Sequence[int]) -> bool:
    return all(b > a for a, b in zip(rounds, rounds[1:], strict=False))


def fuse(calls: Sequence[Call], *, sender: str) -> Envelope:
    """One call envelope carrying `calls` in order (a single call: its own envelope). Raises
    ValueError for calls that cannot share an envelope: an earlier one with sums or clear
    collects, different recipients, rounds not strictly increasing."""
    *ahead, last = calls
    env = last.envelope(sender=sender)
    if not ahead:
        return env
    if len(ahead) > MAX_AHEAD:
        raise ValueError(f"at most {MAX_AHEAD} calls may ride ahead of one call")
    clash = [name for name in env.tensors if _AHEAD_TENSOR.match(name)]
    if clash:
        raise ValueError(f"call {last.op!r} has tensors named like fused calls: {clash}")
    if not _increasing([c.round for c in calls]):
        raise ValueError(f"fused calls need increasing rounds, not {[c.round for c in calls]}")
    parts = []
    for i, c in enumerate(ahead):
        if c.sums or c.collect:
            raise ValueError(
                f"{c.op!r} (round {c.round}) asks for sums or clear tensors: only the last call "
                "of a fused envelope may"
            )
        if sorted(c.to) != sorted(last.to):
            raise ValueError(
                f"{c.op!r} goes to {list(c.to)} and {last.op!r} to {list(last.to)}: only calls to "
                "the same parties share an envelope"
            )
        parts.append({"round": c.round, "op": c.op, "args": dict(c.args), "to": list(c.to)})
        env.tensors[f"{AHEAD}{i}:ids"] = np.asarray(c.ids, dtype=np.int64)
        for name, value in c.inputs.items():
            env.tensors[f"{AHEAD}{i}:{name}"] = value
    env.meta[AHEAD] = parts
    return env


def calls_of(env: Envelope) -> list[Call]:
    """The calls a call envelope carries, in the order they run (one unless fused); raises
    ValueError naming what is malformed."""
    raw = env.meta.get(AHEAD)
    if raw is None:
        return [parse_call(env)]
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_AHEAD:
        raise ValueError(f"a fused call carries 1..{MAX_AHEAD} earlier calls in {AHEAD!r}")
    own: dict[str, np.ndarray] = {}
    parts: list[dict[str, np.ndarray]] = [{} for _ in raw]
    for name, value in env.tensors.items():
        m = _AHEAD_TENSOR.match(name)
        if m is None:
            own[name] = value
        elif int(m.group(1)) < len(raw):
            parts[int(m.group(1))][m.group(2)] = value
        else:
            raise ValueError(f"tensor {name!r} belongs to no fused call")
    calls = []
    for i, (part, tensors) in enumerate(zip(raw, parts, strict=True)):
        if not isinstance(part, dict) or set(part) != {"round", "op", "args", "to"}:
            raise ValueError(f"fused call #{i} must hold exactly round, op, args and to")
        r = part["round"]
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"fused call #{i} has a malformed round {r!r}")
        meta = {"op": part["op"], "args": part["args"], "to": part["to"], "sums": [], "collect": []}
        calls.append(parse_call(_part(env, round=r, tensors=tensors, meta=meta)))
    meta = {k: v for k, v in env.meta.items() if k != AHEAD}
    main = parse_call(_part(env, round=env.round, tensors=own, meta=meta))
    calls.append(main)
    if not _increasing([c.round for c in calls]):
        raise ValueError(
            f"a fused call's rounds {[c.round for c in calls]} are not strictly increasing"
        )
    for c in calls[:-1]:
        if sorted(c.to) != sorted(main.to):
            raise ValueError(
                f"fused call {c.op!r} goes to {list(c.to)}, the envelope to {list(main.to)}"
            )
    return calls


def _part(env: Envelope, *, round: int, tensors: dict, meta: dict) -> Envelope:
    return Envelope(
        kind=env.kind,
        sender=env.sender,
        session=env.session,
        round=round,
        tensors=tensors,
        meta=meta,
    )


def first_round(env: Envelope) -> int:
    """The earliest round a call envelope carries (its own unless fused): what a replay check
    compares with the last round served."""
    raw = env.meta.get(AHEAD)
    if isinstance(raw, list) and raw and isinstance(raw[0], dict):
        r = raw[0].get("round")
        if isinstance(r, int) and not isinstance(r, bool):
            return min(r, env.round)
    return env.round


def sum_arrays(tensors: Mapping[str, np.ndarray], key: str) -> dict[str, np.ndarray]:
    """The arrays of sum `key` among a message's tensors (``key`` or ``key/<chunk>``)."""
    return {k: v for k, v in tensors.items() if k == key or k.startswith(key + "/")}


# ------------------------------------------------------------------------------------ party


class PartyRound:
    """A passive party's stage of every round: set-up, checkpoints and the method's operations,
    each contribution passed through embedding DP and protected for its sum."""

    def __init__(
        self,
        *,
        cfg: RunConfig,
        name: str,
        method: Any,
        run_dir: Path,
        ledger: Any,
        logger: logging.Logger,
        session: bytes,
        mask_keypair: Any,
        mask_publics: Mapping[str, bytes],
        ckks_zeros: str | None = None,
        ckks_zero_helper: Any = None,
        scoring: bool = False,
    ) -> None:
        """`ckks_zeros`: how a CKKS sum stage makes its encryptions of zero ahead
        (`securevfl.secure_sum.ZERO_MODES`); None: the in-process default. `ckks_zero_helper`:
        a helper process started early for it (`securevfl.secure_sum.start_zero_helper`).
        `scoring`: the party was started to score rows (`CallGuard`'s `scoring`)."""
        from securevfl.roles.guard import CallGuard, TableRowKeys

        self.cfg = cfg
        self.name = name
        self.method = method
        self.ckks_zeros = ckks_zeros
        self.ckks_zero_helper = ckks_zero_helper
        # every call is checked before anything is computed or released
        self.guard = CallGuard(
            cfg=cfg,
            name=name,
            spec=method_spec(cfg.method),
            session=session,
            keypair=mask_keypair,
            active_public=mask_publics[cfg.active_name],
            keyed=TableRowKeys(method.table),  # which rows it holds, and their keys
            scoring=scoring,
        )
        self.run_dir = Path(run_dir)
        self.ledger = ledger
        self.logger = logger
        self.session = session
        self.mask_keypair = mask_keypair
        self.mask_publics = dict(mask_publics)
        self.stage: Any = None
        self.privacy: Any = None
        self.received: Any = None
        self._single_sums: set[tuple[str, str, int]] = set()
        self.told_rows: Any = None  # set-up's rows received part by part (`setup_rows`)
        # the run's own state that checkpoint calls are held to (see `_epoch_of`)
        self.committed_epoch = -1
        self.calls_since_commit = 0
        # what a caller may watch (the direct path's test kit): (spec, the released value)
        self.observe: Callable[[SumSpec, np.ndarray], None] | None = None
        self.overlap = overlaps_sums(cfg)
        self._widths: dict[tuple[str, str], int] = {}  # values per row of each op's sums
        self._digest_views: dict = {}  # what `model_digest` reuses: its plan, byte views
        self.device_time: Any = None  # a `DeviceClock` where the models run on a GPU

    def answer(self, env: Envelope) -> Envelope:
        """The contribution envelope answering call `env`. Raises `PolicyRefusal` (nothing
        computed, nothing released) for a call the guard refuses."""
        started = time.perf_counter()
        try:
            self.guard.authenticate(
                env.meta, session=env.session, round=env.round, tensors=env.tensors
            )
            try:
                calls = calls_of(env)
            except ValueError as exc:
                raise self.guard.refuse("malformed call", str(exc)) from None
            self.guard.check_fused(calls)
        finally:
            self.guard.seconds += time.perf_counter() - started
        # a fused envelope's calls run in order, each checked as its own call right before it
        # runs (after the previous one's update): exactly as if they had come one by one
        tensors: dict[str, np.ndarray] = {}
        shapes: dict[str, list[int]] = {}
        for call in calls:
            self.method.call_round = call.round  # what a method keys per-call state by
            self._check(call)
            if call.op == P.OP_SETUP:
                tensors.update(self._setup(call))
            elif call.op in (P.OP_SETUP_ROWS, P.OP_SETUP_PRESENT):
                tensors.update(self._setup_rows(call))
            elif call.op == P.OP_CHECKPOINT:
                tensors.update(self._checkpoint(call))
            else:
                out, sizes = self._operation(call)
                tensors.update(out)
                shapes.update(sizes)
                self.calls_since_commit += 1
            self.guard.after(call, digest=self._model_digest)
        return self._reply(calls[-1], tensors, shapes)

    def _model_digest(self) -> bytes | None:
        """The version of what this party contributes: its model's weights. Not its data file:
        a row is filed under its id and its values whichever file holds it (`guard.row_keys`;
        `securevfl predict` writes the rows it scores to a file of its own each time, and a
        version per file would let each predict session difference against training's sums
        of the same rows)."""
        from securevfl.roles.guard import model_digest

        return model_digest(self.method, views=self._digest_views)

    def _check(self, call: Call) -> None:
        """The guard's checks and the method's own rule on one call, before it runs."""
        started = time.perf_counter()
        try:
            self.guard.check(call)
            if call.op not in P.SETUP_OPS and call.op != P.OP_CHECKPOINT:
                reason = self.method.check_call(
                    call.op,
                    ids=call.ids,
                    args=call.args,
                    inputs=call.inputs,
                    groups=[s.group for s in call.sums if self.name in s.group],
                )
                if reason is not None:
                    raise self.guard.refuse("method", reason)
        finally:
            self.guard.seconds += time.perf_counter() - started

    def _reply(self, call: Call, tensors: dict, shapes: dict) -> Envelope:
        return Envelope(
            kind=P.CONTRIB,
            sender=self.name,
            session=call.session,
            round=call.round,
            tensors=tensors,
            meta={"shapes": shapes},
        )

    def _setup(self, call: Call) -> dict[str, np.ndarray]:
        from securevfl.privacy.runtime import ReceivedGradients, RolePrivacy, plan_role

        inputs = call.inputs
        announced = call.args.get("rows")
        if announced is not None:  # the rows came before, part by part (a streamed table)
            inputs = {**inputs, **self._rows_told(call, announced)}
        resume_epoch = self._resume_epoch_of(call)
        scoring = bool(call.args.get("predict", False))
        saved = (
            load_checkpoint(self.run_dir, self.name, resume_epoch) if resume_epoch >= 0 else None
        )
        if scoring:  # a trained model scoring new rows: its own encoding, no fitting
            if saved is None:
                raise RunAborted(f"{self.name}: nothing to score with: no trained checkpoint")
            self.method.table.use_encoding(saved.get("encoding"))
        else:  # text columns are encoded on the training rows this party holds, here, once
            self.method.table.prepare(np.asarray(inputs["train_ids"]))
        # N = the training rows this party holds: DP-SGD's sample rate B/N (and delta < 1/N)
        # must not count rows the party never trains on
        held = held_count(self.method.table, inputs["train_ids"])
        plan = plan_role(self.cfg, role=self.name, n_train=held or len(inputs["train_ids"]))
        self.privacy = RolePrivacy(plan=plan, ledger=self.ledger)
        self.privacy.set_rows(inputs["all_ids"])
        self.method.privacy = self.privacy
        if self.cfg.record_received:
            self.received = ReceivedGradients(self.run_dir / "received" / f"{self.name}.npz")
        if self.cfg.aggregation == "plain" and plan.embedding_dp is None:
            self.privacy.record_unprotected_once(
                what="representations sent to sums",
                reason="aggregation = plain: the aggregator and the active party see each "
                "contribution in the clear",
            )
        self.method.setup(args=call.args, inputs=inputs)
        ckks = inputs.get("ckks_context")
        if ckks is not None:
            self._check_context_tag(ckks.tobytes(), call.args.get("ckks_tags", {}))
        self.stage = backend(self.cfg.aggregation).party(
            SumSession(
                name=self.name,
                session=self.session,
                min_group=self.cfg.min_group,
                frac_bits=self.cfg.frac_bits,
                bound=self.cfg.bound,
                mask_keypair=self.mask_keypair,
                mask_publics=self.mask_publics,
                ckks_public_context=None if ckks is None else ckks.tobytes(),
                ckks_zeros=self.ckks_zeros,
                ckks_zero_helper=self.ckks_zero_helper,
            )
        )
        if saved is not None:
            state = saved
            if state.get("encoding") != self.method.table.encoding_state():
                raise RunAborted(
                    f"{self.name}: the encoding of its text columns differs from the checkpoint "
                    f"of epoch {resume_epoch}: its data file changed; resume with the same data"
                )
            self.method.load_state_dict(state["method"])
            self.logger.info("resumed from the checkpoint of epoch %d", resume_epoch)
        self.privacy.epoch = resume_epoch + 1
        self.committed_epoch, self.calls_since_commit = resume_epoch, 0
        # the differencing rule across sessions: the sums of this model's version so far
        self.guard.attach(self.run_dir / "guard" / f"{self.name}-families.log", self._model_digest)
        if announced is not None:  # answered part by part (setup.present)
            return {}
        # which of the active party's rows this party holds (what a PSI would tell it)
        return {f"present@{self.name}": self.method.table.has(inputs["all_ids"])}

    def _rows_told(self, call: Call, announced: Any) -> dict[str, np.ndarray]:
        """The training and all ids that set-up announces, as received part by part."""
        from securevfl.roles.setup_rows import RowsRefused

        if "train_ids" in call.inputs or "all_ids" in call.inputs:
            raise self.guard.refuse("setup rows", "set-up sends its ids and announces parts too")
        try:
            if self.told_rows is None:
                raise RowsRefused(f"set-up announces {announced!r} but no part was received")
            train_ids, all_ids = self.told_rows.finish(announced)
        except RowsRefused as exc:
            raise self.guard.refuse("setup rows", str(exc)) from None
        return {"train_ids": train_ids, "all_ids": all_ids}

    def _setup_rows(self, call: Call) -> dict[str, np.ndarray]:
        """setup.rows: keep a part of the rows set-up will announce; setup.present: answer
        which ids of a part this party holds (only after set-up ran on them)."""
        from securevfl.roles.setup_rows import ReceivedRows, RowsRefused, party_arrays

        part = call.args.get("part")
        try:
            if call.op == P.OP_SETUP_PRESENT:
                if self.told_rows is None:
                    raise RowsRefused("setup.present before any setup.rows part")
                ids = self.told_rows.part(part)
                return {f"present@{self.name}": self.method.table.has(ids)}
            if part == 0 or self.told_rows is None:  # a new set-up starts with part 0
                arrays = party_arrays(self.method.table, self.run_dir / "rows")
                self.told_rows = ReceivedRows(arrays)
            self.told_rows.add(
                part, np.asarray(call.inputs["all_ids"]), np.asarray(call.inputs["train_bits"])
            )
        except KeyError as exc:
            raise self.guard.refuse("setup rows", f"setup.rows carries no {exc}") from None
        except RowsRefused as exc:
            raise self.guard.refuse("setup rows", str(exc)) from None
        return {}

    def _checkpoint(self, call: Call) -> dict[str, np.ndarray]:
        epoch = self._epoch_of(call)
        # the encoding travels with the model: scoring new rows needs the same mapping
        state = {"method": self.method.state_dict(), "encoding": self.method.table.encoding_state()}
        save_checkpoint(self.run_dir, self.name, epoch, state)
        self.guard.checkpointed(epoch, epochs(self.run_dir, self.name))
        self.privacy.epoch = epoch + 1
        self.committed_epoch, self.calls_since_commit = epoch, 0
        if self.received is not None:
            self.received.save()
        return {}

    def _epoch_of(self, call: Call) -> int:
        """The epoch a checkpoint call names, held to this party's own state before any file is
        written or pruned (the newest two are kept, so an epoch far ahead would delete the real
        ones): not before the last committed epoch (the same one again is a retry), and not
        further ahead than one epoch per call served since then, plus one."""
        epoch = call.args.get("epoch")
        low = self.committed_epoch
        high = self.committed_epoch + 1 + self.calls_since_commit
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not low <= epoch <= high:
            raise self.guard.refuse(
                "checkpoint epoch",
                f"a checkpoint of epoch {quote(epoch)}: this party committed epoch {low} and "
                f"served {self.calls_since_commit} calls since, so it accepts epochs "
                f"{max(low, 0)}..{high}; nothing was written",
            )
        return epoch

    def _resume_epoch_of(self, call: Call) -> int:
        """The epoch set-up resumes from: -1 (a fresh start) or one this party has a
        checkpoint of; nothing else reaches a file name."""
        resume = call.args.get("resume_epoch", -1)
        have = epochs(self.run_dir, self.name)
        ok = isinstance(resume, int) and not isinstance(resume, bool)
        if not ok or (resume != -1 and resume not in have):
            raise self.guard.refuse(
                "resume epoch",
                f"set-up resumes from epoch {quote(resume)}, but this party has checkpoints of "
                f"epochs {have[-5:]}; resume every role from the same run directory",
            )
        return resume

    def _check_context_tag(self, context: bytes, tags: Mapping[str, str]) -> None:
        active = self.cfg.active_name
        expected = ckks_context_tag(
            context=context,
            my_keypair=self.mask_keypair,
            me=self.name,
            peer=active,
            peer_public=self.mask_publics[active],
            session=self.session,
        )
        import hmac

        tag = tags.get(self.name) if isinstance(tags, Mapping) else None
        try:
            given = bytes.fromhex(tag) if isinstance(tag, str) else b""
        except ValueError:  # not hex: no tag
            given = b""
        if not hmac.compare_digest(given, expected):
            raise RunAborted(
                "the CKKS public context failed authentication: it was not sent by the active "
                f"party {active!r} (the aggregator or the network altered it); refusing to encrypt"
            )

    def _record_single_sum(self, op: str, spec: SumSpec) -> None:
        """A secure sum with one contributor is that contribution: say so in the ledger, once
        per sum and epoch (only when embedding DP does not protect it)."""
        if self.cfg.aggregation == "plain" or self.privacy.plan.embedding_dp is not None:
            return
        seen = (op, spec.key, self.privacy.epoch)
        if seen in self._single_sums:
            return
        self._single_sums.add(seen)
        self.privacy.ledger.record_unprotected(
            role=self.name,
            what=f"sum {spec.key!r} of {op!r} with this party alone",
            reason="[run] min_group = 1: a sum with a single contributor is that party's "
            "contribution, revealed to the active party",
            epoch=self.privacy.epoch,
        )

    def _expect(self, call: Call, specs: Sequence[SumSpec]) -> None:
        """Announce to the sum stage the sums this call will contribute to, sized as the same
        op's last call per row, so their value-independent work (mask keystreams) runs on
        another thread while the method computes. Nothing is sent; a wrong guess is dropped."""
        rows = len(call.ids)
        expected = [
            (call.round, spec.group, spec.key, self._widths[(call.op, spec.key)] * rows)
            for spec in specs
            if (call.op, spec.key) in self._widths
        ]
        if expected:
            self.stage.expect(expected)

    def _operation(self, call: Call) -> tuple[dict[str, np.ndarray], dict[str, list[int]]]:
        if self.stage is None:
            raise RuntimeError(f"call {call.op!r} before setup")
        if self.received is not None and call.op == "backward":
            self.received.add(call.inputs, ids=call.ids, epoch=self.privacy.epoch)
        specs = [spec for spec in call.sums if self.name in spec.group]
        rows = len(call.ids)
        if self.overlap:
            self._expect(call, specs)
        clock = self.device_time
        with clock.span(call.op) if clock is not None else contextlib.nullcontext():
            out = self.method.handle(call.op, ids=call.ids, args=call.args, inputs=call.inputs)
        for spec in specs:
            if spec.tensor not in out:
                raise RuntimeError(
                    f"method {self.cfg.method!r} did not produce tensor {spec.tensor!r} for "
                    f"{call.op!r}"
                )
        # embedding DP: once per call (the call's tensors clipped jointly per row), before
        # masking or encryption; a noised tensor then feeds every sum it is part of for free
        contributions = {t: np.asarray(out[t]) for t in dict.fromkeys(s.tensor for s in specs)}
        released = self.privacy.release_contributions(contributions, ids=call.ids)
        tensors: dict[str, np.ndarray] = {}
        shapes: dict[str, list[int]] = {}
        for spec in specs:
            value = released[spec.tensor]
            if len(spec.group) == 1:
                self._record_single_sum(call.op, spec)
            if self.observe is not None:
                self.observe(spec, value)
            tensors.update(
                self.stage.protect(
                    value,
                    round=call.round,
                    group=spec.group,
                    key=spec.key,
                    call=self.guard.binding,
                )
            )
            shapes[spec.key] = list(np.shape(value))
            if rows and np.size(value) % rows == 0:
                self._widths[(call.op, spec.key)] = int(np.size(value)) // rows
        op = method_spec(self.cfg.method).operation(call.op)
        for name in call.collect:  # declared clear and allowed by the policy (the guard checked)
            self.privacy.record_unprotected_once(
                what=f"{call.op}.{name} in the clear to the active party",
                reason=op.release_of(name).why or "a clear release the policy allows",
            )
            tensors[f"{name}@{self.name}"] = np.asarray(out[name])
        return tensors, shapes


# ------------------------------------------------------------------------------------ aggregator


class AggregatorRound:
    """The aggregator's stage of every round: check the call, accept each contribution as it
    arrives (a malformed one is rejected alone), add exactly each group's, forward sums only."""

    def __init__(self, *, cfg: RunConfig, session: bytes) -> None:
        self.cfg = cfg
        self.session = session
        self.parties = set(cfg.party_names)
        self.stage: Any = None

    def open(self, env: Envelope) -> Call:
        """Validate a call from the active party; returns it. Raises `RunAborted` for a call
        that names unknown parties or a group the aggregation does not allow."""
        try:
            call = calls_of(env)[-1]  # any calls ahead of it go to the same parties, no sums
        except ValueError as exc:
            raise RunAborted(f"malformed call from the active party: {exc}") from None
        unknown = sorted(set(call.to) - self.parties)
        if unknown or len(set(call.to)) != len(call.to):
            raise RunAborted(f"call names unknown or repeated parties {unknown or list(call.to)}")
        for spec in call.sums:
            outside = sorted(set(spec.group) - set(call.to))
            if outside:
                raise RunAborted(f"sum {spec.key!r} names parties {outside} not in the call")
            try:
                check_group(self.cfg, spec.group, key=spec.key, what=f"aggregator, op {call.op!r}")
            except GroupTooSmall as exc:
                raise RunAborted(str(exc)) from None
        if call.op == P.OP_SETUP:
            ckks = call.inputs.get("ckks_context")
            self.stage = backend(self.cfg.aggregation).aggregator(
                SumSession(
                    name="aggregator",
                    session=self.session,
                    min_group=self.cfg.min_group,
                    frac_bits=self.cfg.frac_bits,
                    bound=self.cfg.bound,
                    ckks_public_context=None if ckks is None else ckks.tobytes(),
                )
            )
        return call

    def accept(self, call: Call, reply: Envelope) -> dict[str, Any]:
        """Validate every array a party sent for this round before any of it is used; returns
        sum key -> the accepted contribution. Raises `ContributionError` (or ValueError)."""
        mine = [s for s in call.sums if reply.sender in s.group]
        expected = {s.key for s in mine}
        for name in reply.tensors:
            base = name.split("/", 1)[0]
            if base not in expected and not name.endswith(f"@{reply.sender}"):
                raise ContributionError(f"unexpected tensor {name!r}")
        return {
            spec.key: self.stage.accept(
                sum_arrays(reply.tensors, spec.key), key=spec.key, sender=reply.sender
            )
            for spec in mine
        }

    def result(
        self,
        call: Call,
        replies: Mapping[str, Envelope],
        accepted: Mapping[str, Mapping[str, Any]],
    ) -> Envelope:
        """The result envelope: each group's sum (and clear tensors named ``name@party``)."""
        tensors: dict[str, np.ndarray] = {}
        shapes: dict[str, Any] = {}
        for spec in call.sums:
            by_shape: dict[tuple[int, ...], list[str]] = {}
            for p in spec.group:
                if p in replies:
                    by_shape.setdefault(tuple(_shape_of(replies[p], spec.key)), []).append(p)
            if len(by_shape) != 1:
                sent = "; ".join(f"{members} {list(shape)}" for shape, members in by_shape.items())
                raise RunAborted(
                    f"round {call.round}, sum {spec.key!r}: its members sent contributions of "
                    f"different shapes ({sent}): a party's method or data differs from the "
                    "others' (check that every role runs the same config and code); resume "
                    "from the last checkpoint once it is fixed"
                )
            (shape,) = by_shape
            try:
                tensors.update(
                    self.stage.combine_accepted(accepted[spec.key], group=spec.group, key=spec.key)
                )
            except (ContributionError, ValueError) as exc:
                raise RunAborted(f"round {call.round}, sum {spec.key!r}: {exc}") from None
            shapes[spec.key] = list(shape)
        for party, reply in replies.items():
            for k, v in reply.tensors.items():
                if "@" in k:
                    if k.rsplit("@", 1)[1] != party:
                        raise RunAborted(f"{party} sent {k!r}, which claims another sender")
                    tensors[k] = v
        return Envelope(
            kind=P.RESULT,
            sender="aggregator",
            session=call.session,
            round=call.round,
            tensors=tensors,
            meta={"shapes": shapes},
        )

    @staticmethod
    def refused(call: Call, reasons: Mapping[str, str]) -> Envelope:
        """The result telling the active party that parties refused the round's call."""
        return Envelope(
            kind=P.RESULT,
            sender="aggregator",
            session=call.session,
            round=call.round,
            meta={"refused": dict(reasons), "shapes": {}},
        )

    @staticmethod
    def lost(
        call: Call, lost: Sequence[str], *, delivered: bool, late: Sequence[str] = ()
    ) -> Envelope:
        """The result telling the active party that the round failed because `lost` are gone
        (or `late` missed its deadline but stay in the run: `readmits_late`); `delivered`: the
        call had reached every recipient (the others have run it)."""
        meta: dict[str, Any] = {"lost": list(lost), "shapes": {}, "delivered": delivered}
        if late:
            meta["late"] = list(late)
        return Envelope(
            kind=P.RESULT, sender="aggregator", session=call.session, round=call.round, meta=meta
        )


def _shape_of(reply: Envelope, key: str) -> list[int]:
    shapes = reply.meta.get("shapes", {})
    shape = shapes.get(key, ()) if isinstance(shapes, dict) else ()
    if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise RunAborted(f"{reply.sender} sent a malformed shape for sum {key!r}: {shape!r}")
    return list(shape)


def overlaps_sums(cfg: RunConfig) -> bool:
    """Whether a passive party starts each call's value-independent secure-sum work (the mask
    keystreams) on a worker thread before its method computes the values, so that a CPU thread
    makes keystreams while a GPU computes: SECUREVFL_OVERLAP_SUMS=1 turns it on. Off by
    default: on an H100 with Credit's split-NN (hidden [64] and [1024, 1024]) it gained nothing
    (0.98-1.09x the epoch time without it, bench/results/gpu_h100_2026-11-24): a call's
    GPU work is a fraction of a millisecond and launching it is CPU-bound, so the keystream
    thread competes with the launching thread. What is sent is bit-identical either way."""
    return env_switch("SECUREVFL_OVERLAP_SUMS", default=False)


def tolerates_dropout(cfg: RunConfig) -> bool:
    """Whether the run's method goes on without a party that died (its declaration says)."""
    return method_spec(cfg.method).tolerates_dropout


def readmits_late(cfg: RunConfig) -> bool:
    """Whether the run's method keeps a party that missed a round's deadline (alive, slow): it
    misses that round only and is called again in the next (TabVFL serves it from its failure
    cache meanwhile). A spec declares it with ``readmits_late = True`` next to
    `tolerates_dropout`; the others drop such a party (or stop, if they tolerate no dropout)."""
    return method_spec(cfg.method).readmits_late
