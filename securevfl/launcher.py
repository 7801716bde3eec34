"""`securevfl run`: a whole federation on this machine, one OS process per role, over loopback
ZeroMQ with CURVE (with [network] aggregator_in_active, the aggregator is a thread of the active
party's process: one process fewer). The table is split into one file per role first; each
process reads only its own file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from securevfl.config import ConfigError, RunConfig, load_config
from securevfl.data.table import role_data_path, split_federation
from securevfl.keys import generate_keys
from securevfl.roles import protocol as P
from securevfl.roles.checkpoint import epochs
from securevfl.run_record import (
    EFFECTIVE_CONFIG,
    RUN_RECORD,
    check_resume,
    launcher_digests,
    read_record,
    repair_ledger,
    write_record,
)


def free_port() -> int:
    """A port that was free a moment ago (closed again before it returns: another process may
    take it before the caller binds it). The launcher does not use it: its binding role binds
    port 0 and writes the port it got (`LOCAL_ANY`, `await_address`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Where a locally launched federation's binding role listens: a port the kernel picks when it
#: binds, so no other process can take it in between (as it could a port probed beforehand).
LOCAL_ANY = "tcp://127.0.0.1:0"
#: The file in a run directory where the binding role writes its address for the others.
ENDPOINT_FILE = "endpoint.txt"


def rendezvous(out: Path, env: Mapping[str, str]) -> tuple[Path, dict[str, str], dict[str, str]]:
    """How the roles of a run started on this machine find the one that binds: the endpoint
    file in `out` (a stale one removed), the binding role's environment (told to write its
    address there, `securevfl.roles.protocol.announce_endpoint`) and every other role's (told
    nothing; they are given the file, `await_address`). Both say the roles were launched here
    (`LAUNCHED_ENV`)."""
    endpoint = out / ENDPOINT_FILE
    endpoint.unlink(missing_ok=True)
    others = {k: v for k, v in env.items() if k != P.ENDPOINT_FILE_ENV}
    others[P.LAUNCHED_ENV] = "1"  # on Ctrl-C the launcher speaks for its roles, once
    return endpoint, {**others, P.ENDPOINT_FILE_ENV: str(endpoint)}, others


def await_address(path: Path, *, timeout: float) -> str:
    """The address the binding role wrote to `path` (`securevfl.roles.protocol.
    announce_endpoint`), waiting up to `timeout` seconds for it; refuses (RunAborted) a file
    that never comes or does not hold a tcp:// address."""
    from securevfl.preflight import check_address

    deadline = time.monotonic() + timeout
    while True:
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            text = None
        if text:
            check_address(text, key=f"the address in {path}")
            return text
        if time.monotonic() >= deadline:
            raise P.RunAborted(
                f"the aggregator did not write its address to {path} within {timeout:g} s "
                "([network] startup_timeout); see the aggregator's log (or the active party's, "
                "with aggregator_in_active) for why it did not start"
            )
        time.sleep(0.02)


@dataclass
class RoleProcess:
    role: str
    popen: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.popen.pid


def record_run(
    out: Path, config_path: Path, overrides: Mapping[str, Any], *, config_hash: str | None = None
) -> None:
    """What the run was started with (the config file and every --set), so that the model can
    be loaded and scored later from the run directory alone; the effective config itself is in
    `EFFECTIVE_CONFIG` (`securevfl.run_record`)."""
    record = {
        "config": str(Path(config_path).resolve()),
        "overrides": dict(overrides),
        "effective_config": EFFECTIVE_CONFIG,
        "config_hash": config_hash,
        "resumes": [],
    }
    (out / RUN_RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")


def load_run_config(run_dir: Path) -> tuple[RunConfig, Path]:
    """The config a run was made with: its record (config file + overrides), else the copy."""
    run_dir = Path(run_dir)
    record = run_dir / RUN_RECORD
    if record.exists():
        data = json.loads(record.read_text())
        path = Path(data["config"])
        if path.exists():
            return load_config(path, overrides=data.get("overrides") or None), path
    copy = run_dir / "config.toml"
    if not copy.exists():
        raise ConfigError("RUN_DIR", f"{run_dir} holds no run (no {RUN_RECORD} or config.toml)")
    return load_config(copy), copy


def prepare_run_dir(
    cfg: RunConfig,
    config_path: Path,
    out: Path,
    *,
    resume: bool,
    overrides: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Path:
    """Split the data, make keys and record the effective config (or, resuming, check that
    the run's record matches `cfg`: `check_resume`, refused unless `force`, and repair a torn
    ledger line). Returns the keys dir."""
    out.mkdir(parents=True, exist_ok=True)
    keys = out / "keys"
    if force and not resume:
        raise ConfigError("--force", "only applies with --resume (to continue a changed run)")
    if resume:
        missing = [r for r in cfg.role_names if not role_data_path(out, r).exists()]
        if missing or not (keys / "public.json").exists():
            raise ConfigError(
                "--resume",
                f"{out} holds no run to resume (no data files for {missing} or no "
                "keys); start it without --resume first",
            )
        repair_ledger(out)  # a torn last line, before anything appends (never under-counts)
        if read_record(out) is None:  # a run from before records: rebuild its own from run.json
            try:
                before, before_path = load_run_config(out)
            except ConfigError:
                before = None
            if before is not None:
                write_record(
                    out,
                    before,
                    data=launcher_digests(before, out, before.role_names),
                    written_by="launcher",
                    config_path=before_path,
                )
        check_resume(
            out,
            cfg,
            data=launcher_digests(cfg, out, cfg.role_names),
            force=force,
            who="launcher",
            config_path=Path(config_path),
            overrides=overrides or {},
            always_note=True,
        )
        return keys
    if any(epochs(out, r) for r in cfg.role_names) or (out / "metrics.json").exists():
        raise ConfigError(
            "--out",
            f"{out} already holds a run; continue it with --resume, or choose another "
            "--out directory",
        )
    split_federation(cfg, out)
    if (
        Path(config_path).resolve() != (out / "config.toml").resolve()
        and Path(config_path).exists()
    ):
        shutil.copyfile(config_path, out / "config.toml")
    generate_keys(cfg.role_names, keys, overwrite=True)
    record = write_record(
        out,
        cfg,
        data=launcher_digests(cfg, out, cfg.role_names),
        written_by="launcher",
        config_path=Path(config_path),
        overrides=overrides or {},
    )
    record_run(out, config_path, overrides or {}, config_hash=record["hash"])
    return keys


def role_commands(
    config_path: Path,
    cfg: RunConfig,
    *,
    out: Path,
    keys: Path,
    address: str,
    resume: bool,
    overrides: Sequence[str] = (),
    data: Mapping[str, Path] | None = None,
    predictions: Path | None = None,
    local: bool = False,
) -> dict[str, list[str]]:
    """The command of every role; with `predictions`, the roles score (`data`: the new rows of
    each role) instead of training. With [network] aggregator_in_active there is no aggregator
    command: the active party's process runs the aggregator (a thread binding `address`).
    `local` (the local launcher): the role that binds listens on `address` (e.g. `LOCAL_ANY`)
    and the others read where it listens from `out`'s endpoint file (`rendezvous`)."""
    base = [sys.executable, "-m", "securevfl"]
    common = ["--config", str(config_path), "--out", str(out), "--keys", str(keys)]
    for o in overrides:
        common += ["--set", o]
    extra = ["--resume"] if resume else []
    if predictions is not None:
        extra = ["--score"]
    data = data or {r: role_data_path(out, r) for r in cfg.role_names}
    cmds: dict[str, list[str]] = {}
    if not cfg.aggregator_in_active:
        cmds["aggregator"] = [
            *base,
            "aggregator",
            *common,
            "--bind",
            address,
            *(["--resume"] if resume and predictions is None else []),
        ]
    # aggregator_in_active: the active party's aggregator thread binds `address` itself
    colocated = ["--set", f"network.bind={json.dumps(address)}"] if cfg.aggregator_in_active else []
    connect = ["--address-file", str(out / ENDPOINT_FILE)] if local else ["--address", address]
    cmds[cfg.active_name] = [
        *base,
        "active",
        *common,
        *colocated,
        *(connect if not (local and cfg.aggregator_in_active) else []),
        "--data",
        str(data[cfg.active_name]),
        *extra,
        *(["--predictions", str(predictions)] if predictions is not None else []),
    ]
    for p in cfg.party_names:
        cmds[p] = [
            *base,
            "party",
            *common,
            "--name",
            p,
            *connect,
            "--data",
            str(data[p]),
            *extra,
        ]
    return cmds


def launch(
    config_path: Path,
    *,
    out: Path,
    resume: bool = False,
    overrides: Mapping[str, Any] | None = None,
    override_args: Sequence[str] = (),
    stdout: IO[str] | None = None,
    env: Mapping[str, str] | None = None,
    force: bool = False,
) -> int:
    """Run the federation; returns the exit status (0 ok, 2 config, 3 budget, 4 lost peer).
    `resume` continues the run in `out`, refusing a config that differs from the run's record
    unless `force` (`securevfl.run_record.check_resume`)."""
    cfg = load_config(config_path, overrides=overrides)
    if cfg.transport == "inproc":
        from securevfl.inproc import run_inproc

        return run_inproc(
            cfg,
            out=out,
            resume=resume,
            config_path=config_path,
            force=force,
            overrides=overrides,
        )
    out = Path(out).resolve()
    keys = prepare_run_dir(
        cfg, Path(config_path), out, resume=resume, overrides=overrides, force=force
    )
    cmds = role_commands(
        Path(config_path).resolve(),
        cfg,
        out=out,
        keys=keys,
        address=LOCAL_ANY,
        resume=resume,
        overrides=override_args,
        local=True,
    )
    return _start(cmds, cfg, out, stdout, env=env)


def pinned_cores(cfg: RunConfig, cmds: Mapping[str, Any]) -> dict[str, int]:
    """The core index of each role started on this machine ([run] pin_cores; none when
    off): the active party first, then the aggregator, then the parties, round-robin."""
    if not cfg.pin_cores:
        return {}
    from securevfl.threads import role_cpus

    first = [r for r in (cfg.active_name, "aggregator") if r in cmds]
    return role_cpus([*first, *(r for r in cmds if r not in first)])


def cpu_env(env: Mapping[str, str], index: int | None) -> dict[str, str]:
    """`env` for a role pinned to core `index` (`securevfl.threads.CPU_ENV`), or with no
    pinning when None (a value inherited from this process would pin every role to one core)."""
    from securevfl.threads import CPU_ENV

    out = {k: v for k, v in env.items() if k != CPU_ENV}
    if index is not None:
        out[CPU_ENV] = str(index)
    return out


def _start(
    cmds: Mapping[str, list[str]],
    cfg: RunConfig,
    out: Path,
    stdout: IO[str] | None,
    *,
    env: Mapping[str, str] | None = None,
) -> int:
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("OMP_NUM_THREADS", "1")  # many small processes share the cores
    # the role that binds (port 0: the kernel picks a free one) writes where it listens; the
    # others, started at once, read it when they are ready to connect (`await_address`)
    _, binder_env, others_env = rendezvous(out, child_env)
    binder = "aggregator" if "aggregator" in cmds else cfg.active_name
    cpus = pinned_cores(cfg, cmds)
    procs: list[RoleProcess] = []
    for role, cmd in cmds.items():
        is_active = role == cfg.active_name
        role_env = cpu_env(binder_env if role == binder else others_env, cpus.get(role))
        procs.append(
            RoleProcess(
                role,
                subprocess.Popen(
                    cmd,
                    env=role_env,
                    stdout=(stdout or sys.stdout) if is_active else subprocess.DEVNULL,
                ),
            )
        )
    (out / "pids.json").write_text("{" + ", ".join(f'"{p.role}": {p.pid}' for p in procs) + "}\n")
    from securevfl.roles.rounds import tolerates_dropout

    return supervise(
        procs,
        grace=cfg.peer_timeout + 10.0,
        active=cfg.active_name,
        run_dir=out,
        parties_may_drop=tolerates_dropout(cfg),
    )


def supervise(
    procs: Sequence[RoleProcess],
    *,
    grace: float,
    active: str,
    run_dir: Path,
    parties_may_drop: bool = False,
) -> int:
    """Wait for every role. If the aggregator or the active party fails, the others get `grace`
    seconds to stop on their own before they are terminated. A failed passive party is the
    aggregator's call: it aborts everyone (each role then stops within its deadline) or, for a
    method that tolerates dropouts (`parties_may_drop`), goes on without it; unless dropouts
    are tolerated, the others are terminated if they have not stopped `grace` seconds after it
    failed (a party that dies before it connects is otherwise noticed only when the start-up
    timeout ends)."""
    failed_at: float | None = None
    watched = {p.role for p in procs} if not parties_may_drop else {"aggregator", active}
    try:
        while True:
            codes = {p.role: p.popen.poll() for p in procs}
            if all(c is not None for c in codes.values()):
                break
            if failed_at is None and any(codes[r] not in (None, 0) for r in watched):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace:
                stop_within(procs, 0.0, waited=f"{grace:.0f} s of the failure")
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        # a role that got Ctrl-C from the terminal too ignores this second one (`_interrupt_once`)
        for p in procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGINT)
        stop_within(procs, grace)
        raise
    codes = {p.role: p.popen.returncode for p in procs}
    return overall_status(codes, active=active, run_dir=run_dir)


def stop_within(procs: Sequence[RoleProcess], seconds: float, *, waited: str | None = None) -> None:
    """Wait for `procs` to end, together at most `seconds`; then terminate those left (and kill
    any that ignore that for 5 s), naming each and how long they had (`waited`, default the
    seconds): a stop never hangs."""
    deadline = time.monotonic() + seconds
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(
                f"securevfl: {p.role} did not stop within {waited or f'{seconds:.0f} s'}; "
                "terminating it",
                file=sys.stderr,
            )
            p.popen.terminate()
    for p in procs:
        try:
            p.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


def overall_status(codes: Mapping[str, int], *, active: str, run_dir: Path) -> int:
    """The run's exit status from its roles' statuses. Parties the finished run lists as lost
    (a dropout-tolerant method went on without them) do not fail it."""
    if codes.get(active) == 0 and (run_dir / "metrics.json").exists():
        lost = set(json.loads((run_dir / "metrics.json").read_text()).get("lost_parties", []))
        codes = {r: (0 if r in lost else c) for r, c in codes.items()}
    if all(c == 0 for c in codes.values()):
        return P.EXIT_OK
    failed = {r: c for r, c in codes.items() if c != 0}
    print(f"securevfl: run failed; exit statuses {failed}", file=sys.stderr)
    for code in (P.EXIT_USAGE, P.EXIT_REFUSED, P.EXIT_BUDGET, P.EXIT_PEER_LOST):
        if code in failed.values():
            return code
    if any(c < 0 for c in failed.values()):  # killed by a signal: a role was lost
        return P.EXIT_PEER_LOST
    return codes.get(active) or P.EXIT_ERROR


def score_rows(
    run_dir: Path,
    *,
    data: Path,
    predictions: Path | None = None,
    stdout: IO[str] | None = None,
) -> int:
    """`securevfl predict`: the run's trained model scores the rows of the table `data`, one OS
    process per role (each reads only its own part of the rows); writes predictions.csv."""
    run_dir = Path(run_dir).resolve()
    cfg, config_path = load_run_config(run_dir)
    untrained = [r for r in (cfg.active_name, *cfg.party_names) if not epochs(run_dir, r)]
    if untrained:  # said now, before any role starts (each would find it only at set-up)
        raise ConfigError(
            "RUN_DIR",
            f"{run_dir} holds no trained checkpoint of {untrained}: train the model first "
            f"(securevfl run CONFIG --out {run_dir}), or resume an interrupted run with --resume",
        )
    work = run_dir / "predict"
    from securevfl.data.table import split_rows

    files = split_rows(cfg, Path(data), work / "data")
    predictions = Path(predictions or work / "predictions.csv").resolve()
    record = run_dir / RUN_RECORD
    overrides: list[str] = []
    if record.exists():
        overrides = [
            f"{k}={json.dumps(v)}" for k, v in json.loads(record.read_text())["overrides"].items()
        ]
    cmds = role_commands(
        config_path,
        cfg,
        out=run_dir,
        keys=run_dir / "keys",
        address=LOCAL_ANY,
        resume=False,
        overrides=overrides,
        data=files,
        predictions=predictions,
        local=True,
    )
    return _start(cmds, cfg, run_dir, stdout)
