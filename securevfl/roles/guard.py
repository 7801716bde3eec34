"""The passive party protects itself: every call is checked here before the party computes or
releases anything.

* **Authenticated end to end.** The active party tags each call for each recipient with an
  HMAC-SHA256 under a key derived from their pinned X25519 masking keys and the session
  (`call_tags`), over everything the call says: op, round, recipients, sums and their groups,
  clear collects, args, and digests of the ids and of every input tensor. The aggregator holds
  no such key: a call it changed, replayed from another session or invented fails
  (`CallGuard.authenticate`); a replay within the session fails the round check.
* **Declared.** The op must be one the method declares (`MethodSpec.operations`) or a role
  operation; a sum may carry only a tensor the op declares as summed; a clear collect only a
  tensor the op declares as clear *and* the party's policy allows; inputs only declared ones.
* **Groups of passive data owners.** Every group this party contributes to names distinct
  passive parties of the party's own config, includes the party, and has at least the policy's
  `min_group` of them; the active party and the aggregator never count.
* **No differencing within a model version.** For each row, the sums a party contributes the
  same value to (same tensor, no model update in between) must not combine linearly into a sum
  over fewer than `min_group` passive parties (`FamilyGuard`). With embedding DP each call's
  contribution carries fresh noise, so only the sums of one call are checked together.

A refusal is a `PolicyRefusal` naming the rule; the party records it in the ledger and either
stops cleanly or refuses the call and keeps serving (`on_refusal`); it never releases.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from crypto import MaskingKeyPair, pair_key
from securevfl.config import RunConfig, policy_refusal
from securevfl.errors import PolicyRefusal
from securevfl.methods import MethodSpec
from securevfl.roles import protocol as P
from securevfl.secure_sum import isolating_set

AUTH_INFO = b"securevfl/call-auth/v1"


# ------------------------------------------------------------------------------------ tags


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not plain data: {type(value).__name__}")


def _digest(array: np.ndarray) -> bytes:
    a = np.ascontiguousarray(array)
    h = hashlib.sha256(f"{a.dtype.str}|{a.shape}|".encode())
    h.update(a.data)
    return h.digest()


def call_digest(
    env_meta: Mapping[str, Any], *, session: str, round: int, tensors: Mapping
) -> bytes:
    """The bytes a call's tags cover: its meta (auth tags left out; msgpack, whose encoding the
    transport preserves key order for), session, round, and the digests of its tensors (ids
    included)."""
    meta = {k: v for k, v in env_meta.items() if k != "auth"}
    parts = [
        session.encode(),
        int(round).to_bytes(8, "big", signed=True),
        msgpack.packb(meta, default=_plain, use_bin_type=True),
    ]
    for name in sorted(tensors):
        parts += [name.encode(), _digest(tensors[name])]
    return b"\x00".join(length_prefixed(p) for p in parts)


def length_prefixed(part: bytes) -> bytes:
    return len(part).to_bytes(4, "big") + part


def auth_key(
    *, keypair: MaskingKeyPair, me: str, peer: str, peer_public: bytes, session: bytes
) -> bytes:
    """The call-authentication key of the pair (active party, party): only those two can derive
    it from their pinned masking keys."""
    base = pair_key(
        my_private=keypair.private, peer_public=peer_public, session=session, me=me, peer=peer
    )
    return hmac.digest(base, AUTH_INFO, "sha256")


def call_tag(key: bytes, digest: bytes) -> str:
    return hmac.digest(key, digest, "sha256").hex()


# ------------------------------------------------------------------------------------ families


class FamilyGuard:
    """Per tensor and model version, the groups the rows' values have been summed over: a row's
    family is the groups of every call that summed it.

    Kept as disjoint blocks of sorted row ids, each row with the index of its family (families
    are deduplicated), merged like a binary counter (a block is merged into the one before it
    while that one is at most twice its size), so there are O(log n) blocks for n rows. A call
    of k rows then costs O(k log n) look-ups and amortised O(log n) per row to store: an
    evaluation of a million rows in 4096-row calls is linear in the rows, not quadratic."""

    def __init__(self, *, min_group: int) -> None:
        self.min_group = min_group
        self._tensors: dict[str, _Families] = {}

    def new_version(self) -> None:
        self._tensors.clear()

    def admit(self, tensor: str, ids: np.ndarray, groups: Iterable[frozenset[str]]) -> str | None:
        """Add `groups` to the family of every row of `ids` for `tensor`; returns a reason
        (and records nothing) if some row's family would isolate fewer than min_group
        parties."""
        ids = np.asarray(ids, dtype=np.int64)
        groups = tuple(dict.fromkeys(groups))
        known = self._tensors.setdefault(tensor, _Families())
        found = known.find(ids)  # (block, positions in it, mask over ids) per block hit
        which = np.zeros(len(ids), dtype=np.int64)  # each row's family (0: none yet)
        for b, positions, hit in found:
            which[hit] = known.blocks[b][1][positions]
        grown: dict[int, int] = {}  # old family -> old family + groups
        for old in np.unique(which).tolist():
            family = tuple(dict.fromkeys(known.families[old] + groups))
            isolated = isolating_set(family, self.min_group)
            if isolated is not None:
                row = int(ids[np.argmax(which == old)])
                sums = " ".join("{" + ",".join(sorted(g)) + "}" for g in family)
                version = " (one model version)" if old else ""
                return (
                    f"row {row}: the sums {sums} of tensor {tensor!r}{version} combine into "
                    f"the contribution of {list(isolated)} alone"
                )
            grown[old] = known.index(family)
        lookup = np.arange(len(known.families), dtype=np.int64)
        lookup[list(grown)] = list(grown.values())
        for b, positions, _ in found:
            block_families = known.blocks[b][1]
            block_families[positions] = lookup[block_families[positions]]
        new = np.ones(len(ids), dtype=bool)
        for _, _, hit in found:
            new &= ~hit
        if new.any():
            known.add(np.unique(ids[new]), grown[0])
        return None


class _Families:
    """One tensor's rows and their families for `FamilyGuard`: `families[0]` is the empty one;
    `blocks` are disjoint (sorted ids, family index per id), each no larger than half of the
    one before it but for the binary-counter slack."""

    def __init__(self) -> None:
        self.families: list[tuple[frozenset[str], ...]] = [()]
        self._numbers: dict[tuple[frozenset[str], ...], int] = {(): 0}
        self.blocks: list[tuple[np.ndarray, np.ndarray]] = []

    def index(self, family: tuple[frozenset[str], ...]) -> int:
        number = self._numbers.get(family)
        if number is None:
            number = self._numbers[family] = len(self.families)
            self.families.append(family)
        return number

    def find(self, ids: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        out = []
        for b, (rows, _) in enumerate(self.blocks):
            pos = np.searchsorted(rows, ids)
            hit = rows[np.minimum(pos, len(rows) - 1)] == ids
            if hit.any():
                out.append((b, pos[hit], hit))
        return out

    def add(self, rows: np.ndarray, family: int) -> None:
        """Store `rows` (sorted, unique, in no block yet) with `family`, merging blocks."""
        self.blocks.append((rows, np.full(len(rows), family, dtype=np.int64)))
        while len(self.blocks) > 1 and len(self.blocks[-2][0]) <= 2 * len(self.blocks[-1][0]):
            (a, fa), (b, fb) = self.blocks[-2], self.blocks.pop()
            ids = np.concatenate([a, b])
            order = np.argsort(ids, kind="stable")
            self.blocks[-1] = (ids[order], np.concatenate([fa, fb])[order])


# ------------------------------------------------------------------------------------ the guard


class CallGuard:
    """A passive party's checks on every call (see the module docstring)."""

    def __init__(
        self,
        *,
        cfg: RunConfig,
        name: str,
        spec: MethodSpec,
        session: bytes,
        keypair: MaskingKeyPair,
        active_public: bytes,
    ) -> None:
        self.cfg = cfg
        self.name = name
        self.spec = spec
        self.policy = cfg.party(name).policy
        self.session_hex = session.hex()
        self.key = auth_key(
            keypair=keypair,
            me=name,
            peer=cfg.active_name,
            peer_public=active_public,
            session=session,
        )
        self.passive = frozenset(cfg.party_names)
        secure = cfg.aggregation != "plain"
        self.families = FamilyGuard(min_group=self.policy.min_group) if secure else None
        self.fresh_noise = cfg.party(name).embedding_dp is not None
        self.seconds = 0.0  # time spent checking calls (reported with the party's stats)

    def refuse(self, rule: str, detail: str) -> PolicyRefusal:
        return PolicyRefusal(self.name, rule, detail)

    def check_run(self) -> None:
        """Before anything: the party's own policy accepts the run its own config describes."""
        refused = policy_refusal(self.cfg, self.policy, self.spec)
        if refused is not None:
            raise self.refuse(f"policy {refused[0]}", refused[1])

    def authenticate(
        self, meta: Mapping[str, Any], *, session: str, round: int, tensors: Mapping
    ) -> None:
        tags = meta.get("auth")
        tag = tags.get(self.name) if isinstance(tags, dict) else None
        if session != self.session_hex:
            raise self.refuse("authentication", f"a call of another session ({session[:12]}...)")
        expected = call_tag(
            self.key, call_digest(meta, session=session, round=round, tensors=tensors)
        )
        if not isinstance(tag, str) or not hmac.compare_digest(tag, expected):
            raise self.refuse(
                "authentication",
                f"round {round}: the call's tag does not match: it was not sent as is by the "
                f"active party {self.cfg.active_name!r} (changed, replayed from elsewhere or "
                "invented on the way)",
            )

    def check(self, call: Any) -> None:
        """Refuse (`PolicyRefusal`) a call this party must not answer."""
        if self.name not in call.to:
            raise self.refuse("recipients", f"a call for {list(call.to)} reached {self.name!r}")
        if call.op == P.OP_SETUP:
            return self._check_setup(call)
        if call.op == P.OP_SETUP_ROWS:  # a part of a streamed table's rows, before set-up
            return self._check_setup(call, inputs=("all_ids", "train_bits"), collects=())
        if call.op == P.OP_SETUP_PRESENT:  # which rows of a part it holds, after set-up
            return self._check_setup(call, inputs=(), collects=("present",))
        if call.op == P.OP_CHECKPOINT:
            return self._check_plain_call(call, inputs=(), collects=())
        op = self.spec.operation(call.op)
        if op is None:
            declared = [o.name for o in self.spec.operations]
            raise self.refuse(
                "undeclared operation",
                f"method {self.spec.name!r} declares {declared}, not {call.op!r}",
            )
        for name in call.inputs:
            if not op.accepts_input(name):
                raise self.refuse(
                    "undeclared input", f"{call.op!r} takes no input {name!r} ({list(op.inputs)})"
                )
        for name in call.collect:
            release = op.release_of(name)
            if release is None or release.to != "clear":
                raise self.refuse(
                    "clear release",
                    f"{call.op}.{name} in the clear: the method does not declare it as a clear "
                    "release (what it declares may only go into secure sums)",
                )
            if not any(
                fnmatch.fnmatchcase(f"{call.op}.{name}", p) for p in self.policy.clear_releases
            ):
                raise self.refuse(
                    "clear release",
                    f"{call.op}.{name} in the clear: this party's policy does not allow it "
                    "(clear_releases)",
                )
        mine = [s for s in call.sums if self.name in s.group]
        for s in mine:
            release = op.release_of(s.tensor)
            if release is None or release.to != "sum":
                raise self.refuse(
                    "undeclared sum", f"{call.op!r} declares no summed tensor {s.tensor!r}"
                )
            self._check_group(s.group, s.key)
        if self.families is not None and mine:
            if self.fresh_noise:  # fresh embedding-DP noise per call: only this call's sums
                self.families.new_version()
            by_tensor: dict[str, list[frozenset[str]]] = {}
            for s in mine:
                by_tensor.setdefault(s.tensor, []).append(frozenset(s.group))
            for tensor, groups in by_tensor.items():
                reason = self.families.admit(tensor, call.ids, groups)
                if reason is not None:
                    raise self.refuse("differencing", reason)

    def check_fused(self, calls: Sequence[Any]) -> None:
        """A fused envelope (several calls run in order) may carry only consecutive calls the
        method declares may share one (`MethodSpec.fuse`), never a role operation; each is then
        checked as its own call by `check` right before it runs."""
        if len(calls) < 2:
            return
        for a, b in zip(calls, calls[1:], strict=False):
            if (a.op, b.op) not in self.spec.fuse:
                declared = [f"{u} then {n}" for u, n in self.spec.fuse] or "none"
                raise self.refuse(
                    "fused call",
                    f"{a.op!r} then {b.op!r} in one envelope: method {self.spec.name!r} lets "
                    f"only {declared} share one; nothing was run",
                )

    def after(self, call: Any) -> None:
        """Note a model update: sums after it are of a new model version."""
        op = self.spec.operation(call.op)
        if self.families is not None and op is not None and op.updates:
            self.families.new_version()

    def _check_group(self, group: Sequence[str], key: str) -> None:
        members = list(group)
        if len(set(members)) != len(members):
            raise self.refuse("group", f"sum {key!r} lists a member twice: {members}")
        outsiders = [m for m in members if m not in self.passive]
        if outsiders:
            raise self.refuse(
                "group",
                f"sum {key!r} names {outsiders}, which are not passive parties of this "
                "federation: only passive data owners count towards a group",
            )
        if self.cfg.aggregation != "plain" and len(members) < self.policy.min_group:
            raise self.refuse(
                "min_group",
                f"sum {key!r} over {members} has {len(members)} passive contributor(s); this "
                f"party's policy needs at least {self.policy.min_group}",
            )

    def _check_plain_call(
        self, call: Any, *, inputs: Sequence[str], collects: Sequence[str]
    ) -> None:
        if call.sums or set(call.collect) - set(collects) or set(call.inputs) - set(inputs):
            raise self.refuse(
                "role operation", f"{call.op!r} asks for sums or tensors it never carries"
            )

    def _check_setup(
        self,
        call: Any,
        *,
        inputs: Sequence[str] = ("train_ids", "all_ids", "ckks_context"),
        collects: Sequence[str] = ("present",),
    ) -> None:
        self._check_plain_call(call, inputs=inputs, collects=collects)
        if "present" in call.collect and not self.policy.share_presence:
            raise self.refuse(
                "share_presence", "set-up asks which rows this party holds; its policy says no"
            )
        run = call.args.get("run", {})
        cfg = self.cfg
        mine = run_terms(cfg)
        if not isinstance(run, dict) or any(run.get(k) != v for k, v in mine.items()):
            raise self.refuse(
                "run",
                f"the active party runs {run!r}, this party's config says {mine}: every role "
                "must run the same federation config",
            )


def run_terms(cfg: RunConfig) -> dict[str, Any]:
    """What the active party announces at set-up and each party compares with its own config:
    the method, the aggregation, min_group, the pipeline depth (a party accepts only the
    staleness its own config allows), and whether the aggregator runs in the active party's
    process (a party knows it from its own config, which its policy may refuse, and holds the
    active party to it)."""
    return {
        "method": cfg.method,
        "aggregation": cfg.aggregation,
        "min_group": cfg.min_group,
        "pipeline_depth": cfg.pipeline_depth,
        "aggregator_in_active": cfg.aggregator_in_active,
    }


def call_tags(
    meta: Mapping[str, Any],
    *,
    session: bytes,
    round: int,
    tensors: Mapping[str, np.ndarray],
    keys: Mapping[str, bytes],
) -> dict[str, str]:
    """The active party's tag of a call for each recipient (`keys`: party -> auth key)."""
    digest = call_digest(meta, session=session.hex(), round=round, tensors=tensors)
    return {party: call_tag(key, digest) for party, key in keys.items()}
