"""`securevfl bench [--quick] [--out DIR]`: one benchmark report.

Runs, side by side in one process tree, and writes DIR/report.md (tables), PNG plots, the raw
JSON (DIR/report.json), the machine, the versions and the exact command:

- **credit**: split-NN on Credit (X1..X20 in four parties of five columns), batch 256, real
  processes (one per role, ZeroMQ + CURVE): `plain`, `mask`, `ckks` over loopback (the secure
  vs plain overhead: epoch time, bytes, peak RSS), and `plain`/`mask` behind the WAN emulator
  (`bench/wanproxy.py`: 10 and 50 ms RTT, 100 Mbit/s), every point interleaved with the others
  and repeated; the epoch-time ratio to loopback and where the added time goes.
- **scaling**: synthetic tables; epoch time, bytes and peak RSS against the number of parties
  (2, 4, 8, 16), rows (10^4, 10^5, 10^6) and batch size (64, 256, 1024) for plain/mask/ckks,
  and the federated-plain vs centralised single-process epoch of the same model.
- **privacy_utility**: `bench/privacy_utility.py` (label DP: F1 and label-inference AUC).
- **crypto**: `bench/masked_sum_curve.py` and `bench/ckks_params.py` in their quick modes.
- **gpu**: party models on cuda vs cpu where a GPU is visible; otherwise says there is none.

    python bench/report.py [--quick] [--out DIR] [--only credit,scaling,...] [--data CSV]
        [--budget-minutes M] [--render]

`--quick` is a smoke-sized version (fewer points, one repeat: 22 minutes on a 2-core machine at
load average 24); the full run takes well over an hour there, so `--budget-minutes` stops
starting new runs after M minutes and the report names what it did not reach. Each federated
run pays its six to eighteen processes' start-up (about a minute under load) on top of its
epochs. Numbers on a shared machine are noisy: ratios are taken between runs interleaved in the
same invocation, medians over epochs and repeats, and the load average is recorded next to
every run. `--render` rewrites report.md and the plots from OUT/report.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (str(REPO), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import fedbench as F  # noqa: E402

SUITES = ("crypto", "credit", "scaling", "privacy_utility", "gpu")
MODES = ("plain", "mask", "ckks")
COLORS = {"plain": "#777777", "mask": "#22aa77", "ckks": "#2277cc", "centralised": "#cc7722"}
# the floors (issue #17), checked in the report
FLOOR_WAN_10MS = 1.5
FLOOR_MASK = 1.1
FLOOR_CKKS = 1.5
FLOOR_CKKS_BYTES = 10.0
FLOOR_FED_CENTRAL = 3.0


# --- plans


def plan(quick: bool) -> dict[str, Any]:
    """What each suite runs. Quick: a smoke-sized version of every suite."""
    if quick:
        return {
            "credit": {
                "repeats": 1,
                "epochs": 2,
                "points": [
                    ["plain", None],
                    ["mask", None],
                    ["ckks", None],
                    ["plain", 10.0],
                    ["mask", 10.0],
                    ["mask", 10.0, 8],  # [network] pipeline_depth = 8
                ],
                "mbit": 100.0,
            },
            "scaling": {
                "parties": {"k": [2, 4], "rows": 10_000, "modes": ["plain", "mask"], "epochs": 2},
                "rows": {"n": [10_000], "modes": ["plain", "mask"], "epochs": 1},
                "batch": {
                    "b": [256, 1024],
                    "rows": 10_000,
                    "modes": ["plain", "mask"],
                    "epochs": 2,
                },
                "skipped": [
                    "quick: 8 and 16 parties, 10^5 and 10^6 rows, batch 64 and ckks scaling "
                    "run only in the full report"
                ],
            },
            "privacy_utility": ["--seeds", "0", "--eps", "1", "inf", "--epochs", "2"],
            "crypto": {"masked_sum": ["--quick"], "ckks_params": ["--quick"]},
        }
    return {
        "credit": {
            "repeats": 2,
            "epochs": 2,
            "points": [
                ["plain", None],
                ["mask", None],
                ["ckks", None],
                ["mask", 0.0],  # the proxy alone (and the 100 Mbit/s cap), no added latency
                ["plain", 10.0],
                ["mask", 10.0],
                ["plain", 50.0],
                ["mask", 50.0],
                # pipelined split-NN ([network] pipeline_depth = 8): loopback, 10 and 50 ms
                ["mask", None, 8],
                ["mask", 10.0, 8],
                ["mask", 50.0, 8],
                # the same with the aggregator in the active party's process (1 RTT a batch)
                ["mask", None, 8, {"aggregator_in_active": True}],
                ["mask", 10.0, 8, {"aggregator_in_active": True}],
            ],
            "mbit": 100.0,
        },
        "scaling": {
            "parties": {"k": [2, 4, 8, 16], "rows": 10_000, "modes": list(MODES), "epochs": 3},
            "rows": {
                "n": [10_000, 100_000, 1_000_000],
                "modes": list(MODES),
                "epochs": 1,
                # ckks at 10^6 rows: ~3900 batches of encryption per party on 2 shared cores
                "skip": {"1000000": ["ckks"]},
            },
            "batch": {"b": [64, 256, 1024], "rows": 10_000, "modes": list(MODES), "epochs": 3},
            "skipped": [
                "ckks at 10^6 rows: about 10x its 10^5-row epoch (linear in rows, see the table), "
                "too long for this report on 2 cores"
            ],
        },
        "privacy_utility": [
            "--seeds",
            "0",
            "1",
            "--eps",
            "0.5",
            "2",
            "8",
            "inf",
            "--epochs",
            "5",
        ],
        "crypto": {"masked_sum": ["--quick"], "ckks_params": ["--quick"]},
    }


def _colocated(scaling: Mapping[str, Any]) -> int:
    """1 when the parties series also runs plain with [network] aggregator_in_active."""
    return int("plain" in scaling["parties"]["modes"])


def count_steps(p: Mapping[str, Any], suites: Sequence[str]) -> int:
    n = 0
    if "credit" in suites:
        n += 1 + p["credit"]["repeats"] * len(p["credit"]["points"])
    if "scaling" in suites:
        s = p["scaling"]
        # + the centralised run, the table, and plain with the aggregator in the active party
        n += len(s["parties"]["k"]) * (len(s["parties"]["modes"]) + 2 + _colocated(s))
        n += sum(len(s["rows"]["modes"]) + 2 for _ in s["rows"]["n"])
        n += len(s["batch"]["b"]) * len(s["batch"]["modes"])
    if "privacy_utility" in suites:
        n += 1
    if "crypto" in suites:
        n += 2
    if "gpu" in suites:
        n += 1
    return n


# --- machine and versions


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "kernel": platform.release(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg": F.loadavg(),
    }
    if (model := F.cpu_model()) is not None:
        info["cpu_model"] = model
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["ram_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    info["netem"] = netem_probe()
    return info


def netem_probe() -> str:
    """Whether the kernel offers netem, tried in a throwaway network namespace (never on a
    real interface)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return "not probed (needs root, ip and tc)"
    ns = f"svfl-netem-probe-{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
        if made.returncode != 0:
            return f"not probed (ip netns add: {made.stderr.strip()})"
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], capture_output=True)
        tried = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem"]
            + ["delay", "1ms"],
            capture_output=True,
            text=True,
        )
        if tried.returncode == 0:
            return "available"
        return f"unavailable: {tried.stderr.strip() or tried.stdout.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in (
        "securevfl",
        "torch",
        "tenseal",
        "opacus",
        "pyzmq",
        "numpy",
        "cryptography",
        "matplotlib",
        "rich",
    ):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        import zmq

        out["libzmq"] = zmq.zmq_version()
    except ImportError:
        pass
    return out


# --- the runner


class Bench:
    """Runs the suites, shows progress, keeps the raw JSON up to date after every step."""

    def __init__(
        self,
        *,
        out: Path,
        work: Path,
        quick: bool,
        data: Path,
        suites: Sequence[str],
        command: str,
        progress: Any = None,
        budget_minutes: float | None = None,
    ) -> None:
        self.out = out
        self.budget_s = None if budget_minutes is None else 60.0 * budget_minutes
        self.work = work
        self.quick = quick
        self.data = data
        self.suites = list(suites)
        self.plan = plan(quick)
        self.progress = progress
        self.task = None
        self.results: dict[str, Any] = {
            "schema": 1,
            "command": command,
            "quick": quick,
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "versions": versions(),
            "plan": self.plan,
            "budget_minutes": budget_minutes,
            "suites": {},
        }
        self._t0 = time.perf_counter()

    def step(self, label: str) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, description=label)

    def advance(self, steps: int = 1) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.advance(self.task, steps)
        self.save()

    def over_budget(self, record: dict[str, Any] | None = None, what: str = "") -> bool:
        """Whether the time budget (--budget-minutes) is spent: what is left is not started
        (named in record["not_run"]), so a report always finishes."""
        if self.budget_s is None or time.perf_counter() - self._t0 < self.budget_s:
            return False
        if record is not None and what:
            record.setdefault("not_run", []).append(what)
        return True

    def save(self) -> None:
        self.results["wall_seconds"] = round(time.perf_counter() - self._t0, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "report.json.partial"
        tmp.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "report.json")

    def run(self) -> dict[str, Any]:
        if self.progress is not None:
            self.task = self.progress.add_task(
                "starting", total=count_steps(self.plan, self.suites)
            )
        for suite in self.suites:
            started = time.perf_counter()
            try:
                result = getattr(self, f"suite_{suite}")()
            except Exception as exc:  # a failed suite is reported, the others still run
                result = {"error": f"{type(exc).__name__}: {exc}"}
            result["seconds"] = round(time.perf_counter() - started, 1)
            self.results["suites"][suite] = result
            self.save()
        self.results["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.results["machine"]["loadavg_end"] = F.loadavg()
        self.save()
        return self.results

    # --- credit: overhead + WAN

    def suite_credit(self) -> dict[str, Any]:
        p = self.plan["credit"]
        if not self.data.exists():
            return {"error": f"no Credit table at {self.data}; pass --data PATH/credit_default.csv"}
        if self.over_budget():
            return {"runs": [], "points": [], "not_run": ["every credit run (time budget)"]}
        self.step("credit: split and keys")
        ds = F.credit(self.data, parties=4)
        prep = F.prepare(ds, self.work)
        self.advance()
        runs: list[dict[str, Any]] = []
        not_run: dict[str, Any] = {"not_run": []}
        for rep in range(p["repeats"]):
            for mode, rtt, *rest in p["points"]:
                depth = int(rest[0]) if rest else 0
                colocated = bool(len(rest) > 1 and rest[1].get("aggregator_in_active"))
                tag = _net(rtt) + (f" depth {depth}" if depth else "")
                tag += " aggregator in active" if colocated else ""
                label = f"credit {mode} {tag} (repeat {rep + 1}/{p['repeats']})"
                if self.over_budget(not_run, label):
                    self.advance()
                    continue
                self.step(label)
                raw = F.config_raw(ds, aggregation=mode, epochs=p["epochs"], batch_size=256)
                if depth:
                    raw["network"]["pipeline_depth"] = depth
                raw["network"]["aggregator_in_active"] = colocated
                r = F.run_federation(
                    prep,
                    raw,
                    self.work / "credit" / f"r{rep}-{mode}-{_net(rtt)}-d{depth}-c{int(colocated)}",
                    rtt_ms=rtt,
                    mbit=p["mbit"],
                )
                r["repeat"] = rep
                runs.append(r)
                self.results["suites"]["credit"] = {"runs": runs, "mbit": p["mbit"], **not_run}
                self.advance()
        return {**summarise_credit(runs, mbit=p["mbit"]), **not_run}

    # --- scaling

    def _point(
        self,
        prep: F.Prepared,
        *,
        mode: str,
        epochs: int,
        batch: int,
        tag: str,
        colocated: bool = False,
    ) -> dict[str, Any] | None:
        ds = prep.dataset
        name = f"{mode}, aggregator in the active party" if colocated else mode
        if self.over_budget(self.results["suites"]["scaling"], f"{name} {tag}"):
            self.advance()
            return None
        self.step(f"scaling {tag}: {name}")
        raw = F.config_raw(ds, aggregation=mode, epochs=epochs, batch_size=batch)
        raw["network"]["aggregator_in_active"] = colocated
        where = f"{tag}-{mode}" + ("-colocated" if colocated else "")
        r = F.run_federation(prep, raw, self.work / "scaling" / where)
        self.advance()
        return r

    def _centralised(
        self, prep: F.Prepared, *, epochs: int, batch: int, tag: str
    ) -> dict[str, Any] | None:
        if self.over_budget(self.results["suites"]["scaling"], f"centralised {tag}"):
            self.advance()
            return None
        self.step(f"scaling {tag}: centralised")
        raw = F.config_raw(prep.dataset, aggregation="plain", epochs=epochs, batch_size=batch)
        r = F.run_centralised(prep, raw, self.work / "scaling" / f"{tag}-centralised")
        r.update(parties=len(prep.dataset.parties), rows=prep.dataset.rows, batch_size=batch)
        self.advance()
        return r

    def suite_scaling(self) -> dict[str, Any]:
        s = self.plan["scaling"]
        data_dir = self.work / "tables"
        out: dict[str, Any] = {
            "parties": [],
            "rows": [],
            "batch": [],
            "centralised": [],
            # plain with [network] aggregator_in_active (one process and hop fewer per round)
            "colocated": [],
            "skipped": list(s["skipped"]),
            "not_run": [],
            "prepare_seconds": {},
        }
        self.results["suites"]["scaling"] = out
        preps: dict[tuple[int, int], F.Prepared] = {}

        def prepared(rows: int, k: int) -> F.Prepared:
            if (rows, k) not in preps:
                self.step(f"scaling: table {rows} rows x {k} parties")
                ds = F.synthetic(data_dir, rows=rows, parties=k)
                preps[rows, k] = F.prepare(ds, self.work)
                out["prepare_seconds"][f"{rows}x{k}"] = round(preps[rows, k].seconds, 1)
            return preps[rows, k]

        def same(series: str, **want: Any) -> dict[str, Any] | None:
            """A run already made with these settings (reused, not run twice)."""
            return next(
                (r for r in out[series] if all(r.get(k) == v for k, v in want.items())), None
            )

        # parties first (the federated vs centralised floor), then batch, then rows (10^6 last)
        sp = s["parties"]
        for k in sp["k"]:
            if self.over_budget(out, f"{k} parties (all modes)"):
                self.advance(len(sp["modes"]) + 2 + _colocated(s))
                continue
            prep = prepared(sp["rows"], k)
            self.advance()
            for mode in sp["modes"]:
                r = self._point(prep, mode=mode, epochs=sp["epochs"], batch=256, tag=f"k{k}")
                if r is not None:
                    out["parties"].append(r)
                else:
                    out["not_run"].append(f"{mode} with {k} parties")
            if _colocated(s):
                r = self._point(
                    prep, mode="plain", epochs=sp["epochs"], batch=256, tag=f"k{k}", colocated=True
                )
                if r is not None:
                    out["colocated"].append(r)
            c = self._centralised(prep, epochs=sp["epochs"], batch=256, tag=f"k{k}")
            if c is not None:
                out["centralised"].append(c)
        sb = s["batch"]
        for b in sb["b"]:
            for mode in sb["modes"]:
                want = dict(
                    parties=4, aggregation=mode, batch_size=b, rows=sb["rows"], epochs=sb["epochs"]
                )
                r = same("parties", **want)
                if r is None and not self.over_budget(out, f"{mode} at batch {b}"):
                    r = self._point(
                        prepared(sb["rows"], 4),
                        mode=mode,
                        epochs=sb["epochs"],
                        batch=b,
                        tag=f"b{b}",
                    )
                else:
                    self.advance()
                if r is not None:
                    out["batch"].append(r)
        sr = s["rows"]
        for n in sr["n"]:
            skip = set(sr.get("skip", {}).get(str(n), []))
            reuse = n == sp["rows"] and 4 in sp["k"] and sr["epochs"] <= sp["epochs"]
            if not reuse and self.over_budget(out, f"{n} rows (all modes)"):
                self.advance(len(sr["modes"]) + 2)
                continue
            prep = None if reuse else prepared(n, 4)
            self.advance()
            for mode in sr["modes"]:
                if mode in skip:
                    out["rows"].append({"aggregation": mode, "rows": n, "skipped": True})
                    self.advance()
                    continue
                r = same("parties", parties=4, aggregation=mode, rows=n) if reuse else None
                if r is not None:
                    self.advance()
                elif prep is not None:
                    r = self._point(prep, mode=mode, epochs=sr["epochs"], batch=256, tag=f"n{n}")
                if r is not None:
                    out["rows"].append(r)
            if prep is not None:
                c = self._centralised(prep, epochs=sr["epochs"], batch=256, tag=f"n{n}")
                if c is not None:
                    out["centralised"].append(c)
            else:
                self.advance()
        return summarise_scaling(out)

    # --- privacy-utility, crypto (existing scripts)

    def _script(self, name: str, args: Sequence[str], json_name: str) -> dict[str, Any]:
        if self.over_budget():
            return {"not_run": "time budget spent", "command": f"bench/{name}"}
        target = self.out / json_name
        cmd = [sys.executable, str(BENCH / name), *args, "--out", str(target)]
        started = time.perf_counter()
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
        )
        result: dict[str, Any] = {
            "command": "python " + shlex.join([f"bench/{name}", *args, "--out", json_name]),
            "exit_code": done.returncode,
            "seconds": round(time.perf_counter() - started, 1),
            "stdout_tail": done.stdout[-1500:],
        }
        if target.exists():
            try:
                result["data"] = json.loads(target.read_text())
            except json.JSONDecodeError as exc:
                result["error"] = f"unreadable JSON: {exc}"
        else:
            result["error"] = f"no {json_name}; stderr tail:\n{done.stderr[-1500:]}"
        png = target.with_suffix(".png")
        if png.exists():
            result["png"] = png.name
        return result

    def suite_privacy_utility(self) -> dict[str, Any]:
        self.step("privacy-utility (label DP, in-process)")
        args = [*self.plan["privacy_utility"], "--data", str(self.data)]
        r = self._script("privacy_utility.py", args, "privacy_utility.json")
        self.advance()
        return r

    def suite_crypto(self) -> dict[str, Any]:
        c = self.plan["crypto"]
        self.step("crypto: masked sum vs AES keystream")
        masked = self._script("masked_sum_curve.py", c["masked_sum"], "masked_sum.json")
        self.advance()
        self.step("crypto: CKKS parameter sets")
        ckks = self._script("ckks_params.py", c["ckks_params"], "ckks_params.json")
        self.advance()
        return {"masked_sum": masked, "ckks_params": ckks}

    # --- GPU

    def suite_gpu(self) -> dict[str, Any]:
        self.step("gpu")
        try:
            import torch

            available = torch.cuda.is_available()
        except ImportError:
            available = False
        if not available:
            self.advance()
            return {
                "available": False,
                "note": "no GPU on this machine (torch.cuda.is_available() is False)",
            }
        result = gpu_suite(self.work, self.data)
        self.advance()
        return result


def _net(rtt: float | None) -> str:
    return "loopback" if rtt is None else f"{rtt:g}ms"


# --- GPU (runs only where torch sees a GPU)


#: The GPU suite's arms: (name, device, aggregation, model hidden sizes, batch size, overlap).
#: `overlap` sets SECUREVFL_OVERLAP_SUMS (None: the default, off).
GPU_ARMS: tuple[tuple[str, str, str, tuple[int, ...], int, str | None], ...] = (
    ("cpu-plain", "cpu", "plain", (64,), 256, None),
    ("cuda-plain", "cuda", "plain", (64,), 256, None),
    ("cpu-mask", "cpu", "mask", (64,), 256, None),
    ("cuda-mask", "cuda", "mask", (64,), 256, None),
    ("cuda-mask-overlap", "cuda", "mask", (64,), 256, "1"),
    ("cpu-wide-plain", "cpu", "plain", (1024, 1024), 1024, None),
    ("cuda-wide-plain", "cuda", "plain", (1024, 1024), 1024, None),
    ("cuda-wide-mask", "cuda", "mask", (1024, 1024), 1024, None),
    ("cuda-wide-mask-overlap", "cuda", "mask", (1024, 1024), 1024, "1"),
)


def gpu_suite(work: Path, data: Path, *, epochs: int = 3) -> dict[str, Any]:
    """Party models and head on cuda vs cpu, plain and mask, the paper-sized split-NN (hidden
    [64]) and a wide one ([1024, 1024], batch 1024), `epochs` epochs each (the first includes
    CUDA's start-up: the report uses the later ones), real processes, Credit, 4 parties.
    Per arm: epoch times, test metrics, and per role (from RUN_DIR/device/ROLE.json, written by
    the roles with SECUREVFL_GPU_PROFILE=1) kernel time, per-op spans and the allocator's peak;
    plus each process's peak GPU memory from nvidia-smi (CUDA context included), sampled every
    0.2 s. The `-overlap` arms set SECUREVFL_OVERLAP_SUMS=1 (the masks' keystreams made on a
    worker thread while the GPU computes) for the side-by-side ratio. Runs only where torch
    sees a GPU."""
    import threading

    import torch

    ds = F.credit(data, parties=4)
    prep = F.prepare(ds, work / "gpu")
    runs: dict[str, Any] = {}
    for name, device, aggregation, hidden, batch, overlap in GPU_ARMS:
        raw = F.config_raw(
            ds, aggregation=aggregation, epochs=epochs, device=device, batch_size=batch
        )
        raw["model"]["hidden"] = list(hidden)
        samples: dict[int, float] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_gpu_memory, args=(samples, stop), daemon=True)
        saved = {k: os.environ.get(k) for k in ("SECUREVFL_GPU_PROFILE", "SECUREVFL_OVERLAP_SUMS")}
        os.environ["SECUREVFL_GPU_PROFILE"] = "1"
        if overlap is not None:
            os.environ["SECUREVFL_OVERLAP_SUMS"] = overlap
        try:
            if device == "cuda":
                sampler.start()
            run = F.run_federation(prep, raw, work / "gpu" / name)
        finally:
            stop.set()
            if sampler.is_alive():
                sampler.join(timeout=10)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        run["arm"] = {
            "device": device,
            "aggregation": aggregation,
            "hidden": list(hidden),
            "batch_size": batch,
            "overlap": overlap,
        }
        run["device_time"] = {
            role: json.loads(path.read_text())
            for role in run.get("pids", {})
            for path in [work / "gpu" / name / role / "device" / f"{role}.json"]
            if path.exists()
        }
        run["nvidia_smi_peak_mib"] = {
            role: samples[pid] for role, pid in run.get("pids", {}).items() if pid in samples
        }
        runs[name] = run
    diffs = {}
    for cuda_arm in runs:  # every cuda arm against the cpu arm of the same model and sum
        cpu_arm = cuda_arm.replace("cuda-", "cpu-", 1)
        if not cuda_arm.startswith("cuda-") or cpu_arm not in runs:
            continue
        a, b = runs[cpu_arm].get("test", {}), runs[cuda_arm].get("test", {})
        diffs[f"{cuda_arm} vs {cpu_arm}"] = {
            k: abs(a[k] - b[k]) for k in a if isinstance(a[k], float) and k in b
        }
    return {
        "available": True,
        "device_name": torch.cuda.get_device_name(0),
        "epochs": epochs,
        "runs": runs,
        "metric_abs_diff": diffs,
    }


def _sample_gpu_memory(samples: dict[int, float], stop: Any) -> None:
    """Each process's peak GPU memory (MiB) as nvidia-smi reports it, every 0.2 s."""
    while not stop.is_set():
        try:
            q = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-compute-apps=pid,used_memory",
                    "--format=csv,noheader,nounits",
                ],
                capture_output=True,
                text=True,
                timeout=5,
            )
            for line in q.stdout.strip().splitlines():
                pid, mem = (x.strip() for x in line.split(","))
                samples[int(pid)] = max(samples.get(int(pid), 0.0), float(mem))
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        stop.wait(0.2)


def gpu_later_epochs(run: Mapping[str, Any]) -> float | None:
    """The median epoch time without the first epoch (CUDA's start-up), or the only one."""
    times = list(run.get("epoch_seconds") or [])
    return _median(times[1:] if len(times) > 1 else times)


# --- summaries


def _median(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else None


def _pool(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One point from its repeats: every epoch of every repeat, pooled."""
    ok = [r for r in runs if r.get("ok") and r.get("epoch_seconds")]
    if not ok:
        return {"ok": False, "error": next((r.get("error") for r in runs if r.get("error")), None)}
    epochs = [e for r in ok for e in r["epoch_seconds"]]
    first = ok[0]
    parties = [k for k in first["peak_rss_mib"] if k.startswith("p")]
    return {
        "ok": True,
        "aggregation": first["aggregation"],
        "parties": first["parties"],
        "rows": first["rows"],
        "batch_size": first["batch_size"],
        "rtt_ms": first.get("rtt_ms"),
        "n_train": first.get("n_train"),
        "repeats": len(ok),
        "epoch_seconds": epochs,
        "median_epoch_seconds": _median(epochs),
        "party_bytes_sent_per_epoch": _median(r["party_bytes_sent_per_epoch"] for r in ok),
        "total_bytes_sent_per_epoch": _median(r["total_bytes_sent"] / r["epochs"] for r in ok),
        "peak_rss_mib_party": max(max(r["peak_rss_mib"][p] for p in parties) for r in ok),
        "peak_rss_mib_active": max(r["peak_rss_mib"].get("active", 0.0) for r in ok),
        "peak_rss_mib_aggregator": max(r["peak_rss_mib"].get("aggregator", 0.0) for r in ok),
        "peak_rss_mib_all_roles": max(sum(r["peak_rss_mib"].values()) for r in ok),
        "cpu_seconds_all_roles": _median(sum(r["cpu_seconds"].values()) for r in ok),
        "test": first.get("test"),
        "load": [r["load_before"][0] for r in ok],
    }


def summarise_credit(runs: Sequence[Mapping[str, Any]], *, mbit: float) -> dict[str, Any]:
    piped = [r for r in runs if _variant(r)]
    runs = [r for r in runs if not _variant(r)]
    keys = list(dict.fromkeys((r["aggregation"], r["rtt_ms"]) for r in runs))
    points = {k: _pool([r for r in runs if (r["aggregation"], r["rtt_ms"]) == k]) for k in keys}
    table = [{"key": f"{m}@{_net(rtt)}", **points[m, rtt]} for m, rtt in keys]
    plain = points.get(("plain", None), {})
    overhead = {}
    for m in MODES:
        pt = points.get((m, None))
        if pt and pt.get("ok") and plain.get("ok"):
            overhead[m] = {
                "epoch_ratio": pt["median_epoch_seconds"] / plain["median_epoch_seconds"],
                "bytes_ratio": pt["party_bytes_sent_per_epoch"]
                / plain["party_bytes_sent_per_epoch"],
                "rss_ratio": pt["peak_rss_mib_party"] / plain["peak_rss_mib_party"],
            }
    wan = []
    for m, rtt in keys:
        base = points.get((m, None))
        pt = points[m, rtt]
        if rtt is None or not (pt.get("ok") and base and base.get("ok")):
            continue
        w = wan_analysis(base, pt, runs=[r for r in runs if r["aggregation"] == m], mbit=mbit)
        proxy0 = points.get((m, 0.0))  # the emulator with no added delay: its own cost
        if rtt and proxy0 and proxy0.get("ok"):
            w["ratio_to_proxy_0ms"] = pt["median_epoch_seconds"] / proxy0["median_epoch_seconds"]
        wan.append(w)
    return {
        "runs": list(runs) + piped,
        "points": table,
        "overhead": overhead,
        "wan": wan,
        "pipelined": summarise_pipelined(piped, points),
        "mbit": mbit,
    }


def _variant(run: Mapping[str, Any]) -> bool:
    """A run of the credit suite's variants: pipelined, or the aggregator in the active
    party's process (the overhead and WAN tables are the default protocol's)."""
    return bool(run.get("pipeline_depth") or run.get("aggregator_in_active"))


def _epoch_ratio(point: Mapping[str, Any], other: Mapping[str, Any]) -> float | None:
    if not other.get("ok"):
        return None
    return point["median_epoch_seconds"] / other["median_epoch_seconds"]


def summarise_pipelined(
    piped: Sequence[Mapping[str, Any]], unpiped: Mapping[tuple[str, Any], Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Pipelined points ([network] pipeline_depth = d, the aggregator in its own process or in
    the active party's): each against the unpipelined loopback epoch of the same mode with
    the aggregator in its own process (the issue's "its loopback time"), the same
    configuration on loopback, and the unpipelined run on the same network; the test ROC-AUC
    shows what staleness costs."""

    def key(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return (
            r["aggregation"],
            r["rtt_ms"],
            r.get("pipeline_depth") or 0,
            bool(r.get("aggregator_in_active")),
        )

    keys = list(dict.fromkeys(key(r) for r in piped))
    points = {k: _pool([r for r in piped if key(r) == k]) for k in keys}
    out = []
    for (m, rtt, d, colocated), pt in points.items():
        if not pt.get("ok"):
            continue
        base = unpiped.get((m, None), {})
        same_net = unpiped.get((m, rtt), {})
        own_loop = points.get((m, None, d, colocated), {})

        ratio = partial(_epoch_ratio, pt)

        out.append(
            {
                "aggregation": m,
                "rtt_ms": rtt,
                "depth": d,
                "aggregator_in_active": colocated,
                "median_epoch_seconds": pt["median_epoch_seconds"],
                "epochs_pooled": len(pt["epoch_seconds"]),
                "ratio_to_loopback_depth0": ratio(base),
                "ratio_to_loopback_same_depth": ratio(own_loop) if rtt is not None else None,
                "ratio_to_depth0_same_network": ratio(same_net) if rtt is not None else None,
                "roc_auc": (pt.get("test") or {}).get("roc_auc"),
                "roc_auc_depth0": (same_net.get("test") or base.get("test") or {}).get("roc_auc"),
                "load": pt.get("load"),
            }
        )
    return out


def wan_analysis(
    base: Mapping[str, Any],
    point: Mapping[str, Any],
    *,
    runs: Sequence[Mapping[str, Any]],
    mbit: float,
) -> dict[str, Any]:
    """Where the time goes behind the emulated WAN. split-NN makes two calls per batch
    (forward, backward); each exchange goes active -> aggregator -> parties -> aggregator ->
    active, four one-way trips = 2 RTT. Unfused that is 2 exchanges (4 RTT) per batch; with
    `[network] fuse_rounds` (runs recorded with "fuse_rounds": true) the backward rides with the
    next forward: 1 exchange (2 RTT). On top of that, the bytes on the critical path are
    serialised at the line rate."""
    rtt = float(point["rtt_ms"])
    n_batches = math.ceil(point["n_train"] / point["batch_size"])
    loop = base["median_epoch_seconds"]
    added = point["median_epoch_seconds"] - loop
    per_batch = added / n_batches
    # critical-path bytes per batch, from the loopback runs' counters (a party's and the active
    # party's traffic both ways; whole-run counters include set-up and test, a slight excess)
    loop_runs = [r for r in runs if r["rtt_ms"] is None and r.get("ok")]
    critical = None
    if loop_runs:
        r = loop_runs[0]
        batches_run = n_batches * r["epochs"]
        party = next(k for k in r["bytes_sent"] if k.startswith("p"))
        critical = (
            r["bytes_sent"][party]
            + r["bytes_received"][party]
            + r["bytes_sent"]["active"]
            + r["bytes_received"]["active"]
        ) / batches_run
    serial_ms = critical * 8 / (mbit * 1e6) * 1000 if critical and mbit else 0.0
    # calls per training batch (the whole run's rounds include set-up and test: a slight excess)
    rounds = [r["rounds"] / (n_batches * r["epochs"]) for r in loop_runs if r.get("rounds")]
    # the proxy's own delay: how late it forwarded a chunk, on average (a loaded machine)
    late = [
        r["proxy"]["mean_lateness_ms"]
        for r in runs
        if r.get("ok") and r["rtt_ms"] == rtt and "mean_lateness_ms" in (r.get("proxy") or {})
    ]
    fused = bool(point.get("fuse_rounds")) or any(
        r.get("fuse_rounds") for r in runs if r.get("rtt_ms") == point["rtt_ms"]
    )
    model_per_batch_ms = (2 if fused else 4) * rtt + serial_ms
    t_batch_ms = loop / n_batches * 1000
    depths = {}
    for name, k in (("unfused (4 RTT/batch)", 4), ("fused backward+next forward (2 RTT)", 2)):
        need = (k * rtt + serial_ms) / (0.5 * t_batch_ms)  # d + 1 batches in flight
        depths[name] = max(0, math.ceil(need) - 1)
    depths["fused + aggregator in the active party's process (1 RTT, mask only)"] = max(
        0, math.ceil((rtt + serial_ms / 2) / (0.5 * t_batch_ms)) - 1
    )
    return {
        "aggregation": point["aggregation"],
        "rtt_ms": rtt,
        "mbit": mbit,
        "fused": fused,
        "loopback_epoch_s": loop,
        "wan_epoch_s": point["median_epoch_seconds"],
        "ratio": point["median_epoch_seconds"] / loop,
        "batches_per_epoch": n_batches,
        "loopback_ms_per_batch": t_batch_ms,
        "added_ms_per_batch": per_batch * 1000,
        "added_rtts_per_batch": per_batch * 1000 / rtt if rtt else None,
        "calls_per_batch": _median(rounds),
        "proxy_mean_lateness_ms": _median(late),
        "critical_bytes_per_batch": critical,
        "serialisation_ms_per_batch": serial_ms,
        "model_added_ms_per_batch": model_per_batch_ms,
        "model_epoch_s": loop + n_batches * model_per_batch_ms / 1000,
        "pipeline_depth_for_1_5x": depths,
    }


def summarise_scaling(out: dict[str, Any]) -> dict[str, Any]:
    def pts(runs: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
        groups: dict[tuple, list] = {}
        for r in runs:
            if r.get("skipped"):
                groups.setdefault(("skipped", r["aggregation"], r["rows"]), []).append(r)
                continue
            groups.setdefault(tuple(r[k] for k in keys), []).append(r)
        result = []
        for key, rs in groups.items():
            if key[0] == "skipped":
                result.append({"aggregation": key[1], "rows": key[2], "skipped": True, "ok": False})
            else:
                result.append(_pool(rs))
        return result

    out["parties_points"] = pts(out["parties"], ["aggregation", "parties"])
    out["rows_points"] = pts(out["rows"], ["aggregation", "rows"])
    out["batch_points"] = pts(out["batch"], ["aggregation", "batch_size"])
    out["colocated_points"] = pts(out.get("colocated", []), ["aggregation", "parties"])
    ratios = []
    for c in out["centralised"]:
        if not c.get("ok"):
            continue
        fed = next(
            (
                p
                for p in out["parties_points"] + out["rows_points"]
                if p.get("ok")
                and p["aggregation"] == "plain"
                and p["parties"] == c["parties"]
                and p["rows"] == c["rows"]
            ),
            None,
        )
        if fed is None:
            continue
        mask = next(
            (
                p
                for p in out["parties_points"] + out["rows_points"]
                if p.get("ok")
                and p["aggregation"] == "mask"
                and p["parties"] == c["parties"]
                and p["rows"] == c["rows"]
            ),
            None,
        )
        cpu = _median(c.get("epoch_cpu_seconds") or [])
        colocated = next(
            (
                p
                for p in out.get("colocated_points", [])
                if p.get("ok") and p["parties"] == c["parties"] and p["rows"] == c["rows"]
            ),
            None,
        )
        ratios.append(
            {
                "parties": c["parties"],
                "rows": c["rows"],
                "centralised_epoch_s": c["median_epoch_seconds"],
                "federated_plain_epoch_s": fed["median_epoch_seconds"],
                "ratio": fed["median_epoch_seconds"] / c["median_epoch_seconds"],
                "mask_ratio": (
                    mask["median_epoch_seconds"] / c["median_epoch_seconds"] if mask else None
                ),
                # plain with the aggregator a thread of the active party's process
                "colocated_ratio": (
                    colocated["median_epoch_seconds"] / c["median_epoch_seconds"]
                    if colocated
                    else None
                ),
                "colocated_ratio_to_cpu": (
                    colocated["median_epoch_seconds"] / cpu if colocated and cpu else None
                ),
                "colocated_same_test_metrics": (
                    _same_metrics(c.get("test"), colocated.get("test")) if colocated else None
                ),
                "centralised_peak_rss_mib": c.get("peak_rss_mib"),
                "centralised_epoch_cpu_s": cpu,
                # the federation's wall time against the centralised run's CPU time: on a
                # loaded machine the wall/wall ratio errs low (many processes take more shares
                # than one), this one high (the federation's wall time is inflated too)
                "ratio_to_cpu": fed["median_epoch_seconds"] / cpu if cpu else None,
                "load_centralised": c.get("load_before"),
                "load_federated": _median(fed.get("load", [])),
                "federated_peak_rss_mib_all_roles": fed["peak_rss_mib_all_roles"],
                "same_test_metrics": _same_metrics(c.get("test"), fed.get("test")),
            }
        )
    out["federated_vs_centralised"] = ratios
    return out


def fed_verdict(r: Mapping[str, Any], floor: float = FLOOR_FED_CENTRAL, *, arm: str = "") -> str:
    """holds / fails / undecided for the federated-vs-centralised floor, from the two bounds;
    `arm` "colocated_" judges the federation with the aggregator in the active party."""
    if not 2 <= r["parties"] <= 8:
        return "(reported)"
    if r.get(f"{arm}ratio") is None:
        return "-"
    upper = r.get(f"{arm}ratio_to_cpu")
    if upper is not None and upper <= floor:
        return "holds"
    if r[f"{arm}ratio"] > floor:
        return "fails"
    if upper is None:  # a report from before the centralised CPU time was recorded
        return "not judged (no CPU time)"
    return "undecided under this load"


def _same_metrics(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool | None:
    if not a or not b:
        return None
    keys = [k for k in a if isinstance(a[k], float) and k in b]
    return all(abs(a[k] - b[k]) < 1e-4 for k in keys)


# --- rendering


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}".replace(",", " ")
    if isinstance(x, float):
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 10 ** (-digits)):
            return f"{x:.3g}"
        return f"{x:.{digits}f}"
    return str(x)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append(
            "| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in row) + " |"
        )
    return "\n".join(lines)


def _mib(b: float | None) -> float | None:
    return None if b is None else b / 2**20


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_credit(credit: Mapping[str, Any], out: Path) -> list[str]:
    plt = _plt()
    made = []
    pts = {(p["aggregation"], p["rtt_ms"]): p for p in credit["points"] if p.get("ok")}
    loop = [m for m in MODES if (m, None) in pts]
    if loop:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
        vals = [
            ("median epoch time (s)", lambda p: p["median_epoch_seconds"], False),
            ("MiB sent per party per epoch", lambda p: _mib(p["party_bytes_sent_per_epoch"]), True),
            ("peak RSS of a party (MiB)", lambda p: p["peak_rss_mib_party"], False),
        ]
        for ax, (label, get, log) in zip(axes, vals, strict=True):
            ys = [get(pts[m, None]) for m in loop]
            ax.bar(loop, ys, color=[COLORS[m] for m in loop])
            ax.set_ylabel(label)
            if log:
                ax.set_yscale("log")
            base = ys[0] if loop[0] == "plain" else None
            for i, y in enumerate(ys):
                if base and i:
                    ax.annotate(
                        f"{y / base:.2f}x",
                        (i, y),
                        ha="center",
                        xytext=(0, 3),
                        textcoords="offset points",
                    )
        fig.suptitle("Secure vs plain: split-NN, Credit, 4 parties, batch 256, loopback")
        fig.tight_layout()
        fig.savefig(out / "overhead.png", dpi=110)
        plt.close(fig)
        made.append("overhead.png")
    if credit.get("wan"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        for m in ("plain", "mask"):
            rows = [w for w in credit["wan"] if w["aggregation"] == m and w["rtt_ms"] > 0]
            if not rows or (m, None) not in pts:
                continue
            xs = [0.0] + [w["rtt_ms"] for w in rows]
            ys = [pts[m, None]["median_epoch_seconds"]] + [w["wan_epoch_s"] for w in rows]
            model = [ys[0]] + [w["model_epoch_s"] for w in rows]
            axes[0].plot(xs, ys, "o-", color=COLORS[m], label=f"{m} measured")
            axes[0].plot(
                xs, model, "--", color=COLORS[m], alpha=0.6, label=f"{m}: 4 RTT/batch model"
            )
            axes[1].plot(xs, [y / ys[0] for y in ys], "o-", color=COLORS[m], label=m)
        # pipelined configurations, each against itself on loopback
        piped = credit.get("pipelined") or []
        configs = dict.fromkeys((q["depth"], q["aggregator_in_active"]) for q in piped)
        for i, (d, colocated) in enumerate(configs):
            style = ("s--", "^-.")[i % 2]
            rows = [
                q
                for q in piped
                if (q["depth"], q["aggregator_in_active"]) == (d, colocated)
                and q["aggregation"] == "mask"
                and q["rtt_ms"]
                and q.get("ratio_to_loopback_same_depth")
            ]
            if rows:
                axes[1].plot(
                    [0.0] + [q["rtt_ms"] for q in rows],
                    [1.0] + [q["ratio_to_loopback_same_depth"] for q in rows],
                    style,
                    color=COLORS["mask"],
                    alpha=0.7,
                    label=f"mask, depth {d}" + (", aggregator in active" if colocated else ""),
                )
        axes[0].set_xlabel("added RTT (ms), 100 Mbit/s")
        axes[0].set_ylabel("median epoch time (s)")
        axes[0].legend(fontsize=8)
        axes[1].axhline(FLOOR_WAN_10MS, color="red", linewidth=0.8, linestyle=":")
        axes[1].annotate("floor at 10 ms: 1.5x", (10, FLOOR_WAN_10MS), fontsize=8, color="red")
        axes[1].set_xlabel("added RTT (ms)")
        axes[1].set_ylabel("epoch time / loopback")
        axes[1].legend(fontsize=8)
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.suptitle("Emulated WAN (user-space delaying proxy): Credit, 4 parties, batch 256")
        fig.tight_layout()
        fig.savefig(out / "wan.png", dpi=110)
        plt.close(fig)
        made.append("wan.png")
    return made


def plot_scaling(s: Mapping[str, Any], out: Path) -> list[str]:
    plt = _plt()
    made = []
    specs = [
        ("parties_points", "parties", "number of passive parties", "scaling_parties.png", False),
        ("rows_points", "rows", "rows in the table", "scaling_rows.png", True),
        ("batch_points", "batch_size", "batch size", "scaling_batch.png", True),
    ]
    for key, x, xlabel, name, logx in specs:
        pts = [p for p in s.get(key, []) if p.get("ok")]
        if not pts:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for m in MODES:
            mp = sorted((p for p in pts if p["aggregation"] == m), key=lambda p: p[x])
            if not mp:
                continue
            xs = [p[x] for p in mp]
            axes[0].plot(
                xs, [p["median_epoch_seconds"] for p in mp], "o-", color=COLORS[m], label=m
            )
            axes[1].plot(
                xs,
                [_mib(p["total_bytes_sent_per_epoch"]) for p in mp],
                "o-",
                color=COLORS[m],
                label=m,
            )
            axes[2].plot(xs, [p["peak_rss_mib_party"] for p in mp], "o-", color=COLORS[m], label=m)
        if key != "batch_points":
            cent = sorted(
                (
                    c
                    for c in s.get("centralised", [])
                    if c.get("ok")
                    and (c["rows"] == 10_000 if key == "parties_points" else c["parties"] == 4)
                ),
                key=lambda c: c[x],
            )
            if cent:
                axes[0].plot(
                    [c[x] for c in cent],
                    [c["median_epoch_seconds"] for c in cent],
                    "s--",
                    color=COLORS["centralised"],
                    label="centralised (1 process)",
                )
                axes[2].plot(
                    [c[x] for c in cent],
                    [c.get("peak_rss_mib") or 0 for c in cent],
                    "s--",
                    color=COLORS["centralised"],
                    label="centralised (1 process)",
                )
        axes[0].set_ylabel("median epoch time (s)")
        axes[1].set_ylabel("MiB sent per epoch, all roles")
        axes[2].set_ylabel("peak RSS of one party (MiB)")
        for ax in axes:
            ax.set_xlabel(xlabel)
            if logx:
                ax.set_xscale("log")
            if key == "parties_points":
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        if key != "batch_points":
            axes[0].set_yscale("log")
            axes[1].set_yscale("log")
        fig.suptitle(f"Scaling: split-NN on synthetic data, against the {xlabel}")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)
    return made


def suite_sections(results: Mapping[str, Any], out: Path) -> list[str]:
    """The report's sections of every suite in `results` (markdown lines), drawing the plots
    they show into `out`: report.md and the README's copy (`readme_block`) share them."""
    out.mkdir(parents=True, exist_ok=True)
    suites = results.get("suites", {})
    return [
        *_render_credit(_credit_summary(suites.get("credit")), out),
        *_render_scaling(_scaling_summary(suites.get("scaling")), out),
        *_render_privacy(suites.get("privacy_utility"), out),
        *_render_crypto(suites.get("crypto"), out),
        *_render_gpu(suites.get("gpu")),
    ]


def render(results: Mapping[str, Any], out: Path, *, sections: Sequence[str] | None = None) -> Path:
    """Write OUT/report.md (and the PNGs it shows) from the raw results (`sections`: the suites'
    sections, if already made); returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    m, v = results.get("machine", {}), results.get("versions", {})
    lines = [
        "# securevfl benchmark report",
        "",
        f"Command: `{results.get('command')}`" + (" (quick)" if results.get("quick") else ""),
        "",
        f"Started {results.get('started')}, finished {results.get('finished', '-')}, "
        f"{_fmt(results.get('wall_seconds', 0) / 60, 1)} min.",
        "",
        "## Machine and versions",
        "",
        md_table(
            ["", ""],
            [
                ["CPU", str(m.get("cpu_model", "?"))],
                ["cores", f"{m.get('cpu_count')} ({m.get('cpus_usable')} usable)"],
                ["RAM", f"{m.get('ram_gib')} GiB"],
                ["kernel", str(m.get("kernel"))],
                [
                    "load average (1/5/15 min)",
                    f"{m.get('loadavg')} at start, {m.get('loadavg_end', '-')} at end",
                ],
                ["netem", str(m.get("netem"))],
                *[[k, str(x)] for k, x in v.items()],
            ],
        ),
        "",
        "Every federated number is a real federation: one OS process per role (the commands "
        "`securevfl run` starts), ZeroMQ over TCP with CURVE, `OMP_NUM_THREADS=1` per process, "
        "all sharing the machine's cores. Ratios compare runs interleaved in this invocation; "
        "epoch times are medians over every epoch of every repeat. The load average (other "
        "jobs on the machine) is recorded before every run in report.json.",
        "",
    ]
    lines += sections if sections is not None else suite_sections(results, out)
    lines += [
        "## Raw data",
        "",
        "`report.json` holds every run (epoch times, bytes per role, peak RSS and CPU seconds "
        "per role, exit codes, the proxy's counters, the load average before and after).",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


README_MARK = "<!-- bench/report.py --readme: {where} {edge} -->"


def readme_block(
    results: Mapping[str, Any],
    out: Path,
    readme: Path,
    *,
    sections: Sequence[str] | None = None,
) -> str:
    """The README's copy of a report: its source (command, machine, date) and its suites'
    sections (`sections`, if already made), headings two levels down and plots linked from the
    README's folder."""
    m = results.get("machine", {})
    where = os.path.relpath(out, readme.resolve().parent)
    body = sections if sections is not None else suite_sections(results, out)
    lines = [
        f"_Generated from `{where}/report.json` by `python bench/report.py --render --out "
        f"{where} --readme {os.path.relpath(readme.resolve(), REPO)}`; do not edit by hand._ "
        f"Command: `{results.get('command')}`"
        + (" (quick)" if results.get("quick") else "")
        + f"; started {results.get('started')}; machine: {m.get('cpu_model', '?')}, "
        f"{m.get('cpu_count')} cores, load {m.get('loadavg')} at start, "
        f"{m.get('loadavg_end', '-')} at end. "
        f"Full report: [`{where}/report.md`]({where}/report.md).",
        "",
    ]
    for line in body:
        if line.startswith("#"):
            line = "##" + line
        for png in re.findall(r"\]\(([^)/]+\.png)\)", line):
            line = line.replace(f"]({png})", f"]({where}/{png})")
        lines.append(line)
    return "\n".join(lines).rstrip() + "\n"


def update_readme(readme: Path, out: Path, block: str) -> None:
    """Replace the README's generated block for report `out` (between its two markers)."""
    where = os.path.relpath(out, readme.resolve().parent)
    begin = README_MARK.format(where=where, edge="begin")
    end = README_MARK.format(where=where, edge="end")
    text = readme.read_text()
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise SystemExit(
            f"{readme} has no block for {where}: put the two lines\n{begin}\n{end}\nwhere "
            "the report belongs, then run again"
        )
    readme.write_text(text[: i + len(begin)] + "\n" + block + text[j:])


def _credit_summary(c: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The credit suite's summary, always recomputed from its raw runs (a report cut short
    has only those; a re-render picks up a newer summary)."""
    if not c or c.get("error") or "runs" not in c:
        return c
    return {**c, **summarise_credit(c["runs"], mbit=c.get("mbit", 100.0))}


def _scaling_summary(s: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if not s or s.get("error") or "parties" not in s:
        return s
    return summarise_scaling({k: list(v) if isinstance(v, list) else v for k, v in s.items()})


def _not_run(r: Mapping[str, Any]) -> list[str]:
    """The points a report did not reach (its time budget), said in the report."""
    items = r.get("not_run")
    if not items:
        return []
    if isinstance(items, str):
        items = [items]
    return [
        "Not run, the time budget (`--budget-minutes`) was spent: " + "; ".join(items) + ".",
        "",
    ]


def _render_pipelined(piped: Sequence[Mapping[str, Any]]) -> list[str]:
    """The pipelined points: epoch against the unpipelined loopback epoch (the floor's
    reference), against the same depth on loopback and against depth 0 on the same network,
    and the test ROC-AUC (what the staleness costs)."""
    if not piped:
        return []
    lines = [
        "#### Pipelined batches (`[network] pipeline_depth`)",
        "",
        md_table(
            [
                "aggregation @ network",
                "depth",
                "aggregator",
                "median epoch (s)",
                "epochs pooled",
                "× depth 0 on loopback",
                "× same depth on loopback",
                "× depth 0 on this network",
                "test ROC-AUC (depth 0)",
                "load (1 min) before",
            ],
            [
                [
                    f"{p['aggregation']}@{_net(p['rtt_ms'])}",
                    p["depth"],
                    _where_aggregator(p),
                    p["median_epoch_seconds"],
                    p["epochs_pooled"],
                    p["ratio_to_loopback_depth0"],
                    p["ratio_to_loopback_same_depth"],
                    p["ratio_to_depth0_same_network"],
                    f"{_fmt(p['roc_auc'], 3)} ({_fmt(p['roc_auc_depth0'], 3)})",
                    ", ".join(f"{x:.1f}" for x in p.get("load") or []),
                ]
                for p in piped
            ],
        ),
        "",
    ]
    for p in piped:
        if p["aggregation"] == "mask" and p["rtt_ms"] == 10 and p["ratio_to_loopback_depth0"]:
            worst = max(
                r for r in (p["ratio_to_loopback_depth0"], p["ratio_to_loopback_same_depth"]) if r
            )
            held = worst <= FLOOR_WAN_10MS
            same = (
                f"{_fmt(p['ratio_to_loopback_same_depth'], 2)}× the same configuration on loopback"
                if p["ratio_to_loopback_same_depth"]
                else "the same configuration not run on loopback"
            )
            lines += [
                f"**Floor: mask epoch at 10 ms RTT ≤ {FLOOR_WAN_10MS}× loopback, pipelined at "
                f"depth {p['depth']}, aggregator {_where_aggregator(p)}: "
                f"{'holds' if held else 'does not hold'}** "
                f"({_fmt(p['ratio_to_loopback_depth0'], 2)}× the unpipelined loopback epoch, "
                f"{same}). The "
                f"price is staleness: test ROC-AUC {_fmt(p['roc_auc'], 3)} against "
                f"{_fmt(p['roc_auc_depth0'], 3)} unpipelined after the same epochs.",
                "",
            ]
    return lines


def _where_aggregator(point: Mapping[str, Any]) -> str:
    return (
        "in the active party's process"
        if point.get("aggregator_in_active")
        else "in its own process"
    )


def _render_credit(c: Mapping[str, Any] | None, out: Path) -> list[str]:
    if not c:
        return []
    lines = ["## Secure vs plain, and latency (Credit, 4 parties, batch 256)", ""]
    if c.get("error"):
        return lines + [f"Not run: {c['error']}", ""]
    made = plot_credit(c, out)
    lines += [
        md_table(
            [
                "aggregation @ network",
                "median epoch (s)",
                "epochs pooled",
                "MiB sent / party / epoch",
                "peak RSS party (MiB)",
                "peak RSS all roles (MiB)",
                "test ROC-AUC",
                "load (1 min) before",
            ],
            [
                [
                    p["key"],
                    p.get("median_epoch_seconds"),
                    len(p.get("epoch_seconds", [])),
                    _mib(p.get("party_bytes_sent_per_epoch")),
                    p.get("peak_rss_mib_party"),
                    p.get("peak_rss_mib_all_roles"),
                    (p.get("test") or {}).get("roc_auc"),
                    ", ".join(f"{x:.1f}" for x in p.get("load", [])),
                ]
                for p in c["points"]
            ],
        ),
        "",
    ]
    ov = c.get("overhead", {})
    if ov:
        rows = []
        for mode, r in ov.items():
            floor = {
                "mask": f"epoch <= {FLOOR_MASK}x",
                "ckks": f"epoch <= {FLOOR_CKKS}x, bytes <= {FLOOR_CKKS_BYTES:g}x",
            }.get(mode, "-")
            held = {
                "mask": r["epoch_ratio"] <= FLOOR_MASK,
                "ckks": r["epoch_ratio"] <= FLOOR_CKKS and r["bytes_ratio"] <= FLOOR_CKKS_BYTES,
            }.get(mode)
            rows.append([mode, r["epoch_ratio"], r["bytes_ratio"], r["rss_ratio"], floor, held])
        lines += [
            "Overhead against plain (loopback):",
            "",
            md_table(
                [
                    "aggregation",
                    "epoch × plain",
                    "bytes × plain",
                    "party RSS × plain",
                    "floor",
                    "holds",
                ],
                rows,
            ),
            "",
        ]
    if "overhead.png" in made:
        lines += ["![overhead](overhead.png)", ""]
    wan = c.get("wan", [])
    if wan:
        lines += [
            f"### Emulated WAN ({c.get('mbit'):g} Mbit/s per direction and connection)",
            "",
            "This kernel has no netem, so `bench/wanproxy.py` (a user-space TCP proxy) sits "
            "between every role and the aggregator: the aggregator binds its real port, the "
            "roles connect to the proxy, which releases each chunk at its arrival + RTT/2 "
            "after serialising it at the line rate (FIFO, per direction and connection). CURVE "
            "passes through unchanged (the proxy forwards bytes).",
            "",
            md_table(
                [
                    "aggregation",
                    "RTT (ms)",
                    "epoch (s)",
                    "× loopback",
                    "× proxy at 0 ms",
                    "added ms / batch",
                    "= RTTs / batch",
                    "calls / batch",
                    "model: RTTs + serialisation (ms)",
                    "proxy's own delay × 8 hops (ms)",
                    "floor (mask, 10 ms)",
                ],
                [
                    [
                        w["aggregation"],
                        w["rtt_ms"],
                        w["wan_epoch_s"],
                        w["ratio"],
                        w.get("ratio_to_proxy_0ms"),
                        w["added_ms_per_batch"],
                        w["added_rtts_per_batch"],
                        w.get("calls_per_batch"),
                        w["model_added_ms_per_batch"],
                        (
                            None
                            if w.get("proxy_mean_lateness_ms") is None
                            else 8 * w["proxy_mean_lateness_ms"]
                        ),
                        (
                            ("holds" if w["ratio"] <= FLOOR_WAN_10MS else "fails")
                            if w["aggregation"] == "mask" and w["rtt_ms"] == 10
                            else "-"
                        ),
                    ]
                    for w in wan
                ],
            ),
            "",
        ]
        w10 = next((w for w in wan if w["aggregation"] == "mask" and w["rtt_ms"] == 10), None)
        if w10:
            held = w10["ratio"] <= FLOOR_WAN_10MS
            lines += [
                f"**Floor: mask epoch at 10 ms RTT ≤ {FLOOR_WAN_10MS}× loopback: "
                f"{'holds' if held else 'does not hold'}** ({w10['ratio']:.2f}×"
                + (
                    f"; {w10['ratio_to_proxy_0ms']:.2f}× the same proxy with no added delay"
                    if w10.get("ratio_to_proxy_0ms")
                    else ""
                )
                + ").",
                "",
                "Where the time goes: split-NN makes two calls per batch (forward, then "
                "backward), and every exchange goes active → aggregator → parties → aggregator "
                "→ active, four one-way trips, i.e. 2 RTT; "
                + (
                    "with `[network] fuse_rounds` (on in these runs) the backward of batch t "
                    "rides in the envelope of batch t+1's forward, so each batch waits 2 RTT"
                    if w10.get("fused")
                    else "unfused, each batch waits 4 RTT"
                )
                + ", plus "
                f"the critical path's bytes at the line rate "
                f"({_fmt(_kib(w10['critical_bytes_per_batch']), 1)} KiB per batch, "
                f"{w10['serialisation_ms_per_batch']:.1f} ms at {c.get('mbit'):g} Mbit/s). "
                f"A loopback batch takes {w10['loopback_ms_per_batch']:.1f} ms, so "
                f"{w10['batches_per_epoch']} batches per epoch × "
                f"{w10['model_added_ms_per_batch']:.0f} ms is the modelled cost; the measured "
                f"added time is {w10['added_ms_per_batch']:.0f} ms per batch "
                f"({_fmt(w10['added_rtts_per_batch'], 1)} RTT). The rest is the emulator "
                "and the machine: the proxy (a Python thread of the benchmark process, "
                "sharing the cores) forwarded each chunk on average "
                f"{_fmt(w10.get('proxy_mean_lateness_ms'), 1)} ms after its due time, and "
                "every exchange crosses it 4 times. (`calls / batch` counts rounds: a fused "
                "envelope carries two.)",
                "",
                "To stay within 1.5× the exposed latency per batch must fall below half a "
                "loopback batch. With d batches in flight (`[network] pipeline_depth`: the "
                "next batches' forwards while the previous backward is on the wire, a party's "
                "representation up to d updates stale; identical to the unpipelined run at "
                "d = 0) the exposed latency is about L/(d + 1), which needs:",
                "",
                md_table(
                    ["protocol", "pipeline depth d needed at 10 ms"],
                    [[k, d] for k, d in w10["pipeline_depth_for_1_5x"].items()],
                ),
                "",
                "Message batching per round (`[network] fuse_rounds`, on by default: the "
                "backward of batch t and the forward of batch t+1 in one envelope; a party "
                "applies batch t's gradient before it computes batch t+1's forward, so nothing "
                "is stale and results are bit-identical) halves the round trips of split-NN. "
                "Running the aggregator inside the active party's process (`[network] "
                "aggregator_in_active = true`, plain and mask: an aggregator thread with its own "
                "hub, the active party on an in-process socket) removes the hop between the "
                "active party and the aggregator: two of the four network crossings on a "
                "round's critical path. The table above runs the aggregator as its own process; "
                "the pipelined runs below name where it ran.",
                "",
            ]
        lines += _render_pipelined(c.get("pipelined") or [])
        if "wan.png" in made:
            lines += ["![wan](wan.png)", ""]
    return lines + _not_run(c)


def _kib(b: float | None) -> float | None:
    return None if b is None else b / 1024


def _render_scaling(s: Mapping[str, Any] | None, out: Path) -> list[str]:
    if not s:
        return []
    lines = [
        "## Scaling (synthetic tables, 5 columns per party, split-NN, hidden 64, width 16)",
        "",
    ]
    if s.get("error"):
        return lines + [f"Not run: {s['error']}", ""]
    made = plot_scaling(s, out)

    def table(key: str, x: str, xname: str) -> list[str]:
        pts = s.get(key, [])
        if not pts:
            return []
        rows = []
        for p in sorted(pts, key=lambda p: (p.get(x, 0), MODES.index(p["aggregation"]))):
            if p.get("skipped"):
                rows.append([p.get(x), p["aggregation"], "skipped", "-", "-", "-", "-"])
                continue
            if not p.get("ok"):
                rows.append([p.get(x), p.get("aggregation", "?"), "failed", "-", "-", "-", "-"])
                continue
            rows.append(
                [
                    p[x],
                    p["aggregation"],
                    p["median_epoch_seconds"],
                    p["n_train"] / p["median_epoch_seconds"] if p.get("n_train") else None,
                    _mib(p["total_bytes_sent_per_epoch"]),
                    p["peak_rss_mib_party"],
                    p["peak_rss_mib_all_roles"],
                ]
            )
        return [
            md_table(
                [
                    xname,
                    "aggregation",
                    "median epoch (s)",
                    "train rows / s",
                    "MiB sent / epoch (all roles)",
                    "peak RSS party (MiB)",
                    "peak RSS all roles (MiB)",
                ],
                rows,
            ),
            "",
        ]

    lines += ["### Parties (10^4 rows, batch 256)", ""] + table(
        "parties_points", "parties", "parties"
    )
    if "scaling_parties.png" in made:
        lines += ["![parties](scaling_parties.png)", ""]
    lines += ["### Rows (4 parties, batch 256)", ""] + table("rows_points", "rows", "rows")
    if "scaling_rows.png" in made:
        lines += ["![rows](scaling_rows.png)", ""]
    lines += ["### Batch size (4 parties, 10^4 rows)", ""] + table(
        "batch_points", "batch_size", "batch"
    )
    if "scaling_batch.png" in made:
        lines += ["![batch](scaling_batch.png)", ""]
    fc = s.get("federated_vs_centralised", [])
    if fc:
        lines += [
            "### Federated plain vs centralised",
            "",
            "The centralised reference trains the same model (one encoder per column block, "
            "their sum, the same head, Adam, the same rows, batches and seeds) in one process "
            "with one thread, reading the same split files; its test metrics match the "
            "federated run's (column `same model`). On a machine loaded by other jobs the "
            "federation's processes each get a share of the cores and the one centralised "
            "process only one share, so the wall-clock ratio then flatters the federation: "
            "read it with the load columns (1-minute load average before each run, against "
            "the cores in the machine table). The federation's wall time over the centralised "
            "run's CPU time errs the other way (the federation's wall time is inflated by the "
            "load too), so the floor is judged on both: it holds when even the high estimate "
            "is within it, fails when even the low one is not, and is undecided between. "
            "Both sides time the same thing: the training batches of an epoch (the federation's "
            "epoch clock stops before its per-epoch checkpoint round and restarts after it; "
            "the test evaluation runs after training on both sides, untimed). Column `plain, "
            "aggregator in active`: the same plain federation with `[network] "
            "aggregator_in_active = true` (the aggregator a thread of the active party's "
            "process: one process and one network hop per round fewer).",
            "",
            md_table(
                [
                    "parties",
                    "rows",
                    "centralised epoch (s)",
                    "federated plain epoch (s)",
                    "plain × centralised",
                    "mask × centralised",
                    "plain, aggregator in active × centralised",
                    "plain wall ÷ centralised CPU",
                    f"floor ≤ {FLOOR_FED_CENTRAL:g}× (2..8 parties)",
                    "floor, aggregator in active",
                    "same model",
                    "RSS centralised / federated (MiB)",
                    "centralised CPU s / epoch",
                    "load centralised / federated",
                ],
                [
                    [
                        r["parties"],
                        r["rows"],
                        r["centralised_epoch_s"],
                        r["federated_plain_epoch_s"],
                        r["ratio"],
                        r["mask_ratio"],
                        r.get("colocated_ratio"),
                        r.get("ratio_to_cpu"),
                        fed_verdict(r),
                        fed_verdict(r, arm="colocated_"),
                        r["same_test_metrics"]
                        if r.get("colocated_same_test_metrics") in (None, r["same_test_metrics"])
                        else f"{r['same_test_metrics']} / colocated "
                        f"{r['colocated_same_test_metrics']}",
                        f"{_fmt(r['centralised_peak_rss_mib'], 0)} / "
                        f"{_fmt(r['federated_peak_rss_mib_all_roles'], 0)}",
                        r.get("centralised_epoch_cpu_s"),
                        f"{_fmt((r.get('load_centralised') or [None])[0], 1)} / "
                        f"{_fmt(r.get('load_federated'), 1)}",
                    ]
                    for r in fc
                ],
            ),
            "",
        ]
    if s.get("skipped"):
        lines += ["Not measured: " + "; ".join(s["skipped"]) + ".", ""]
    return lines + _not_run(s)


def _copy_png(r: Mapping[str, Any], out: Path) -> str | None:
    name = r.get("png")
    return name if name and (out / name).exists() else None


def _render_privacy(r: Mapping[str, Any] | None, out: Path) -> list[str]:
    if not r:
        return []
    lines = ["## Privacy–utility (label DP, Credit, in-process)", "", f"`{r.get('command')}`", ""]
    if r.get("not_run"):
        return lines + _not_run(r)
    data = r.get("data")
    if not data:
        return lines + [f"Failed: {r.get('error')}", ""]
    rows = []
    for s in data.get("summary", []):
        eps = "∞ (no DP)" if s["eps_target"] is None else f"{s['eps_target']:g}"
        rows.append(
            [eps, s["runs"], s["f1"], s["roc_auc"], s["attack_norm_auc"], s["attack_direction_auc"]]
        )
    setup = data.get("setup", {})
    lines += [
        f"{setup.get('epochs')} epochs, seeds {setup.get('seeds')}, batch "
        f"{setup.get('batch_size')}, clip {setup.get('label_dp_clip')}.",
        "",
        md_table(
            [
                "label-DP ε",
                "runs",
                "test F1",
                "test ROC-AUC",
                "norm attack AUC",
                "direction attack AUC",
            ],
            rows,
        ),
        "",
    ]
    png = _copy_png(r, out)
    if png:
        lines += [f"![privacy-utility]({png})", ""]
    return lines


def _render_crypto(c: Mapping[str, Any] | None, out: Path) -> list[str]:
    if not c:
        return []
    lines = ["## Secure-sum primitives", ""]
    if c.get("error"):
        return lines + [f"Not run: {c['error']}", ""]
    ms = c.get("masked_sum", {})
    lines += [f"Masked sum vs the raw AES-CTR keystream: `{ms.get('command')}`", ""]
    if ms.get("exit_code"):
        lines += [
            f"The script exited with status {ms['exit_code']}: its own floor "
            f"({_fmt((ms.get('data') or {}).get('meta', {}).get('floor_mb_per_s'), 0)} MB/s "
            "masked at n = 10^6) was not met in this run (see `stdout_tail` in report.json).",
            "",
        ]
    lines += _not_run(ms)
    data = ms.get("data")
    if data:
        try:
            rows = []
            for row in data["keystream_limit"]:
                variants = [
                    k
                    for k in ("raw_buffer", "fused", "prepared")
                    if isinstance(row.get(k), dict) and "mb_per_s" in row[k]
                ]
                for var in variants:
                    rows.append(
                        [
                            row["parties"],
                            var,
                            row[var]["mb_per_s"],
                            row[var].get("ratio_to_raw_buffer"),
                            row[var].get("ratio_to_raw_buffer_cpu"),
                        ]
                    )
            lines += [
                md_table(
                    [
                        "parties K",
                        "variant",
                        "MB/s (wall)",
                        "× raw keystream (wall)",
                        "× raw keystream (CPU)",
                    ],
                    rows,
                ),
                "",
            ]
            meta = data.get("meta", {})
            if "target_ratio" in meta:
                lines += [
                    f"Target ≥ {meta['target_ratio']} of the raw keystream (K = 4, 10^6 values): "
                    f"fused {_fmt(meta.get('target_met_fused_1_thread'))} (wall), "
                    f"{_fmt(meta.get('target_met_fused_1_thread_cpu'))} (CPU time); prepared "
                    f"{_fmt(meta.get('target_met_prepared'))}.",
                    "",
                ]
        except (KeyError, TypeError):
            lines += ["(see masked_sum.json)", ""]
    elif not ms.get("not_run"):
        lines += [f"Failed: {ms.get('error')}", ""]
    png = _copy_png(ms, out)
    if png:
        lines += [f"![masked sum]({png})", ""]
    ck = c.get("ckks_params", {})
    lines += [f"CKKS parameter sets: `{ck.get('command')}`", ""]
    lines += _not_run(ck)
    data = ck.get("data")
    if data:
        try:
            rows = [
                [
                    s["label"],
                    s["poly_modulus_degree"],
                    str(s["coeff_mod_bit_sizes"]),
                    s["security_bits"],
                    s["precision_bits"],
                    s["measured_bytes_per_value"],
                    s["values_per_s_cpu"].get("encrypt"),
                    s["values_per_s_cpu"].get("encrypt_prepared"),
                    s["values_per_s_cpu"].get("decrypt_release"),
                ]
                for s in data["sets"]
            ]
            lines += [
                md_table(
                    [
                        "set",
                        "N",
                        "moduli (bits)",
                        "security (bits)",
                        "released precision (bits)",
                        "bytes / value",
                        "encrypt values/s (CPU)",
                        "prepared encrypt values/s",
                        "decrypt+release values/s",
                    ],
                    rows,
                ),
                "",
            ]
        except (KeyError, TypeError, AttributeError):
            lines += ["(see ckks_params.json)", ""]
    elif not ck.get("not_run"):
        lines += [f"Failed: {ck.get('error')}", ""]
    return lines


def _render_gpu(g: Mapping[str, Any] | None) -> list[str]:
    if not g:
        return []
    lines = ["## GPU", ""]
    if not g.get("available"):
        return lines + [
            f"{g.get('note', 'no GPU on this machine')}: no GPU numbers in this report.",
            "",
        ]
    runs = g.get("runs", {})
    rows = []
    for name, run in runs.items():
        arm = run.get("arm", {})
        dt_ = run.get("device_time", {})
        kernel = sum(d.get("kernel_ms", 0.0) for d in dt_.values()) if dt_ else None
        rows.append(
            [
                name,
                "x".join(str(h) for h in arm.get("hidden", [])),
                arm.get("batch_size"),
                gpu_later_epochs(run),
                (run.get("test") or {}).get("roc_auc"),
                kernel / max(run.get("epochs") or 1, 1) if kernel is not None else None,
                max((d.get("peak_allocated_mib", 0.0) for d in dt_.values()), default=None),
                max(run.get("nvidia_smi_peak_mib", {}).values(), default=None),
            ]
        )
    lines += [
        f"Device: {g.get('device_name')}. Party models and head on cuda vs cpu, Credit, 4 "
        f"parties, real processes, {g.get('epochs')} epochs per arm; epoch = median of the "
        "epochs after the first (CUDA's start-up). GPU kernel time is the sum over the roles of "
        "their kernels' device time (PyTorch profiler), per epoch; peak allocated is the largest "
        "role's allocator peak; nvidia-smi includes each process's CUDA context.",
        "",
        md_table(
            [
                "arm",
                "hidden",
                "batch",
                "epoch (s)",
                "test ROC-AUC",
                "GPU kernel ms / epoch (all roles)",
                "peak allocated MiB (max role)",
                "nvidia-smi MiB (max role)",
            ],
            rows,
        ),
        "",
    ]
    for pair, diffs in (g.get("metric_abs_diff") or {}).items():
        lines.append(
            f"- Largest test-metric difference {pair}: "
            f"{max(diffs.values(), default=float('nan')):.2e}"
        )
    per_role = []
    for name in ("cuda-plain", "cuda-mask", "cuda-wide-mask"):
        dt_ = runs.get(name, {}).get("device_time", {})
        for role, d in dt_.items():
            per_role.append(
                [
                    name,
                    role,
                    d.get("kernel_ms"),
                    d.get("kernels"),
                    ", ".join(f"{op} {ms:.0f}" for op, ms in d.get("span_ms_by_op", {}).items()),
                    d.get("peak_allocated_mib"),
                    runs[name].get("nvidia_smi_peak_mib", {}).get(role),
                ]
            )
    if per_role:
        lines += [
            "",
            "Per role (whole run): GPU kernel ms, kernels launched, spans per op (ms from a "
            "passive party's first launch to its last kernel of each call, summed), allocator "
            "peak and nvidia-smi peak (MiB):",
            "",
            md_table(
                ["arm", "role", "kernel ms", "kernels", "spans (ms)", "allocated", "nvidia-smi"],
                per_role,
            ),
        ]
    ratio = []
    for with_, without in ((n, n.removesuffix("-overlap")) for n in runs if n.endswith("-overlap")):
        a, b = runs.get(with_), runs.get(without)
        if a and b and gpu_later_epochs(a) and gpu_later_epochs(b):
            ratio.append(
                f"- {with_} ÷ {without} (keystreams overlapping the GPU's work vs after it): "
                f"{gpu_later_epochs(a) / gpu_later_epochs(b):.2f}×"
                + (
                    f"; mask ÷ plain on cuda: {gpu_later_epochs(b) / gpu_later_epochs(plain):.2f}×"
                    if (plain := runs.get(without.replace("mask", "plain")))
                    and gpu_later_epochs(plain)
                    else ""
                )
            )
    return lines + [""] + ratio + [""]


# --- entry point


def write_reports(results: Mapping[str, Any], out: Path, *, readme: Path | None) -> Path:
    """OUT/report.md and, with `readme`, the README's block for OUT, from one rendering of the
    suites' sections; returns report.md's path."""
    sections = suite_sections(results, out)
    path = render(results, out, sections=sections)
    if readme is not None:
        update_readme(readme, out, readme_block(results, out, readme, sections=sections))
        print(f"wrote the report into {readme}")
    return path


def main(argv: Sequence[str] | None = None, *, prog: str = "python bench/report.py") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke-sized: fewer points, one repeat")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "report")
    ap.add_argument("--data", type=Path, default=F.CREDIT, help="credit_default.csv")
    ap.add_argument("--only", help=f"comma-separated suites of {','.join(SUITES)}")
    ap.add_argument("--work", type=Path, help="keep the run directories here (default: temp)")
    ap.add_argument(
        "--budget-minutes",
        type=float,
        help="start no new run after this many minutes (what is left is named in the report)",
    )
    ap.add_argument(
        "--render", action="store_true", help="only re-render OUT/report.md from OUT/report.json"
    )
    ap.add_argument(
        "--readme",
        type=Path,
        help="also write the report into this README, between its markers for OUT",
    )
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if args.render:
        results = json.loads((out / "report.json").read_text())
        print(f"wrote {write_reports(results, out, readme=args.readme)}")
        return 0
    suites = [s.strip() for s in (args.only or ",".join(SUITES)).split(",") if s.strip()]
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}")
    command = " ".join(
        [prog, *(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))]
    )
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with tempfile.TemporaryDirectory(prefix="securevfl-bench-") as tmp:
        work = (args.work or Path(tmp)).resolve()
        with Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        ) as progress:
            bench = Bench(
                out=out,
                work=work,
                quick=args.quick,
                data=args.data.resolve(),
                suites=suites,
                command=command,
                progress=progress,
                budget_minutes=args.budget_minutes,
            )
            results = bench.run()
    path = write_reports(results, out, readme=args.readme)
    print(f"wrote {path}, {out / 'report.json'} and the PNGs next to them")
    failed = [s for s, r in results["suites"].items() if isinstance(r, dict) and r.get("error")]
    if failed:
        print(f"suites that failed: {', '.join(failed)} (see report.md)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
