"""Chaos: SIGKILL a random role of a real federation at a random time, resume, compare.

    python bench/chaos.py                                # 100 kills, bench/results/chaos.json
    python bench/chaos.py --kills 20 --aggregations mask,ckks --seed 3

Each kill starts a small federation (`securevfl run`: aggregator, active party and two passive
parties as separate OS processes over CURVE loopback) in a fresh run directory, SIGKILLs one
randomly chosen role process at a random instant, waits for the launcher to stop, checks the
run directory, resumes it (`securevfl run --resume`, same directory) and compares the result
with an uninterrupted run of the same config and seed:

* metrics: the test metrics and every epoch's training loss; and every role's final model
  (all tensors of its last checkpoint). plain and mask must be bit-identical; ckks (whose
  decryptions are noise-flooded, so two uninterrupted runs differ too) within `--ckks-tol`;
* hangs: the killed run must stop within `--stop-deadline` s of the kill, the resumed run must
  finish within `--run-deadline` s;
* orphans: every role pid the launcher started (RUN_DIR/pids.json), and any process whose
  command line names the run directory, must be gone once the launcher has exited;
* checkpoints: after the kill, every checkpoint file loads, and every passive party holds the
  epoch the active party will resume from; after the resume no partial file is left;
* ledger: after the kill it reads back strictly (no torn or corrupt line), and after the resume
  the pre-resume ledger is a byte prefix of the final one (append-only: no line lost).

Half of the kill instants are uniform over an uninterrupted run's life (start-up included),
half fall inside a random training epoch, so both start-up and mid-epoch kills are exercised;
each record says in which phase it landed. Kill instants that come after the run has already
ended are retried in a new directory (counted as ``missed``). `run_chain` (used by the CI
test) kills the same run directory several times in a row before it is allowed to finish.

Only processes this script started are signalled, by pid (each pid is checked to be a child
of our launcher, or to name our run directory, first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "bench" / "results" / "chaos.json"
ROLES = ("aggregator", "active", "alpha", "beta")


# ------------------------------------------------------------------------------ the federation


@dataclass(frozen=True)
class Federation:
    """A small synthetic federation: `rows` rows, two passive parties of two columns each."""

    rows: int = 400
    epochs: int = 6
    batch_size: int = 16
    seed: int = 0
    peer_timeout: float = 2.0
    # how long roles wait for each other at start-up: also how long a run whose party was
    # killed before it connected takes to stop (nobody is told it is gone)
    startup_timeout: float = 60.0
    # label DP with seeded noise (a test-only setting): a ledger line per epoch to check, and
    # resumed runs still reproduce the uninterrupted one (each epoch's noise is its own stream)
    label_dp: bool = True

    def write(self, directory: Path, aggregation: str) -> Path:
        """The data and the config in `directory`; returns the config path."""
        import numpy as np

        from securevfl.data.table import write_csv

        directory.mkdir(parents=True, exist_ok=True)
        data = directory / "data.csv"
        if not data.exists():
            rng = np.random.default_rng(1234)
            x = rng.normal(size=(self.rows, 4))
            y = x @ np.array([1.0, -0.8, 0.6, 0.9]) + 0.3 * rng.normal(size=self.rows) > 0
            write_csv(
                data,
                id_column="ID",
                ids=np.arange(1, self.rows + 1),
                columns=["X1", "X2", "X3", "X4"],
                values=x,
                label="Y",
                labels=y.astype(float),
            )
        config = directory / f"{aggregation}.toml"
        privacy = (
            "[privacy]\nnoise_seed = 7\nlabel_dp = { noise_multiplier = 2.0, clip = 1.0 }\n\n"
            if self.label_dp
            else ""
        )
        config.write_text(
            f"""[run]
method = "splitnn"
aggregation = "{aggregation}"
seed = {self.seed}
min_group = 2
shared_init = true  # compared with an uninterrupted run: one initial model

[data]
path = "data.csv"
id = "ID"
label = "Y"
task = "binary"
test_fraction = 0.25

[active]
columns = []

[parties.alpha]
columns = ["X1", "X2"]

[parties.beta]
columns = ["X3", "X4"]

[policy]
aggregations = ["plain", "mask", "ckks"]
config_seeds = true  # shared_init

{privacy}[train]
epochs = {self.epochs}
batch_size = {self.batch_size}
lr = 0.01

[model]
hidden = [16]
width = 4

[network]
heartbeat_interval = 0.2
peer_timeout = {self.peer_timeout}
round_timeout = 30.0
startup_timeout = {self.startup_timeout}
"""
        )
        return config


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")


def launch(config: Path, run_dir: Path, *, resume: bool, tag: str) -> subprocess.Popen:
    """`securevfl run` as a child process, its output kept in the run directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # the previous launch's pids (a resume): this launch writes its own once its roles started
    (run_dir / "pids.json").unlink(missing_ok=True)
    args = [sys.executable, "-m", "securevfl", "run", str(config), "--out", str(run_dir)]
    if resume:
        args.append("--resume")
    out = open(run_dir.parent / f"{run_dir.name}.{tag}.out", "w")
    err = open(run_dir.parent / f"{run_dir.name}.{tag}.err", "w")
    try:
        return subprocess.Popen(args, stdout=out, stderr=err, env=_env(), cwd=REPO)
    finally:
        out.close()
        err.close()


def wait(proc: subprocess.Popen, deadline: float) -> int | None:
    """The launcher's exit status, or None if it is still running after `deadline` s."""
    try:
        return proc.wait(timeout=max(deadline, 0.0))
    except subprocess.TimeoutExpired:
        return None


# ------------------------------------------------------------------------------ processes


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def role_pids(run_dir: Path) -> dict[str, int]:
    try:
        return {str(k): int(v) for k, v in json.loads((run_dir / "pids.json").read_text()).items()}
    except (OSError, ValueError):
        return {}


def processes_naming(run_dir: Path) -> list[int]:
    """Live (non-zombie) processes whose command line names `run_dir`."""
    needle = str(run_dir)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        stat = _stat(int(entry.name))
        if stat is not None and stat[0] != "Z" and needle in _cmdline(int(entry.name)):
            found.append(int(entry.name))
    return found


def orphans(run_dir: Path, pids: dict[str, int], *, grace: float = 3.0) -> list[dict[str, Any]]:
    """Role processes still alive after their launcher exited (waiting `grace` s for the ones
    being torn down); each is then killed, by pid, so that nothing outlives the bench."""
    until = time.monotonic() + grace
    while True:
        alive = {
            p
            for p in [*pids.values(), *processes_naming(run_dir)]
            if (s := _stat(p)) is not None and s[0] != "Z" and str(run_dir) in _cmdline(p)
        }
        if not alive or time.monotonic() > until:
            break
        time.sleep(0.1)
    left = []
    for pid in sorted(alive):
        role = next((r for r, p in pids.items() if p == pid), "?")
        left.append({"pid": pid, "role": role, "cmdline": _cmdline(pid)[:200]})
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def stop_everything(proc: subprocess.Popen, run_dir: Path) -> None:
    """After a hang: kill our launcher and the roles it started (by pid), and reap."""
    for pid in [*role_pids(run_dir).values(), *processes_naming(run_dir)]:
        if str(run_dir) in _cmdline(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


# ------------------------------------------------------------------------------ run state


def phase(run_dir: Path, epochs: int, resume_from: int = 0) -> str:
    """Where a run was when it was killed, from what its directory held (a resumed launch,
    which trains from epoch `resume_from`, until it writes a new checkpoint: its start-up or
    its first epoch, which the directory cannot tell apart)."""
    from securevfl.roles.checkpoint import latest_epoch

    last = latest_epoch(run_dir, "active")
    if resume_from > 0 and (last is None or last < resume_from):
        if resume_from >= epochs:
            return "resumed start-up or evaluation"
        return f"resumed start-up or training epoch {resume_from + 1}"
    if (run_dir / "metrics.json").exists():
        return "finished"
    if last is None:  # the active party writes privacy.json once set up, before epoch 1
        return "training epoch 1" if (run_dir / "privacy.json").exists() else "start-up"
    if last + 1 >= epochs:
        return "evaluation"
    return f"training epoch {last + 2}"


def check_checkpoints(run_dir: Path, *, after_resume: bool) -> list[str]:
    """Problems with the checkpoints: unreadable files, a party missing the epoch the active
    party resumes from, partial files left after a finished run."""
    from securevfl.errors import CheckpointError
    from securevfl.roles.checkpoint import checkpoint_dir, epochs, load_checkpoint

    problems = []
    for role in ROLES[1:]:
        for epoch in epochs(run_dir, role):
            try:
                load_checkpoint(run_dir, role, epoch)
            except CheckpointError as exc:
                problems.append(str(exc))
        d = checkpoint_dir(run_dir, role)
        if after_resume and d.exists():
            problems += [f"left behind: {p}" for p in d.iterdir() if p.name.endswith(".partial")]
    active = epochs(run_dir, "active")
    if active:
        for role in ROLES[2:]:
            if active[-1] not in epochs(run_dir, role):
                problems.append(
                    f"{role} lacks epoch {active[-1]}, which the active party resumes from "
                    f"(it has {epochs(run_dir, role)})"
                )
    return problems


def check_ledger(run_dir: Path) -> tuple[bytes, list[str]]:
    """(the ledger's bytes, problems): it must read back strictly, every line valid."""
    from securevfl.errors import LedgerError
    from securevfl.privacy.ledger import PrivacyLedger

    path = run_dir / "ledger.jsonl"
    if not path.exists():
        return b"", []
    data = path.read_bytes()
    try:
        PrivacyLedger.read(path)
    except LedgerError as exc:
        return data, [str(exc)]
    return data, []


def outcome(run_dir: Path) -> dict[str, Any]:
    """What a finished run produced: test metrics, losses, every role's final tensors."""
    import torch

    from securevfl.roles.checkpoint import latest_epoch, load_checkpoint

    metrics = json.loads((run_dir / "metrics.json").read_text())
    tensors: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    for role in ROLES[1:]:
        last = latest_epoch(run_dir, role)
        if last is not None:
            walk(f"{role}@{last}", load_checkpoint(run_dir, role, last)["method"])
    return {
        "test": metrics["test"],
        "losses": [h["loss"] for h in metrics["history"]],
        "tensors": tensors,
    }


def compare(reference: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Largest differences between two outcomes (0 everywhere: identical)."""
    import torch

    same_keys = set(reference["tensors"]) == set(got["tensors"])
    tensor_diff = 0.0
    identical_tensors = same_keys
    if same_keys:
        for k, a in reference["tensors"].items():
            b = got["tensors"][k]
            if a.shape != b.shape or a.dtype != b.dtype:
                identical_tensors = False
                tensor_diff = float("inf")
                continue
            if not torch.equal(a, b):
                identical_tensors = False
                if a.is_floating_point():
                    tensor_diff = max(tensor_diff, float((a.double() - b.double()).abs().max()))
                else:
                    tensor_diff = float("inf")
    losses_a, losses_b = reference["losses"], got["losses"]
    loss_diff = (
        max((abs(x - y) for x, y in zip(losses_a, losses_b, strict=True)), default=0.0)
        if len(losses_a) == len(losses_b)
        else float("inf")
    )
    metric_diff = max(
        (abs(reference["test"][k] - got["test"].get(k, float("inf"))) for k in reference["test"]),
        default=0.0,
    )
    identical = identical_tensors and reference["test"] == got["test"] and losses_a == losses_b
    return {
        "identical": identical,
        "metric_diff": metric_diff,
        "loss_diff": loss_diff,
        "tensor_diff": tensor_diff if same_keys else float("inf"),
    }


# ------------------------------------------------------------------------------ one kill


@dataclass
class Kill:
    index: int
    aggregation: str
    role: str
    pid: int
    planned: str  # "uniform" over the run's life, or "in-epoch"
    phase: str = ""
    at_seconds: float = 0.0  # after the roles were started
    killed_status: int | None = None
    stop_seconds: float | None = None  # from the kill to the launcher's exit
    hang: bool = False
    orphans: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_problems: list[str] = field(default_factory=list)
    ledger_problems: list[str] = field(default_factory=list)
    resumed_status: int | None = None
    resumed_seconds: float | None = None
    identical: bool = False
    within_tolerance: bool = False
    diff: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass
class Timing:
    """An uninterrupted run's life after its roles started, and its mean training epoch."""

    roles_seconds: float
    epoch_seconds: float


def reference_run(
    fed: Federation, directory: Path, aggregation: str, *, deadline: float
) -> tuple[dict[str, Any], Timing]:
    config = fed.write(directory, aggregation)
    run_dir = directory / f"reference-{aggregation}-{len(list(directory.glob('reference-*')))}"
    proc = launch(config, run_dir, resume=False, tag="run")
    started = _roles_started(proc, run_dir, deadline)
    code = wait(proc, deadline - (time.monotonic() - started))
    if code is None:
        stop_everything(proc, run_dir)
        raise RuntimeError(f"the uninterrupted {aggregation} run did not finish in {deadline} s")
    if code != 0:
        raise RuntimeError(
            f"the uninterrupted {aggregation} run failed ({code}): "
            + (run_dir.parent / f"{run_dir.name}.run.err").read_text()[-2000:]
        )
    total = time.monotonic() - started
    metrics = json.loads((run_dir / "metrics.json").read_text())
    epochs = sum(metrics["epoch_seconds"])
    timing = Timing(
        roles_seconds=total, epoch_seconds=epochs / max(len(metrics["epoch_seconds"]), 1)
    )
    return outcome(run_dir), timing


def _roles_started(proc: subprocess.Popen, run_dir: Path, deadline: float) -> float:
    """Wait for the launcher to write pids.json (every role started); returns that instant."""
    until = time.monotonic() + deadline
    while not (run_dir / "pids.json").exists():
        if proc.poll() is not None:
            raise RuntimeError(
                f"the launcher exited ({proc.returncode}) before starting the roles: "
                + (run_dir.parent / f"{run_dir.name}.run.err").read_text()[-2000:]
            )
        if time.monotonic() > until:
            raise RuntimeError("the launcher did not start the roles in time")
        time.sleep(0.02)
    return time.monotonic()


def kill_once(
    proc: subprocess.Popen,
    run_dir: Path,
    *,
    rng: random.Random,
    timing: Timing,
    fed: Federation,
    record: Kill,
    deadline: float,
    resume_from: int = 0,
) -> bool:
    """Kill `record.role` at a random instant of the launch `proc`, which trains epochs
    `resume_from`.. (0-based; a resumed launch starts after its last checkpoint). Returns False
    when the run had ended before the instant came (nothing was killed)."""
    from securevfl.roles.checkpoint import latest_epoch

    started = _roles_started(proc, run_dir, deadline)
    pids = role_pids(run_dir)
    record.pid = pids[record.role]
    # in a resumed launch, an epoch is known to be under way once the checkpoint before it is
    # new, so in-epoch kills pick among the epochs after the first one it trains
    first = 0 if resume_from == 0 else resume_from + 1
    if record.planned == "in-epoch" and first >= fed.epochs:
        record.planned = "uniform"  # no such epoch left
    if record.planned == "uniform":  # over this launch's life: start-up and what it trains
        startup = max(timing.roles_seconds - fed.epochs * timing.epoch_seconds, 0.0)
        life = startup + max(fed.epochs - resume_from, 0) * timing.epoch_seconds
        until = started + rng.uniform(0.0, life)
        while time.monotonic() < until and proc.poll() is None:
            time.sleep(0.005)
    else:  # inside a random epoch: after the checkpoint before it, part-way through it
        epoch = rng.randrange(first, fed.epochs)
        until = time.monotonic() + deadline
        while proc.poll() is None and time.monotonic() < until:
            last = latest_epoch(run_dir, "active")
            if epoch == 0 and (run_dir / "privacy.json").exists():
                break
            if epoch > 0 and last is not None and last >= epoch - 1:
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, timing.epoch_seconds))
    stat = _stat(record.pid)
    if proc.poll() is not None or stat is None or stat[1] != proc.pid or stat[0] == "Z":
        return False  # the run (or this role) already ended
    record.phase = phase(run_dir, fed.epochs, resume_from)
    record.at_seconds = round(time.monotonic() - started, 3)
    os.kill(record.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    code = wait(proc, deadline)
    if code is None:
        record.hang = True
        stop_everything(proc, run_dir)
    else:
        record.stop_seconds = round(time.monotonic() - killed_at, 3)
    record.killed_status = proc.returncode
    record.orphans = orphans(run_dir, pids)
    return True


def resume_to_end(
    config: Path, run_dir: Path, *, deadline: float, tag: str
) -> tuple[int | None, float, list[dict[str, Any]]]:
    """`securevfl run --resume` until it ends: (status or None on a hang, seconds, orphans)."""
    started = time.monotonic()
    proc = launch(config, run_dir, resume=True, tag=tag)
    code = wait(proc, deadline)
    if code is None:
        stop_everything(proc, run_dir)
    seconds = time.monotonic() - started
    return code, seconds, orphans(run_dir, role_pids(run_dir))


def judge(
    record: Kill, reference: dict[str, Any], run_dir: Path, ckks_tol: float, *, tag: str
) -> None:
    if record.resumed_status != 0 or not (run_dir / "metrics.json").exists():
        err = run_dir.parent / f"{run_dir.name}.{tag}.err"
        record.error = record.error or (err.read_text()[-1000:] if err.exists() else "failed")
        return
    record.diff = compare(reference, outcome(run_dir))
    record.identical = bool(record.diff["identical"])
    record.within_tolerance = record.identical or (
        record.aggregation == "ckks"
        and record.diff["metric_diff"] <= ckks_tol
        and record.diff["loss_diff"] <= ckks_tol
    )


def one_kill(
    index: int,
    *,
    fed: Federation,
    work: Path,
    aggregation: str,
    reference: dict[str, Any],
    timing: Timing,
    rng: random.Random,
    stop_deadline: float,
    run_deadline: float,
    ckks_tol: float,
    max_attempts: int = 5,
) -> tuple[Kill, int]:
    """One kill and its resume in a fresh run directory; returns (record, missed attempts)."""
    config = fed.write(work, aggregation)
    missed = 0
    for attempt in range(max_attempts):
        run_dir = work / f"kill-{index:03d}-{attempt}"
        record = Kill(
            index=index,
            aggregation=aggregation,
            role=rng.choice(ROLES),
            pid=0,
            planned=rng.choice(("uniform", "in-epoch")),
        )
        proc = launch(config, run_dir, resume=False, tag="run")
        try:
            killed = kill_once(
                proc,
                run_dir,
                rng=rng,
                timing=timing,
                fed=fed,
                record=record,
                deadline=stop_deadline,
            )
        except RuntimeError as exc:
            stop_everything(proc, run_dir)
            record.error = str(exc)
            return record, missed
        if not killed:
            proc.wait()
            missed += 1
            continue
        record.checkpoint_problems = check_checkpoints(run_dir, after_resume=False)
        before, record.ledger_problems = check_ledger(run_dir)
        code, seconds, left = resume_to_end(config, run_dir, deadline=run_deadline, tag="resume")
        record.resumed_status, record.resumed_seconds = code, round(seconds, 3)
        record.hang = record.hang or code is None
        record.orphans += left
        record.checkpoint_problems += check_checkpoints(run_dir, after_resume=True)
        after, problems = check_ledger(run_dir)
        record.ledger_problems += problems
        if not after.startswith(before):
            record.ledger_problems.append(
                "the ledger lost or changed lines written before the kill"
            )
        judge(record, reference, run_dir, ckks_tol, tag="resume")
        return record, missed
    record.error = f"every one of {max_attempts} kill instants came after the run had ended"
    return record, missed


def run_chain(
    *,
    fed: Federation,
    work: Path,
    aggregation: str,
    kills: int,
    seed: int,
    stop_deadline: float = 60.0,
    run_deadline: float = 300.0,
    ckks_tol: float = 0.02,
    reference: str = "processes",
) -> dict[str, Any]:
    """Kill the same run directory `kills` times (each resume may be killed again), then let
    it finish, and compare with an uninterrupted run: `reference` "processes" (`securevfl
    run`) or "inproc" (the same roles as threads over the in-process transport, which gives
    the same bits for plain and mask and saves a launch; not for ckks). Used by the CI test.
    Whatever happens (a failure, a test timeout), the processes it started are stopped."""
    rng = random.Random(seed)
    if reference == "inproc":
        ref, timing = reference_inproc(fed, work, aggregation)
    else:
        ref, timing = reference_run(fed, work, aggregation, deadline=run_deadline)
    config = fed.write(work, aggregation)
    run_dir = work / "chain"
    try:
        return _chain(
            fed=fed,
            config=config,
            run_dir=run_dir,
            aggregation=aggregation,
            kills=kills,
            rng=rng,
            timing=timing,
            reference=ref,
            stop_deadline=stop_deadline,
            run_deadline=run_deadline,
            ckks_tol=ckks_tol,
        )
    except BaseException:
        for pid in [*role_pids(run_dir).values(), *processes_naming(run_dir)]:
            if str(run_dir) in _cmdline(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        raise


def reference_inproc(fed: Federation, directory: Path, aggregation: str) -> tuple[dict, Timing]:
    """An uninterrupted run of every role as a thread of this process (in-process transport).
    Its timing stands for a launch's life: roughly its training, since nothing starts up."""
    import dataclasses

    from securevfl.config import load_config
    from securevfl.inproc import run_inproc

    config = fed.write(directory, aggregation)
    cfg = dataclasses.replace(load_config(config), transport="inproc")
    run_dir = directory / f"reference-{aggregation}-inproc"
    started = time.monotonic()
    code = run_inproc(cfg, out=run_dir, resume=False, config_path=config)
    if code != 0:
        raise RuntimeError(f"the uninterrupted in-process {aggregation} run failed ({code})")
    total = time.monotonic() - started
    metrics = json.loads((run_dir / "metrics.json").read_text())
    epoch = sum(metrics["epoch_seconds"]) / max(len(metrics["epoch_seconds"]), 1)
    return outcome(run_dir), Timing(roles_seconds=total, epoch_seconds=epoch)


def _chain(
    *,
    fed: Federation,
    config: Path,
    run_dir: Path,
    aggregation: str,
    kills: int,
    rng: random.Random,
    timing: Timing,
    reference: dict[str, Any],
    stop_deadline: float,
    run_deadline: float,
    ckks_tol: float,
) -> dict[str, Any]:
    from securevfl.roles.checkpoint import latest_epoch

    records: list[Kill] = []
    launches = 0
    ledger_before = b""
    ledger_problems: list[str] = []
    while len(records) < kills and launches < 3 * kills:
        record = Kill(
            index=len(records),
            aggregation=aggregation,
            role=rng.choice(ROLES),
            pid=0,
            # alternate, so that even a short chain kills both in training and at start-up
            planned=("in-epoch", "uniform")[len(records) % 2],
        )
        last = latest_epoch(run_dir, "active")
        proc = launch(config, run_dir, resume=launches > 0, tag=f"launch{launches}")
        launches += 1
        if kill_once(
            proc,
            run_dir,
            rng=rng,
            timing=timing,
            fed=fed,
            record=record,
            deadline=stop_deadline,
            resume_from=0 if last is None else last + 1,
        ):
            record.checkpoint_problems = check_checkpoints(run_dir, after_resume=False)
            data, problems = check_ledger(run_dir)
            if not data.startswith(ledger_before):
                problems.append("the ledger lost or changed lines written before a kill")
            ledger_before, ledger_problems = data, ledger_problems + problems
            record.ledger_problems = problems
            records.append(record)
        else:
            proc.wait()
    code, seconds, left = resume_to_end(config, run_dir, deadline=run_deadline, tag="final")
    final = Kill(index=-1, aggregation=aggregation, role="", pid=0, planned="final")
    final.resumed_status, final.hang, final.orphans = code, code is None, left
    final.checkpoint_problems = check_checkpoints(run_dir, after_resume=True)
    data, final.ledger_problems = check_ledger(run_dir)
    if not data.startswith(ledger_before):
        final.ledger_problems.append("the ledger lost or changed lines written before a kill")
    judge(final, reference, run_dir, ckks_tol, tag="final")
    return {"kills": [asdict(r) for r in records], "final": asdict(final), "launches": launches}


# ------------------------------------------------------------------------------ the bench


def summarize(records: list[Kill], missed: int, wall: float) -> dict[str, Any]:
    def count(key: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in records:
            value = getattr(r, key)
            value = value.split(" epoch")[0] if key == "phase" else value
            out[value] = out.get(value, 0) + 1
        return dict(sorted(out.items()))

    stops = [r.stop_seconds for r in records if r.stop_seconds is not None]
    exact = [r for r in records if r.aggregation != "ckks"]
    ckks = [r for r in records if r.aggregation == "ckks"]
    return {
        "kills": len(records),
        "resumed_ok": sum(r.resumed_status == 0 for r in records),
        "identical_metrics": sum(r.identical for r in records),
        "identical_plain_mask": f"{sum(r.identical for r in exact)}/{len(exact)}",
        "ckks_within_tolerance": f"{sum(r.within_tolerance for r in ckks)}/{len(ckks)}",
        "ckks_max_metric_diff": max((r.diff.get("metric_diff", 0.0) for r in ckks), default=0.0),
        "ckks_max_loss_diff": max((r.diff.get("loss_diff", 0.0) for r in ckks), default=0.0),
        "hangs": sum(r.hang for r in records),
        "orphans": sum(len(r.orphans) for r in records),
        "checkpoint_problems": sum(len(r.checkpoint_problems) for r in records),
        "ledger_problems": sum(len(r.ledger_problems) for r in records),
        "errors": sum(bool(r.error) for r in records),
        "missed_kill_instants": missed,
        "stop_seconds_median": statistics.median(stops) if stops else None,
        "stop_seconds_max": max(stops) if stops else None,
        "by_role": count("role"),
        "by_phase": count("phase"),
        "by_aggregation": count("aggregation"),
        "wall_seconds": round(wall, 1),
    }


def write_result(
    args: argparse.Namespace,
    argv: list[str] | None,
    records: list[Kill],
    missed: int,
    started: float,
    spread: dict[str, Any],
    fed: Federation,
    aggregations: list[str],
) -> dict[str, Any]:
    """Write what has run so far (after every kill, so a stopped bench still reports)."""
    result = {
        "summary": {
            **summarize(records, missed, time.monotonic() - started),
            "planned": args.kills,
        },
        "ckks_run_to_run_spread": spread,
        "federation": asdict(fed),
        "aggregations": aggregations,
        "command": "python bench/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_1min": round(os.getloadavg()[0], 2),
        },
        "kills": [asdict(r) for r in records],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".partial")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(args.out)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--aggregations", default="mask,plain,ckks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument(
        "--peer-timeout",
        type=float,
        default=2.0,
        help="[network] peer_timeout: raise it on a loaded machine, where a starved role's "
        "heartbeats can be late",
    )
    ap.add_argument("--stop-deadline", type=float, default=60.0, help="kill -> launcher exit")
    ap.add_argument("--run-deadline", type=float, default=300.0, help="a whole resumed run")
    ap.add_argument("--ckks-tol", type=float, default=0.02, help="|metric or loss difference|")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="stop starting new kills after this many seconds (the result says how many ran)",
    )
    ap.add_argument("--work", type=Path, help="keep run directories here (default: temporary)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    fed = Federation(
        rows=args.rows, epochs=args.epochs, seed=args.seed, peer_timeout=args.peer_timeout
    )
    aggregations = [a.strip() for a in args.aggregations.split(",") if a.strip()]
    rng = random.Random(args.seed)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="securevfl-chaos-") as tmp:
        work = (args.work or Path(tmp)).resolve()
        references: dict[str, tuple[dict[str, Any], Timing]] = {}
        spread: dict[str, Any] = {}
        for a in aggregations:
            references[a] = reference_run(fed, work, a, deadline=args.run_deadline)
            print(f"reference {a}: {references[a][1]}", flush=True)
            if a == "ckks":  # two uninterrupted ckks runs differ too: how much
                again, _ = reference_run(fed, work, a, deadline=args.run_deadline)
                spread = compare(references[a][0], again)
                print(f"ckks run-to-run spread: {spread}", flush=True)
        records: list[Kill] = []
        missed = 0
        for i in range(args.kills):
            if args.budget is not None and time.monotonic() - started > args.budget:
                print(f"budget of {args.budget:.0f} s spent after {i} kills", flush=True)
                break
            a = aggregations[i % len(aggregations)]
            reference, timing = references[a]
            record, m = one_kill(
                i,
                fed=fed,
                work=work,
                aggregation=a,
                reference=reference,
                timing=timing,
                rng=rng,
                stop_deadline=args.stop_deadline,
                run_deadline=args.run_deadline,
                ckks_tol=args.ckks_tol,
            )
            missed += m
            records.append(record)
            print(
                f"[{i + 1}/{args.kills}] {a} kill {record.role} ({record.planned}, "
                f"{record.phase}, {record.at_seconds} s): stopped in {record.stop_seconds} s, "
                f"resumed {record.resumed_status}, identical {record.identical}, "
                f"within tolerance {record.within_tolerance}"
                + (f", ERROR {record.error[:200]}" if record.error else ""),
                flush=True,
            )
            write_result(args, argv, records, missed, started, spread, fed, aggregations)
    result = write_result(args, argv, records, missed, started, spread, fed, aggregations)
    print(json.dumps(result["summary"], indent=2))
    s = result["summary"]
    ok = (
        s["resumed_ok"] == s["kills"]
        and s["hangs"] == 0
        and s["orphans"] == 0
        and s["checkpoint_problems"] == 0
        and s["ledger_problems"] == 0
        and all(r.within_tolerance for r in records)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
