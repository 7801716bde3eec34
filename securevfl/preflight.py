"""Checks made before any role process starts: everything a command can find wrong on its own
machine (data files and their headers, key files and their permissions, the port to bind, the
run directory) is refused here with one sentence naming the problem and the fix, rather than
after five processes have started.

`check_run` is what `securevfl run` checks; `check_role` what `securevfl aggregator | active |
party` check. Both raise `ConfigError`, `DataError` or `KeyMaterialError` (exit status 2). The
config itself is validated by `securevfl.config.load_config` before either is called; the
joint table's ids (duplicates, empty ones) are checked when `run` splits it, still before any
process starts.
"""

from __future__ import annotations

import csv
import errno
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from securevfl.config import RunConfig
from securevfl.data.columns import ROW_NUMBER_ID
from securevfl.errors import ConfigError, DataError, KeyMaterialError
from securevfl.keys import AGGREGATOR

# ------------------------------------------------------------------------------------ commands


def check_run(cfg: RunConfig, *, out: Path, resume: bool) -> None:
    """What `securevfl run CONFIG --out OUT` needs before it starts any process: a usable run
    directory, the joint table with the id, label and every role's columns (a fresh run), or
    the keys a resumed run was started with."""
    check_out_dir(out)
    check_device(cfg)
    if resume:
        keys = Path(out) / "keys"
        if (keys / "public.json").exists():
            for role in (AGGREGATOR, *cfg.role_names):
                check_keys(keys, role=role, roles=cfg.role_names)
        return
    if cfg.transport == "inproc":
        return  # one process: the same reads happen at once, with the same errors
    columns = [*cfg.active_columns, *(c for p in cfg.parties for c in p.columns)]
    check_table(
        cfg.data_path,
        id_column=cfg.id_column,
        columns=columns,
        label=cfg.label,
        delimiter=cfg.delimiter,
        key="[data] path",
        owners=_owners(cfg),
    )


def check_role(
    cfg: RunConfig,
    *,
    command: str,
    role: str,
    keys_dir: Path,
    out: Path,
    data: Path | None = None,
    bind: str | None = None,
    address: str | None = None,
    scoring: bool = False,
) -> None:
    """What one role command needs before it starts: its run directory, its keys (present,
    readable by this user only, of the same `securevfl keys` run as public.json), its own table
    (`data`, with the id column and this role's columns) and, for the aggregator, a free port
    on an address of this host (`bind`); for the others, a well-formed aggregator `address`."""
    check_out_dir(out)
    check_device(cfg)
    check_keys(keys_dir, role=role, roles=cfg.role_names)
    if command == AGGREGATOR:
        if bind is not None:
            check_bind(bind)
        return
    if address is not None:
        check_address(address, key="--address / [network] aggregator")
    if data is None:
        return
    if role == cfg.active_name:
        columns, label = list(cfg.active_columns), (None if scoring else cfg.label)
    else:
        columns, label = list(cfg.party(role).columns), None
    check_table(
        data,
        id_column=ROW_NUMBER_ID if cfg.id_column == ROW_NUMBER_ID else cfg.id_column,
        columns=columns,
        label=label,
        delimiter=cfg.delimiter,
        key="--data",
        owners=_owners(cfg),
    )


# ------------------------------------------------------------------------------------ pieces


def check_device(cfg: RunConfig) -> None:
    """``[run] device = "cuda"`` needs a GPU this process can see."""
    if cfg.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "[run] device",
            'cuda was asked for but no GPU is visible; use "cpu" (--set run.device=cpu)',
        )


def check_out_dir(out: Path) -> None:
    """The run directory is a directory (or can be made) this user may write to."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file, not a directory; choose a directory")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"cannot write to {existing}; choose a directory you may write")


def check_table(
    path: Path,
    *,
    id_column: str,
    columns: Sequence[str],
    label: str | None,
    delimiter: str | None,
    key: str,
    owners: dict[str, str],
) -> None:
    """The file exists, is readable, and its header holds the id column (unless ``@row``), the
    label (when given) and every one of `columns` (`owners`: column -> the config key that
    names it, for the message)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{key}: data file {path} does not exist; check the path")
    if not path.is_file():
        raise DataError(f"{key}: {path} is not a file; give the table's CSV or Parquet file")
    if not os.access(path, os.R_OK):
        raise DataError(f"{key}: cannot read {path} (permission denied); check its mode")
    header = read_header(path, delimiter=delimiter)
    shown = header[:30]
    if id_column != ROW_NUMBER_ID and id_column not in header:
        raise DataError(
            f"{key}: {path} has no id column {id_column!r} (its columns are {shown}); set "
            '[data] id to its id column, or id = "@row" for a table without ids'
        )
    if label is not None and label not in header:
        raise DataError(
            f"{key}: {path} has no label column {label!r} (its columns are {shown}); set "
            "[data] label to the column that holds the labels"
        )
    missing = [c for c in columns if c not in header]
    if missing:
        raise DataError(
            f"{key}: {path} has no column {missing[0]!r}, which {owners.get(missing[0])} names"
            + (f" (nor {missing[1:]})" if len(missing) > 1 else "")
            + f"; its columns are {shown}; fix the config or the file"
        )


def read_header(path: Path, *, delimiter: str | None = None) -> list[str]:
    """The column names of a CSV (delimiter sniffed as `securevfl.data.columns` does) or
    Parquet file, reading only its first line (or its schema)."""
    path = Path(path)
    if path.suffix.lower() in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
        except Exception as exc:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path} is not a readable Parquet file ({exc})") from None
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            first = fh.readline(1 << 20)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason}); save it as UTF-8") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    if not first.strip():
        raise DataError(f"{path} is empty; it needs a header line and rows")
    if delimiter is None:
        try:
            delimiter = csv.Sniffer().sniff(first.split("\n", 1)[0], ",;\t|").delimiter
        except csv.Error:
            delimiter = ","
    row = next(csv.reader([first.rstrip("\r\n")], delimiter=delimiter), [])
    return [h.strip() for h in row]


def check_keys(keys_dir: Path, *, role: str, roles: Sequence[str]) -> None:
    """The keys directory holds public.json with every role's keys and `role`'s own secret
    file: private to this user, readable, and of the same `securevfl keys` run."""
    from securevfl.keys import check_pair, check_roles, load_public, load_secrets

    keys_dir = Path(keys_dir)
    if not keys_dir.is_dir():
        raise KeyMaterialError(
            f"the keys directory {keys_dir} does not exist; make the federation's keys with "
            f"`securevfl keys --config CONFIG --out {keys_dir}`, or point --keys / [network] "
            "keys at the directory that holds them"
        )
    public = load_public(keys_dir)
    check_roles(public, roles, keys_dir)
    check_pair(public, load_secrets(keys_dir, role), keys_dir)


def split_tcp(address: str, *, key: str) -> tuple[str, int] | None:
    """(host, port) of ``tcp://HOST:PORT`` (IPv6 hosts in brackets); None for ``ipc://`` and
    ``inproc://``. Raises `ConfigError` naming `key` for anything else."""
    if address.startswith(("ipc://", "inproc://")):
        return None
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise ConfigError(
            key, f"{address!r} is not an address like tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555)"
        )
    if not 0 <= int(port) <= 65535:
        raise ConfigError(key, f"port {port} of {address!r} is not in 0..65535")
    return host.strip("[]"), int(port)


def check_address(address: str, *, key: str) -> None:
    """An address to connect to: ``tcp://HOST:PORT`` with a port other than 0."""
    parsed = split_tcp(address, key=key)
    if parsed is not None and parsed[1] == 0:
        raise ConfigError(key, f"{address!r} has port 0; give the port the aggregator listens on")


def check_bind(bind: str) -> None:
    """The aggregator can listen on `bind`: its host is an address of this machine and its port
    is free. A port in use is named, with the way to pick another."""
    parsed = split_tcp(bind, key="--bind / [network] bind")
    if parsed is None:
        return
    host, port = parsed
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    target = "" if host == "*" else host
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # libzmq sets SO_REUSEADDR on its listeners too: a port in TIME_WAIT is not "in use"
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((target, port))
        except socket.gaierror:
            raise ConfigError(
                "[network] bind",
                f"cannot resolve {host!r} of {bind}; bind an address of this host, or "
                f"tcp://*:{port} to listen on every interface ([network] bind or --bind)",
            ) from None
        except OSError as exc:
            shown = host if host != "*" else "every interface"
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    "[network] bind / aggregator",
                    f"port {port} on {shown} is in use; pick another: the aggregator listens on "
                    f"[network] bind (or --bind) where that is set, else on the port of [network] "
                    f"aggregator (--set network.aggregator=tcp://{host}:OTHER_PORT), which the "
                    "other roles connect to",
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    "[network] bind",
                    f"{host} is not an address of this host, so the aggregator cannot listen on "
                    f"it; set [network] bind (or --bind) to this host's address, or to "
                    f'"tcp://*:{port}" to listen on every interface',
                ) from None
            if exc.errno == errno.EACCES:
                raise ConfigError(
                    "[network] aggregator",
                    f"port {port} needs privileges to listen on; choose a port above 1023",
                ) from None
            raise


def _owners(cfg: RunConfig) -> dict[str, str]:
    """column -> the config key that names it."""
    owners = dict.fromkeys(cfg.active_columns, "[active] columns")
    for p in cfg.parties:
        owners.update(dict.fromkeys(p.columns, f"[parties.{p.name}] columns"))
    return owners
