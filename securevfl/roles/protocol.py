"""Message kinds, exit codes and the session handshake shared by the three roles.

Every round is driven by the active party:

    active --call(op, ids, sums)--> aggregator --call--> each party in `to`
    party  --contrib(protected arrays)--> aggregator --result(sums)--> active

A `call` with no sums (e.g. backward) is answered by empty contributions (an acknowledgement), so
the active party always knows a round has finished everywhere before it starts the next.
With `[network] fuse_rounds`, such an acknowledged call (a batch's backward) may instead ride
ahead of the next call to the same parties in one envelope (`rounds.fuse`): each party runs the
calls in order, each checked as its own, and answers once.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# the roles' exit statuses and their stop, re-exported (the table lives in securevfl.errors)
from securevfl.errors import EXIT_BUDGET as EXIT_BUDGET
from securevfl.errors import EXIT_ERROR as EXIT_ERROR
from securevfl.errors import EXIT_OK as EXIT_OK
from securevfl.errors import EXIT_PEER_LOST as EXIT_PEER_LOST
from securevfl.errors import EXIT_REFUSED as EXIT_REFUSED
from securevfl.errors import EXIT_USAGE as EXIT_USAGE
from securevfl.errors import RunAborted as RunAborted

HELLO = "join"
WELCOME = "session"
CALL = "call"
CONTRIB = "contrib"
RESULT = "result"
ABORT = "abort"
ERROR = "error"
BYE = "bye"
STATS = "stats"
REFUSED = "refused"  # a party refused the round's call (its release policy); nothing released
KINDS = frozenset({HELLO, WELCOME, CALL, CONTRIB, RESULT, ABORT, ERROR, BYE, STATS, REFUSED})

# operations the roles handle themselves (not the method)
OP_SETUP = "setup"
OP_CHECKPOINT = "checkpoint"
# a streamed active table's set-up rows, a part at a time (`securevfl.roles.setup_rows`)
OP_SETUP_ROWS = "setup.rows"
OP_SETUP_PRESENT = "setup.present"
SETUP_OPS = frozenset({OP_SETUP, OP_SETUP_ROWS, OP_SETUP_PRESENT})


def session_id(nonces: Mapping[str, str]) -> str:
    """The session id every role derives from every role's fresh nonce, so that no single role
    chooses it and every role knows it is fresh (its own nonce is in it)."""
    h = hashlib.sha256(b"securevfl/session/v1")
    for name in sorted(nonces):
        h.update(len(name).to_bytes(2, "big") + name.encode())
        h.update(bytes.fromhex(nonces[name]))
    return h.hexdigest()[:32]


# `logger.error(..., extra=FILE_ONLY)`: into the role's log file, not onto stderr (the command
# prints its own one line there)
FILE_ONLY = {"file_only": True}


def role_logger(role: str, run_dir: Path | None) -> logging.Logger:
    """A logger writing everything to RUN_DIR/logs/<role>.log and warnings to stderr."""
    logger = logging.getLogger(f"securevfl.{role}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    fmt = logging.Formatter(f"%(asctime)s {role} %(levelname)s %(message)s")
    if run_dir is not None:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(run_dir / "logs" / f"{role}.log")
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    sh = logging.StreamHandler(sys.stderr)
    sh.setLevel(logging.WARNING)
    sh.setFormatter(fmt)
    sh.addFilter(lambda record: not getattr(record, "file_only", False))
    logger.addHandler(sh)
    # the transport logs rejections under its own logger names: keep them in the role's log
    for name in ("transport", "zmq.auth"):
        tl = logging.getLogger(name)
        tl.setLevel(logging.INFO)
        for h in logger.handlers:
            if h not in tl.handlers:
                tl.addHandler(h)
    return logger


#: Set by the local launcher (`securevfl.launcher`) on the one process that binds: the file
#: where its hub writes the address it is listening on, once bound (the port the kernel gave
#: for ``tcp://HOST:0``), for the other roles of the run to connect to.
ENDPOINT_FILE_ENV = "SECUREVFL_ENDPOINT_FILE"
# set for the roles a launcher on this machine started: on Ctrl-C it speaks for them, once
LAUNCHED_ENV = "SECUREVFL_LAUNCHED"


def announce_endpoint(endpoint: str) -> None:
    """Write `endpoint` to the file named by :data:`ENDPOINT_FILE_ENV` (atomically: a reader
    sees the whole address or no file); nothing when it is unset or the hub is in-process."""
    path = os.environ.get(ENDPOINT_FILE_ENV)
    if not path or endpoint.startswith("inproc://"):
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(endpoint + "\n")
    os.replace(tmp, path)


# what a role's end-of-run stats may hold (they go into the active party's metrics.json):
# plain JSON data, nested this deep at most, this many values in all, strings this long
STATS_MAX_DEPTH = 4
STATS_MAX_VALUES = 2048
STATS_MAX_STRING = 256
STATS_RULE = (
    "a role's stats hold plain JSON data only: numbers, booleans, null, strings of at most "
    f"{STATS_MAX_STRING} characters, and lists and mappings (string keys) of them, "
    f"{STATS_MAX_DEPTH} levels deep and {STATS_MAX_VALUES} values in all at most"
)
_STATS_SCALARS = (bool, int, float, str, type(None))


def plain_stats_problem(value: Any, *, depth: int, budget: list[int]) -> str | None:
    """Why `value` is not plain JSON data within the stats bounds, at nesting `depth`, with
    `budget[0]` values left (decremented); None when it is."""
    from transport.errors import quote  # not at import: the role commands import this module
    # before they set their threads, and `transport` imports NumPy

    budget[0] -= 1
    if budget[0] < 0:
        return f"more than {STATS_MAX_VALUES} values in all"
    kind = type(value)
    if kind in _STATS_SCALARS:
        if kind is int and not -(2**63) <= value < 2**64:
            return "an integer beyond 64 bits"
        if kind is float and not math.isfinite(value):
            return f"a non-finite number ({value})"
        if kind is str and len(value) > STATS_MAX_STRING:
            return f"a string of {len(value)} characters"
        return None
    if kind is not list and kind is not dict:
        return f"a {kind.__name__} value"
    if depth >= STATS_MAX_DEPTH:
        return f"nesting deeper than {STATS_MAX_DEPTH} levels"
    if kind is list:
        for item in value:
            problem = plain_stats_problem(item, depth=depth + 1, budget=budget)
            if problem is not None:
                return problem
        return None
    for key, item in value.items():
        if type(key) is not str or len(key) > STATS_MAX_STRING:
            return f"the key {quote(key, 40)}, not a short string"
        problem = plain_stats_problem(item, depth=depth + 1, budget=budget)
        if problem is not None:
            return f"{quote(key, 40)}: {problem}"
    return None


def plain_stats_fields(entry: Any) -> tuple[dict[str, Any], list[str]]:
    """The fields of one role's stats `entry` that are plain JSON data within the bounds
    (`STATS_RULE`; what is dropped does not count against them), and what was dropped, one
    problem each (peer text quoted)."""
    from transport.errors import quote  # see `plain_stats_problem`

    if type(entry) is not dict:
        return {}, [f"its own entry is of type {type(entry).__name__}, not a mapping"]
    kept: dict[str, Any] = {}
    problems = []
    budget = [STATS_MAX_VALUES]
    for key, value in entry.items():
        if type(key) is not str or len(key) > STATS_MAX_STRING:
            problems.append(f"the field {quote(key, 40)} (its name is not a short string)")
            continue
        left = budget[0]
        problem = plain_stats_problem(value, depth=1, budget=budget)
        if problem is not None:
            budget[0] = left
            problems.append(f"the field {quote(key, 40)} ({problem})")
            continue
        kept[key] = value
    return kept, problems
