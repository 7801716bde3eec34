"""What a run was made with, so that it can be reproduced and resumed safely.

A run directory holds ``effective_config.json``: the config every role ran with, after every
``--set``, with defaults filled in (`effective_config`), the SHA-256 of the role data files it
trained on, and ``hash``: the SHA-256 of the settings that decide the model, the protocol and
the privacy (every field except the operational ones in `OPERATIONAL`, such as addresses,
timeouts, the device and budgets' ``max_epsilon``).

`check_resume` compares a resumed run's config with that record and refuses a different one
(`ConfigError`, exit status 2, naming every key that differs), unless it is forced; a forced
change is recorded in ``effective_config.json``, ``run.json`` and the privacy ledger. This is
what stops a ckks run from silently continuing as mask.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from securevfl.config import ConfigError, RunConfig

EFFECTIVE_CONFIG = "effective_config.json"
RUN_RECORD = "run.json"
SCHEMA = 1

# settings a resumed run may change without changing what it computes (patterns over the
# flattened keys of `effective_config`); a change is still recorded. ``max_epsilon`` is here
# because raising a budget and resuming is how a run stopped by its budget goes on.
OPERATIONAL: tuple[str, ...] = (
    "source",
    "data_path",  # replaced by the content digests of the data files
    "presence_path",
    "aggregator_address",
    "bind*",
    "keys_dir",
    "heartbeat_interval",
    "*timeout",
    "transport",
    "device",
    "aggregator_in_active",
    "fuse_rounds",  # the same results fused or not (tests/securevfl/test_fused_rounds.py)
    "*threads*",
    "*max_epsilon",
    "parties.*.max_epsilon",
)


# ------------------------------------------------------------------------------- the record


def _plain(value: Any) -> Any:
    """JSON-able, deterministic form of a config value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def effective_config(cfg: RunConfig) -> dict[str, Any]:
    """Every field of `cfg` as plain data (parties keyed by name, [method] options as a table)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "parties":
            out["parties"] = {
                p.name: {k: v for k, v in _plain(p).items() if k != "name"} for p in value
            }
        elif f.name in ("method_options", "active_types"):
            out[f.name] = {str(k): _plain(v) for k, v in value}
        else:
            out[f.name] = _plain(value)
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"ckks": {"scale_bits": 40}} -> {"ckks.scale_bits": 40}."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def operational(key: str) -> bool:
    head = key.split(".", 1)[0]
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(head, p) for p in OPERATIONAL)


def checked_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened settings a resumed run must keep (everything not `operational`)."""
    return {k: v for k, v in flatten(config).items() if not operational(k)}


def config_hash(config: Mapping[str, Any], data: Mapping[str, str]) -> str:
    """SHA-256 of the checked settings and the data digests (canonical JSON)."""
    body = {"config": checked_settings(config), "data": dict(sorted(data.items()))}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_digests(files: Mapping[str, Path]) -> dict[str, str]:
    """name -> SHA-256 of each file that exists (a missing one is left out, not guessed)."""
    return {name: file_digest(Path(p)) for name, p in files.items() if Path(p).is_file()}


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The run's effective-config record, or None if it has none (a run made before records
    existed). Raises `ConfigError` for a record that cannot be read."""
    path = Path(run_dir) / EFFECTIVE_CONFIG
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(
            "--resume", f"{path} cannot be read ({exc}); restore it from a backup of the run"
        ) from None
    if (
        not isinstance(record, dict)
        or record.get("schema") != SCHEMA
        or not isinstance(record.get("config"), dict)
        or not isinstance(record.get("data", {}), dict)
    ):
        raise ConfigError(
            "--resume", f"{path} is not an effective-config record this version wrote"
        )
    return record


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Atomically and durably (temporary file, fsync, rename, fsync of the directory)."""
    # a name of this process's own: roles that share a run directory write the same record
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(value, indent=2, sort_keys=False, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_record(
    run_dir: Path,
    cfg: RunConfig,
    *,
    data: Mapping[str, str],
    written_by: str,
    config_path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    resumes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Write RUN_DIR/effective_config.json for `cfg` and return it."""
    config = effective_config(cfg)
    record = {
        "schema": SCHEMA,
        "hash": config_hash(config, data),
        "written_by": written_by,
        "time": time.time(),
        "config_file": None if config_path is None else str(Path(config_path).resolve()),
        "overrides": _plain(dict(overrides or {})),
        "data": dict(sorted(data.items())),
        "config": config,
        "resumes": list(resumes or []),
    }
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    _write_json(Path(run_dir) / EFFECTIVE_CONFIG, record)
    return record


# ------------------------------------------------------------------------------- resuming


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(
    recorded: Mapping[str, Any],
    config: Mapping[str, Any],
    *,
    recorded_data: Mapping[str, str],
    data: Mapping[str, str],
) -> tuple[dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any]]]:
    """(refused, allowed): key -> (the run's value, the new value). Data digests are compared
    only for the files both sides know (``data.<name>``)."""
    old, new = flatten(recorded), flatten(config)
    refused: dict[str, tuple[Any, Any]] = {}
    allowed: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if a != b:
            (allowed if operational(key) else refused)[key] = (a, b)
    for name in sorted(set(recorded_data) & set(data)):
        if recorded_data[name] != data[name]:
            refused[f"data.{name}"] = (recorded_data[name][:12], data[name][:12])
    return refused, allowed


def check_resume(
    run_dir: Path,
    cfg: RunConfig,
    *,
    data: Mapping[str, str],
    force: bool,
    who: str,
    logger: logging.Logger | None = None,
    config_path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    always_note: bool = False,
) -> dict[str, tuple[Any, Any]]:
    """Compare a resumed run's config (and data digests) with the run's record.

    Refuses (`ConfigError` on ``--resume``, exit status 2) a difference in any checked setting,
    naming every key that differs, unless `force`. A forced or allowed (operational) change
    rewrites the record with the new settings and lists the change under its ``resumes``; a
    forced one is also written to the ledger as a note. With `always_note`, every resume is
    listed. A run with no record (made before records existed) gets one, unchecked. Returns the
    refused-but-forced changes.
    """
    run_dir = Path(run_dir)
    with records_locked(run_dir):  # one read-change-write at a time
        record = read_record(run_dir)
        if record is None:
            _warn(
                logger, f"{run_dir} holds no {EFFECTIVE_CONFIG}: the resumed config is not checked"
            )
            write_record(
                run_dir,
                cfg,
                data=data,
                written_by=who,
                config_path=config_path,
                overrides=overrides,
            )
            return {}
        refused, allowed = differences(
            record["config"],
            effective_config(cfg),
            recorded_data=record.get("data", {}),
            data=data,
        )
        if refused and not force:
            shown = "; ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in refused.items())
            raise ConfigError(
                "--resume",
                f"the config differs from the one {run_dir} was started with: {shown}. A "
                f"resumed run must keep its model, protocol, privacy and data settings: resume "
                f"with the run's config ({run_dir / EFFECTIVE_CONFIG} lists it), or add --force "
                "to continue with "
                "the new values (the change is recorded in run.json and the ledger)",
            )
        if not (refused or allowed or always_note):
            return {}
        entry = {
            "time": time.time(),
            "by": who,
            "forced": bool(refused),
            "changed": {k: [a, b] for k, (a, b) in {**refused, **allowed}.items()},
            "previous_hash": record.get("hash"),
        }
        merged = {**record.get("data", {}), **data}
        write_record(
            run_dir,
            cfg,
            data=merged,
            written_by=who,
            config_path=config_path if config_path is not None else record.get("config_file"),
            overrides=overrides if overrides is not None else record.get("overrides"),
            resumes=[*record.get("resumes", []), entry],
        )
        _note_in_run_record(run_dir, entry, config_path=config_path, overrides=overrides)
        if refused:
            shown = "; ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in refused.items())
            _warn(logger, f"--force: resuming with a changed config: {shown}")
            _note_in_ledger(
                run_dir, who=who, detail=f"resumed with --force; config changed: {shown}"
            )
        return refused


@contextlib.contextmanager
def records_locked(run_dir: Path) -> Iterator[None]:
    """One writer of a run directory's records at a time: the roles of `securevfl run` share
    one directory and each reads, changes and writes `effective_config.json` and `run.json`
    on `--resume` (entries were lost when two did at once). An exclusive `flock` on
    ``RUN_DIR/.records.lock``, released when the file closes (or its process dies). Not
    re-entrant: take it once per read-change-write."""
    import fcntl

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / ".records.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _note_in_run_record(
    run_dir: Path,
    entry: Mapping[str, Any],
    *,
    config_path: Path | None,
    overrides: Mapping[str, Any] | None,
) -> None:
    """List the resume in run.json too (the launcher's record), and point it at the config
    the run now continues with, so that `securevfl predict` loads that one."""
    path = run_dir / RUN_RECORD
    if not path.exists():
        return
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return  # the launcher rewrites it; the effective-config record has the history
    if not isinstance(run, dict):
        return
    if config_path is not None:
        run["config"] = str(Path(config_path).resolve())
    if overrides is not None:
        run["overrides"] = _plain(dict(overrides))
    run["resumes"] = [*run.get("resumes", []), dict(entry)]
    _write_json(path, run)


def _note_in_ledger(run_dir: Path, *, who: str, detail: str) -> None:
    from securevfl.privacy.ledger import LEDGER_FILENAME, PrivacyLedger

    path = run_dir / LEDGER_FILENAME
    if not path.exists():
        return  # a role that keeps no ledger (the aggregator's own directory)
    PrivacyLedger(path).record_note(role=who, what="forced resume", detail=detail)


def repair_ledger(run_dir: Path, *, logger: logging.Logger | None = None) -> str | None:
    """Repair a torn last ledger line before a resumed run appends to it (see
    `repair_torn_tail`); returns the note it recorded, or None if the ledger was whole."""
    from securevfl.privacy.ledger import LEDGER_FILENAME, repair_torn_tail

    torn = repair_torn_tail(Path(run_dir) / LEDGER_FILENAME)
    if torn is None:
        return None
    _warn(logger, f"privacy ledger: {torn.note}")
    return torn.note


def _warn(logger: logging.Logger | None, message: str) -> None:
    """To the role's log (and stderr), or, for `securevfl run`, one line on stderr."""
    if logger is not None:
        logger.warning("%s", message)
    else:
        print(f"securevfl: warning: {message}", file=sys.stderr)


# ------------------------------------------------------------------------------- one role


def role_run_record(
    cfg: RunConfig,
    *,
    run_dir: Path,
    role: str,
    data_file: Path | None,
    resume: bool,
    force: bool,
    logger: logging.Logger,
    config_path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> None:
    """What a role started by hand (`securevfl aggregator|active|party`) does with its run
    directory's record: a fresh start records its effective config (unless the directory
    already records the same one, as when `securevfl run` started it); `--resume` checks it
    (`check_resume`) and repairs a torn ledger line first."""
    data = data_digests({role: data_file}) if data_file is not None else {}
    if resume:
        repair_ledger(run_dir, logger=logger)
        check_resume(
            run_dir,
            cfg,
            data=data,
            force=force,
            who=role,
            logger=logger,
            config_path=config_path,
            overrides=overrides,
        )
        return
    with records_locked(run_dir):
        record = read_record(run_dir)
        if record is not None:
            same = record["hash"] == config_hash(effective_config(cfg), record.get("data", {}))
            if same and set(data) <= set(record.get("data", {})):
                return
            if not same and record.get("written_by") == "launcher":
                # `securevfl run` / `predict` owns this directory's record: a role never rewrites it
                logger.warning(
                    "this role's config differs from the run's record in %s (%s); not rewriting it",
                    run_dir / EFFECTIVE_CONFIG,
                    ", ".join(
                        differences(
                            record["config"], effective_config(cfg), recorded_data={}, data={}
                        )[0]
                    )
                    or "data",
                )
                return
            if same:  # a record without this role's own file: add it
                data = {**record.get("data", {}), **data}
        write_record(
            run_dir, cfg, data=data, written_by=role, config_path=config_path, overrides=overrides
        )


def launcher_digests(cfg: RunConfig, run_dir: Path, roles: Iterable[str]) -> dict[str, str]:
    """The digests `securevfl run` records: the source table (``table``), the alignment
    (``presence``) and each role's split file."""
    from securevfl.data.table import role_data_path

    files: dict[str, Path] = {"table": cfg.data_path}
    if cfg.presence_path is not None:
        files["presence"] = cfg.presence_path
    files.update({r: role_data_path(run_dir, r) for r in roles})
    return data_digests(files)
