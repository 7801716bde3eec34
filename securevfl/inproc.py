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
import sys
import threading
import time
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

    threads: dict[str, threading.Thread] = {}
    if not cfg.aggregator_in_active:  # else the active party's thread runs it (and binds)
        aggregator = threads["aggregator"] = role_thread(
            "aggregator",
            run_aggregator,
            keys_dir=keys,
            bind=address,
            on_bound=lambda _endpoint: bound.set(),
        )
        deadline = time.monotonic() + cfg.startup_timeout
        while not bound.wait(0.05) and aggregator.is_alive() and time.monotonic() < deadline:
            pass  # bound, failed (the roles then find no hub and end) or out of time
    for p in cfg.party_names:
        table = load_party_table(role_data_path(out, p), cfg, p)
        threads[p] = role_thread(
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
    active_table = load_active_table(role_data_path(out, cfg.active_name), cfg)
    threads[cfg.active_name] = role_thread(
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
    from securevfl.roles.rounds import tolerates_dropout

    watched = set(threads) if not tolerates_dropout(cfg) else {"aggregator", cfg.active_name}
    if _wait_for_roles(
        threads, codes, watched=watched, grace=cfg.peer_timeout + STOP_GRACE_S, context=context
    ):
        context.term()
    code = overall_status(codes, active=cfg.active_name, run_dir=out)
    metrics_path = out / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if code == 0 and metrics_path.exists() else None
    return code, metrics


#: After a role fails, how long (beyond [network] peer_timeout) the others get to stop on their
#: own before the ZeroMQ context is terminated under them (as `securevfl run` waits for processes)
STOP_GRACE_S = 10.0


def _wait_for_roles(
    threads: Mapping[str, threading.Thread],
    codes: dict[str, int],
    *,
    watched: set[str],
    grace: float,
    context: zmq.Context,
) -> bool:
    """Wait for every role thread, as `launcher.supervise` waits for role processes: once a
    watched role has failed, the others get `grace` seconds to stop on their own (a role that
    fails before it connects is otherwise noticed only when the start-up timeout ends); then
    the context is terminated, which ends every blocking receive of theirs with an error, and
    each gets 10 s to close. A role still running after that is reported lost. Returns whether
    the context is still to be terminated (it was not stopped here)."""
    failed_at: float | None = None
    while any(t.is_alive() for t in threads.values()):
        if failed_at is None and any(codes.get(r) not in (None, 0) for r in watched):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            stuck = sorted(r for r, t in threads.items() if t.is_alive())
            print(
                f"securevfl: {', '.join(stuck)} did not stop within {grace:.0f} s of the "
                "failure; stopping them",
                file=sys.stderr,
            )
            # term() waits for every socket to close: on a thread of its own, so that a role
            # that never closes cannot hold this one
            threading.Thread(target=context.term, name="securevfl-stop", daemon=True).start()
            for role in stuck:
                threads[role].join(timeout=10.0)
                if threads[role].is_alive():
                    codes.setdefault(role, P.EXIT_PEER_LOST)
            return False
        time.sleep(0.05)
    return True


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
