"""The fast path for experiments: the same roles and protocol code, every role a thread of this
process, talking over ZeroMQ `inproc://` sockets instead of TCP. Nothing crosses a network, and
libzmq runs no CURVE over inproc, so the channel is unencrypted memory of this one process; the
secure sums (masking) still run exactly as over TCP.

Use it for sweeps and tests (`transport = "inproc"` or `run_federation`); `securevfl run` keeps
one OS process per role by default. Not for ckks (it would put the secret key next to every
ciphertext), which config validation refuses."""

from __future__ import annotations

import io
import json
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import zmq

from securevfl.config import ConfigError, RunConfig
from securevfl.data.table import load_active_table, load_party_table, role_data_path
from securevfl.errors import exit_code_for
from securevfl.roles import protocol as P


def run_federation(
    cfg: RunConfig,
    *,
    out: Path,
    resume: bool = False,
    config_path: Path | None = None,
    stdout: IO[str] | None = None,
    force: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[int, dict[str, Any] | None]:
    """Run every role as a thread; returns (exit status, metrics.json content or None)."""
    import torch

    from securevfl.launcher import overall_status, prepare_run_dir
    from securevfl.roles.active import run_active
    from securevfl.roles.aggregator import run_aggregator
    from securevfl.roles.party import run_party

    if cfg.aggregation == "ckks":
        raise ConfigError(
            "[run] aggregation",
            "ckks cannot run in-process: the aggregator thread would share memory with the CKKS "
            "secret key; use `securevfl run` (one process per role)",
        )
    out = Path(out).resolve()
    if config_path is None:
        config_path = out / "config.toml"
        out.mkdir(parents=True, exist_ok=True)
        if not config_path.exists():
            config_path.write_text("# built in code; see metrics.json\n")
    keys = prepare_run_dir(cfg, config_path, out, resume=resume, force=force, overrides=overrides)
    device = torch.device(cfg.device)
    context = zmq.Context()
    address = f"inproc://securevfl-{uuid.uuid4().hex}"
    codes: dict[str, int] = {}
    bound = threading.Event()

    def role_thread(role: str, fn: Any, **kwargs: Any) -> threading.Thread:
        def body() -> None:
            logger = P.role_logger(role, out)
            try:
                codes[role] = fn(cfg, logger=logger, context=context, **kwargs)
            except P.RunAborted as exc:
                logger.error("%s", exc)
                codes[role] = exc.exit_code
            except Exception as exc:  # recorded; the others learn of it through the aggregator
                logger.exception("failed: %s", exc)
                codes[role] = exit_code_for(exc)  # the statuses `securevfl run` gives

        t = threading.Thread(target=body, name=f"securevfl-{role}", daemon=True)
        t.start()
        return t

    threads = []
    if not cfg.aggregator_in_active:  # else the active party's thread runs it (and binds)
        threads.append(
            role_thread(
                "aggregator",
                run_aggregator,
                keys_dir=keys,
                bind=address,
                on_bound=lambda _endpoint: bound.set(),
            )
        )
        bound.wait(timeout=cfg.startup_timeout)
    for p in cfg.party_names:
        table = load_party_table(role_data_path(out, p), cfg, p)
        threads.append(
            role_thread(
                p,
                run_party,
                name=p,
                run_dir=out,
                keys_dir=keys,
                data_path=role_data_path(out, p),
                address=address,
                device=device,
                table=table,
            )
        )
    active_table = load_active_table(role_data_path(out, cfg.active_name), cfg)
    threads.append(
        role_thread(
            cfg.active_name,
            run_active,
            run_dir=out,
            keys_dir=keys,
            data_path=role_data_path(out, cfg.active_name),
            address=address,
            device=device,
            resume=resume,
            table=active_table,
            out=stdout if stdout is not None else io.StringIO(),
        )
    )
    for t in threads:
        t.join()
    context.term()
    code = overall_status(codes, active=cfg.active_name, run_dir=out)
    metrics_path = out / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if code == 0 and metrics_path.exists() else None
    return code, metrics


def run_inproc(
    cfg: RunConfig,
    *,
    out: Path,
    resume: bool,
    config_path: Path,
    force: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> int:
    code, _ = run_federation(
        cfg,
        out=out,
        resume=resume,
        config_path=config_path,
        stdout=None,
        force=force,
        overrides=overrides,
    )
    return code
