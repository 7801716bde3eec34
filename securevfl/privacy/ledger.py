"""The privacy ledger: one JSON line per mechanism application, appended and fsynced.

A ledger is the evidence an audit recomputes epsilon from, so it is written defensively:
every event is one ``os.write`` on a file opened with ``O_APPEND``, followed by ``fsync``,
so a run that crashes keeps every event written before the crash. Reading validates every
line and names the line number of the first bad one.

Line format (schema 1), one JSON object per line:

- a DP release: ``{"schema": 1, "kind": "dp", "role", "mechanism", "noise_multiplier",
  "clip", "sample_rate", "steps", "delta", "epoch", "amplified", "note", "time"}``
- a release with no formal guarantee: ``{"schema": 1, "kind": "unprotected", "role",
  "mechanism": "unprotected", "what", "reason", "epoch", "time"}``
- a call a passive party refused (its release policy): ``{"schema": 1, "kind": "refusal",
  "role", "rule", "detail", "round", "time"}`` (nothing was released)
- a note about the run, not a release: ``{"schema": 1, "kind": "note", "role", "what",
  "detail", "time"}`` (a forced resume with a changed config, a torn line repaired)

A torn last line (a write cut short by a power loss or a full disk; a killed process cannot
tear one: each event is a single ``write`` of a few hundred bytes) is refused when the ledger is
opened, and repaired on ``--resume`` by `repair_torn_tail`, which never under-counts: see there.

``steps`` counts how many times each affected row was released by this event, the unit the
accountant composes. For label DP and embedding DP (no amplification, sample rate 1) record
one step per row use: e.g. one event per epoch with ``steps=1`` when each row is in one batch
per epoch. For DP-SGD with amplification, record one event per optimizer step with sample
rate ``batch / N``.
"""

from __future__ import annotations

import json
import math
import os
import time as _time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from securevfl.errors import LedgerError
from securevfl.privacy.mechanisms import MECHANISMS, Mechanism

__all__ = [
    "LEDGER_FILENAME",
    "SCHEMA_VERSION",
    "UNPROTECTED",
    "LedgerError",
    "LedgerEvent",
    "PrivacyLedger",
    "TornTail",
    "merge_history",
    "repair_torn_tail",
]

# the run directory's ledger: RUN_DIR/ledger.jsonl, appended by every role that shares the directory
LEDGER_FILENAME = "ledger.jsonl"
SCHEMA_VERSION = 1
UNPROTECTED = "unprotected"
REFUSAL = "refusal"
NOTE = "note"
# where `repair_torn_tail` keeps the bytes it removed, next to the ledger
TORN_SUFFIX = ".torn"

History = list[tuple[float, float, int]]


def _check_number(name: str, value: Any, *, low: float, high: float, high_ok: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v <= low or (v > high if high_ok else v >= high):
        upper = f"<= {high}" if high_ok else f"< {high}"
        raise ValueError(f"{name} must be > {low} and {upper}, got {value!r}")
    return v


@dataclass
class LedgerEvent:
    """One application of a DP mechanism, as the accountant composes it.

    ``(noise_multiplier, sample_rate, steps)`` is one entry of an Opacus accountant history.
    Validation refuses events the accountant could not honestly use: non-positive sigma or
    clip, a sample rate outside (0, 1], fewer than one step, delta outside (0, 1), an unknown
    mechanism, ``amplified`` disagreeing with ``sample_rate < 1``, and a sample rate below 1
    for a mechanism that releases to other parties (label DP, embedding DP): those parties
    know which rows are in each batch, so subsampling amplification does not apply.
    """

    role: str
    mechanism: str
    noise_multiplier: float
    clip: float
    sample_rate: float
    steps: int
    delta: float
    epoch: int | None
    amplified: bool
    note: str = ""
    time: float = field(default_factory=_time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role:
            raise ValueError(f"role must be a non-empty string, got {self.role!r}")
        if self.mechanism not in MECHANISMS:
            raise ValueError(
                f"unknown mechanism {self.mechanism!r}; known mechanisms are {sorted(MECHANISMS)}"
                f" (use record_unprotected for releases without a guarantee)"
            )
        self.noise_multiplier = _check_number(
            "noise_multiplier", self.noise_multiplier, low=0.0, high=math.inf, high_ok=True
        )
        self.clip = _check_number("clip", self.clip, low=0.0, high=math.inf, high_ok=True)
        self.sample_rate = _check_number(
            "sample_rate", self.sample_rate, low=0.0, high=1.0, high_ok=True
        )
        self.delta = _check_number("delta", self.delta, low=0.0, high=1.0, high_ok=False)
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {self.steps!r}")
        if self.epoch is not None and (
            isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0
        ):
            raise ValueError(f"epoch must be None or an int >= 0, got {self.epoch!r}")
        if not isinstance(self.amplified, bool):
            raise ValueError(f"amplified must be a bool, got {self.amplified!r}")
        if self.amplified != (self.sample_rate < 1.0):
            raise ValueError(
                f"amplified={self.amplified} disagrees with sample_rate={self.sample_rate}: "
                "an event is amplified exactly when its sample rate is below 1"
            )
        if self.amplified and not MECHANISMS[self.mechanism].amplified:
            raise ValueError(
                f"{self.mechanism} releases to other parties, who know which rows are in each "
                f"batch, so it is accounted without subsampling amplification: record "
                f"sample_rate=1.0 (got {self.sample_rate}) and one step per use of a row"
            )
        if not isinstance(self.note, str):
            raise ValueError(f"note must be a string, got {self.note!r}")
        self.time = _check_number("time", self.time, low=-math.inf, high=math.inf, high_ok=True)

    @property
    def history_entry(self) -> tuple[float, float, int]:
        """``(noise_multiplier, sample_rate, steps)``, an Opacus accountant history entry."""
        return (self.noise_multiplier, self.sample_rate, self.steps)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, "kind": "dp", **asdict(self)}


def _unprotected_record(
    *, role: str, what: str, reason: str, epoch: int | None, time: float
) -> dict[str, Any]:
    for name, value in (("role", role), ("what", what), ("reason", reason)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
        raise ValueError(f"epoch must be None or an int >= 0, got {epoch!r}")
    return {
        "kind": UNPROTECTED,
        "role": role,
        "mechanism": UNPROTECTED,
        "what": what,
        "reason": reason,
        "epoch": epoch,
        "time": float(time),
    }


def _parse_line(obj: Any) -> LedgerEvent | dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if obj.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"unsupported schema {obj.get('schema')!r}, expected {SCHEMA_VERSION}")
    body = {k: v for k, v in obj.items() if k != "schema"}
    kind = body.pop("kind", None)
    if kind == "dp":
        fields = set(LedgerEvent.__dataclass_fields__)
        unknown = set(body) - fields
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        missing = fields - set(body) - {"note"}
        if missing:
            raise ValueError(f"missing keys {sorted(missing)}")
        return LedgerEvent(**body)
    if kind == UNPROTECTED:
        expected = {"role", "mechanism", "what", "reason", "epoch", "time"}
        if set(body) != expected:
            raise ValueError(f"an unprotected record has exactly the keys {sorted(expected)}")
        if body["mechanism"] != UNPROTECTED:
            raise ValueError(f"an unprotected record has mechanism {UNPROTECTED!r}")
        return _unprotected_record(
            role=body["role"],
            what=body["what"],
            reason=body["reason"],
            epoch=body["epoch"],
            time=_check_number("time", body["time"], low=-math.inf, high=math.inf, high_ok=True),
        )
    if kind == REFUSAL:
        expected = {"role", "rule", "detail", "round", "time"}
        if set(body) != expected:
            raise ValueError(f"a refusal record has exactly the keys {sorted(expected)}")
        for name in ("role", "rule", "detail"):
            if not isinstance(body[name], str) or not body[name]:
                raise ValueError(f"{name} must be a non-empty string")
        if isinstance(body["round"], bool) or not isinstance(body["round"], int):
            raise ValueError(f"round must be an int, got {body['round']!r}")
        _check_number("time", body["time"], low=-math.inf, high=math.inf, high_ok=True)
        return {"kind": REFUSAL, **body}
    if kind == NOTE:
        return _note_record(**_exact_keys(body, {"role", "what", "detail", "time"}, "a note"))
    raise ValueError(
        f"unknown kind {kind!r}; expected 'dp', {UNPROTECTED!r}, {REFUSAL!r} or {NOTE!r}"
    )


def _exact_keys(body: dict[str, Any], expected: set[str], what: str) -> dict[str, Any]:
    if set(body) != expected:
        raise ValueError(f"{what} record has exactly the keys {sorted(expected)}")
    return body


def _note_record(*, role: str, what: str, detail: str, time: Any) -> dict[str, Any]:
    for name, value in (("role", role), ("what", what)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if not isinstance(detail, str):
        raise ValueError(f"detail must be a string, got {detail!r}")
    return {
        "kind": NOTE,
        "role": role,
        "what": what,
        "detail": detail,
        "time": _check_number("time", time, low=-math.inf, high=math.inf, high_ok=True),
    }


def merge_history(events: list[LedgerEvent]) -> History:
    """Opacus accountant history from events in ledger order: consecutive events with the same
    ``(noise_multiplier, sample_rate)`` become one entry whose steps are summed (what
    Opacus's own ``step()`` does, so epsilon matches an accountant fed the same steps)."""
    history: History = []
    for e in events:
        if history and history[-1][0] == e.noise_multiplier and history[-1][1] == e.sample_rate:
            sigma, q, steps = history[-1]
            history[-1] = (sigma, q, steps + e.steps)
        else:
            history.append(e.history_entry)
    return history


class PrivacyLedger:
    """An append-only JSON-lines ledger of privacy events for one run.

    Opening a ledger that already exists (a resumed run) validates its content first and
    refuses to append to a corrupt or torn file. Each event is a single ``O_APPEND`` write
    followed by ``fsync``, so the roles of a federation that share a run directory can each
    hold a `PrivacyLedger` on the same file: their lines never interleave. Each instance knows
    the events it read at open plus those it recorded, which is all a role's budget needs
    (its own events); open it before any role starts recording (the roles do so before the
    session handshake).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._events: list[LedgerEvent | dict[str, Any]] = []
        if self.path.exists():
            self._events = self.read(self.path)
            with self.path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        raise LedgerError(
                            f"{self.path}: the last line has no final newline (a write torn by "
                            "a crash?); appending would corrupt it. Continue the run with "
                            "--resume, which repairs it without under-counting (or drop the "
                            "torn line by hand)"
                        )
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # roles sharing a run directory open it at the same time: whoever comes second
            # finds it empty, which is what an exclusive create would have given it too
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.close(fd)
            self._fsync_directory()

    def _fsync_directory(self) -> None:
        self._fsync_dir(self.path.parent)

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        try:
            dfd = os.open(directory, os.O_RDONLY)
        except OSError:  # some platforms cannot open directories; the file fsync still holds
            return
        try:
            os.fsync(dfd)
        except OSError:
            pass
        finally:
            os.close(dfd)

    def _append(self, record: dict[str, Any]) -> None:
        line = _line(record)
        import fcntl

        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while `repair_torn_tail` holds the file
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
            os.fsync(fd)
        finally:
            os.close(fd)

    def record(self, event: LedgerEvent) -> None:
        """Append ``event`` and fsync it before returning."""
        if not isinstance(event, LedgerEvent):
            raise TypeError(f"record takes a LedgerEvent, got {type(event).__name__}")
        self._append(event.to_json())
        self._events.append(event)

    def record_release(
        self,
        mechanism: Mechanism,
        *,
        role: str,
        delta: float,
        steps: int = 1,
        epoch: int | None = None,
        sample_rate: float = 1.0,
        note: str = "",
    ) -> LedgerEvent:
        """Record one application of ``mechanism`` (its sigma and clip) and return the event.

        ``steps``: how many times each affected row was released by this application.
        ``sample_rate`` below 1 (amplification) is refused for mechanisms that release to
        other parties; see `LedgerEvent`.
        """
        event = LedgerEvent(
            role=role,
            mechanism=mechanism.name,
            noise_multiplier=mechanism.noise_multiplier,
            clip=mechanism.clip,
            sample_rate=sample_rate,
            steps=steps,
            delta=delta,
            epoch=epoch,
            amplified=sample_rate < 1.0,
            note=note,
        )
        self.record(event)
        return event

    def record_unprotected(
        self, *, role: str, what: str, reason: str, epoch: int | None = None
    ) -> None:
        """Record a release with no formal guarantee (plain aggregation, a sum over a single
        contributor, ...): the audit lists it as "no formal guarantee". ``what`` names the
        release, ``reason`` why it is unprotected."""
        record = _unprotected_record(
            role=role, what=what, reason=reason, epoch=epoch, time=_time.time()
        )
        self._append({"schema": SCHEMA_VERSION, **record})
        self._events.append(record)

    def record_refusal(self, *, role: str, rule: str, detail: str, round: int) -> None:
        """Record that `role` refused a call (rule broken, what was asked); nothing left it."""
        record = {
            "kind": REFUSAL,
            "role": role,
            "rule": rule,
            "detail": detail[:2000],
            "round": int(round),
            "time": _time.time(),
        }
        self._append({"schema": SCHEMA_VERSION, **record})
        self._events.append(record)

    def record_note(self, *, role: str, what: str, detail: str) -> None:
        """Record a note about the run that is not a release (the audit lists it): a forced
        resume with a changed config, a torn line repaired."""
        record = _note_record(role=role, what=what, detail=detail[:4000], time=_time.time())
        self._append({"schema": SCHEMA_VERSION, **record})
        self._events.append(record)

    @property
    def events(self) -> list[LedgerEvent | dict[str, Any]]:
        """Every event of this ledger (read at open, plus those recorded since), in order."""
        return list(self._events)

    def history(self, *, role: str, mechanism: str) -> History:
        """The merged accountant history of one (role, mechanism), for budget checks."""
        return merge_history(
            [
                e
                for e in self._events
                if isinstance(e, LedgerEvent) and e.role == role and e.mechanism == mechanism
            ]
        )

    @staticmethod
    def read(path: Path, *, tolerate_torn_tail: bool = False) -> list[LedgerEvent | dict]:
        """Read and validate a ledger file: `LedgerEvent` for DP events, a dict for
        unprotected releases (keys: kind, role, mechanism, what, reason, epoch, time).

        Refuses (`LedgerError`, naming the file and line number) any line that is not valid
        JSON or not a valid event. A corrupt last line without a newline is what a crash
        during a write leaves; with ``tolerate_torn_tail`` such a line is dropped instead of
        refused. Blank lines are skipped.
        """
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise LedgerError(f"no privacy ledger at {path}") from None
        lines = data.split(b"\n")
        torn = lines[-1] != b""
        if not torn:
            lines = lines[:-1]
        events: list[LedgerEvent | dict] = []
        for number, raw in enumerate(lines, start=1):
            is_tail = torn and number == len(lines)
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
                events.append(_parse_line(obj))
            except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
                # RecursionError: JSON nested deeper than the parser's recursion limit
                if is_tail and tolerate_torn_tail:
                    break
                hint = (
                    " (the last line has no newline: probably a write torn by a crash; "
                    "`--resume` repairs it, or read with tolerate_torn_tail=True to drop it)"
                    if is_tail
                    else ""
                )
                raise LedgerError(f"{path}: line {number} is corrupt: {exc}{hint}") from exc
        return events


# ------------------------------------------------------------------------------ torn lines

# the fields an accountant needs from a DP event (`LedgerEvent.history_entry`, delta, who)
_ACCOUNTED = ("role", "mechanism", "noise_multiplier", "clip", "sample_rate", "steps", "delta")


@dataclass(frozen=True)
class TornTail:
    """What `repair_torn_tail` found and did: ``size`` bytes after the last newline, kept in
    ``quarantine``; ``counted`` is the DP event recovered from them and re-recorded (None when
    the line was cut before its accounting fields, or was not a DP event)."""

    size: int
    quarantine: Path
    counted: LedgerEvent | None
    note: str


def _salvage(fragment: bytes) -> dict[str, Any] | None:
    """The longest prefix of a torn JSON object that parses once closed, or None."""
    text = fragment.decode("utf-8", errors="replace")
    if not text.startswith("{") or len(text) > 65536:  # an event is a few hundred bytes
        return None
    for cut in range(len(text) - 1, 0, -1):
        if text[cut] != ",":
            continue
        try:
            obj = json.loads(text[:cut] + "}")
        except (ValueError, RecursionError):
            continue
        return obj if isinstance(obj, dict) else None
    return None


def _recover_event(fragment: bytes) -> LedgerEvent | None:
    """A DP event from a torn line whose accounting fields all survived, else None."""
    obj = _salvage(fragment)
    if obj is None or obj.get("schema") != SCHEMA_VERSION or obj.get("kind") != "dp":
        return None
    if any(k not in obj for k in _ACCOUNTED):
        return None
    sample_rate = obj["sample_rate"]
    epoch = obj.get("epoch")
    try:
        return LedgerEvent(
            role=obj["role"],
            mechanism=obj["mechanism"],
            noise_multiplier=obj["noise_multiplier"],
            clip=obj["clip"],
            sample_rate=sample_rate,
            steps=obj["steps"],
            delta=obj["delta"],
            epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
            amplified=isinstance(sample_rate, int | float) and sample_rate < 1.0,
            note="recovered from a torn ledger line (counted: it may have been released)",
        )
    except (TypeError, ValueError):
        return None


def _whole_line(fragment: bytes) -> bool:
    """Whether the fragment is a complete, valid record that lost only its newline."""
    try:
        _parse_line(json.loads(fragment.decode("utf-8")))
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
        return False
    return True


def repair_torn_tail(path: Path) -> TornTail | None:
    """Make a ledger whose last line was torn appendable again, never under-counting.

    Returns None when the file is absent or ends with a newline. Otherwise, under an exclusive
    lock (roles resuming together repair it once), the bytes after the last newline are kept in
    ``<ledger>.torn`` and:

    - a complete, valid record that lost only its newline is kept as it is (newline added);
    - a DP event cut after its accounting fields (role, mechanism, sigma, clip, sample rate,
      steps, delta) is re-recorded whole: counted, since over-counting is safe and
      under-counting is not;
    - anything else is cut. `PrivacyLedger` writes and fsyncs an event before the mechanism
      releases anything, so a line that is not whole on disk belongs to a write that never
      returned, whose release never left the role.

    A ``note`` line then says what was done (the audit lists it). A corrupt line before the last
    one is not repaired: opening the ledger keeps refusing it (`LedgerError`, naming the line).
    """
    import fcntl

    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size else b""
        if not data or data.endswith(b"\n"):
            return None
        keep = data.rfind(b"\n") + 1
        fragment = data[keep:]
        quarantine = path.with_name(path.name + TORN_SUFFIX)
        with open(quarantine, "ab") as q:
            q.write(fragment + b"\n")
            q.flush()
            os.fsync(q.fileno())
        event = None
        lines = b""
        if _whole_line(fragment):
            keep, lines = len(data), b"\n"
            what = "kept: it was a whole record that lost only its newline"
        elif (event := _recover_event(fragment)) is not None:
            lines = _line(event.to_json())
            what = (
                f"counted as {event.role}/{event.mechanism} ({event.steps} step(s), sigma "
                f"{event.noise_multiplier:g}): its accounting fields survived, and it may have "
                "been released"
            )
        else:
            what = (
                "not counted: cut before its accounting fields (or not a DP event); an event is "
                "fsynced before its release, so a torn one was never released"
            )
        note = f"torn last line of {len(fragment)} bytes (copied to {quarantine.name}) {what}"
        lines += _line(
            {
                "schema": SCHEMA_VERSION,
                **_note_record(
                    role="ledger", what="torn line repaired", detail=note, time=_time.time()
                ),
            }
        )
        os.ftruncate(fd, keep)
        os.pwrite(fd, lines, keep)
        os.fsync(fd)
        PrivacyLedger._fsync_dir(path.parent)
        return TornTail(size=len(fragment), quarantine=quarantine, counted=event, note=note)
    finally:
        os.close(fd)  # releases the lock


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode()
