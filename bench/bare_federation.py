"""The same split-NN federation with nothing of securevfl's runtime: the cost floor of the layout.

Issue 17 asks for a federated plain epoch within 3x of the centralised epoch of the same model.
This bench measures what the process layout alone costs, so that the remainder can be blamed on
the framework: the roles `securevfl run` starts (an aggregator, the active party, one process
per party, one thread each), over real TCP on loopback with CURVE, the same rows, batches,
seeds, models and Adam as `fedbench.centralised`, the same fused round per batch as securevfl
(the active party's call carries the batch's ids and the previous batch's gradient; a party
applies the gradient, then computes the next forward; the aggregator relays the call and sums
the forwards) — and nothing else: no envelope, validation, authentication, policy, ledger,
heartbeats or checkpoints. Each role reports its CPU microseconds per batch after the first
epoch (its process's `time.process_time` at each training call, every thread of it included:
`steady_cpu_us`).

    python bench/bare_federation.py [--rows 10000] [--parties 2,4] [--epochs 10] [--repeats 3]
        [--data credit_default.csv] [--aggregations plain,mask] [--securevfl] [--out FILE.json]

`--securevfl` also runs securevfl's federation (`fedbench.run_federation`) in every repeat;
`--aggregations plain,mask` adds the masked sum (arms `bare-mask`, `securevfl-mask`: the bare
one masks as `PairMasks` says, the aggregator adds in Z_2^64, the active party decodes). The
centralised reference (`fedbench.run_centralised`) always runs. Arms are interleaved per
repeat. Not a product path: a yardstick for `bench/fed_central.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import fedbench as F  # noqa: E402

AGGREGATOR = "aggregator"
ACTIVE = "active"


# --- the roles (each in its own process)


def _socket(role: str, spec: dict[str, Any]) -> Any:
    """The role's socket (a client's once every role has said hello); a receive that waits past
    `spec["timeout_s"]` raises, so a role whose peers died or whose harness was killed ends."""
    import zmq

    ctx = zmq.Context()
    ctx.setsockopt(zmq.RCVTIMEO, int(1000 * spec["timeout_s"]))
    if role == AGGREGATOR:
        sock = ctx.socket(zmq.ROUTER)
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = spec["server"]
        sock.bind(spec["endpoint"])
        return sock
    sock = ctx.socket(zmq.DEALER)
    sock.routing_id = role.encode()
    sock.curve_serverkey = spec["server"][0]
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(spec["endpoint"])
    sock.send(b"hello")
    if sock.recv() != b"go":  # every role has connected: nothing sent from now on is dropped
        raise RuntimeError(f"{role}: the aggregator did not start the run")
    return sock


FRACTION = 2.0**20  # the bare masked sum's fixed-point scale


class PairMasks:
    """A party's pairwise masks as the masked sum makes them, nothing around it: per call and
    other party, an AES-CTR keystream of one 64-bit word per value (key per pair, the call's
    number as the nonce), added if this party's name sorts first, else subtracted, onto the
    fixed-point encoding (20 fractional bits) of the values. Bench keys: derived from the names
    (the cost of a keystream does not depend on where its key came from)."""

    def __init__(self, me: str, parties: list[str]) -> None:
        import hashlib

        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._ctr = lambda key, nonce: Cipher(algorithms.AES(key), modes.CTR(nonce)).encryptor()
        self.pairs = [
            (hashlib.sha256("|".join(sorted((me, p))).encode()).digest(), me < p)
            for p in parties
            if p != me
        ]

    def mask(self, values: np.ndarray, round_no: int) -> np.ndarray:
        out = np.rint(values.astype(np.float64) * FRACTION).astype(np.int64).view(np.uint64)
        zeros = bytes(8 * out.size)
        nonce = round_no.to_bytes(16, "big")
        for key, add in self.pairs:
            stream = self._ctr(key, nonce).update(zeros)
            words = np.frombuffer(stream, dtype=np.uint64).reshape(out.shape)
            (np.add if add else np.subtract)(out, words, out=out)
        return out


def _received_sum(frame: bytes, spec: dict[str, Any]) -> np.ndarray:
    """The sum as the active party reads it: float32, decoded from the ring when masked."""
    if spec["aggregation"] != "mask":
        return np.frombuffer(frame, dtype=np.float32)
    return (np.frombuffer(frame, dtype=np.int64) / FRACTION).astype(np.float32)


def _close(sock: Any) -> None:
    """Send what is queued (the stop), then close: `os._exit` would drop it."""
    sock.close(linger=5000)
    sock.context.term()


def _aggregator(spec: dict[str, Any]) -> dict[str, Any]:
    sock = _socket(AGGREGATOR, spec)
    parties = [p.encode() for p in spec["parties"]]
    waiting = {*parties, ACTIVE.encode()}
    while waiting:
        waiting.discard(sock.recv_multipart()[0])
    for role in [*parties, ACTIVE.encode()]:
        sock.send_multipart([role, b"go"])
    dtype = np.uint64 if spec["aggregation"] == "mask" else np.float32
    marks = []  # CPU seconds at each training call
    while True:
        frames = sock.recv_multipart(copy=False)
        kind = frames[1].bytes
        if kind == b"train":
            marks.append(time.process_time())
        for p in parties:  # the call, relayed as it came
            sock.send_multipart([p, *frames[1:]], copy=False)
        if kind == b"stop":
            _close(sock)
            return {"cpu_marks": marks}
        if kind == b"setup":
            continue
        got: dict[bytes, np.ndarray] = {}
        while len(got) < len(parties):
            sender, out = sock.recv_multipart()
            got[sender] = np.frombuffer(out, dtype=dtype)
        total = got[parties[0]].copy()
        for p in parties[1:]:  # in party order, as the centralised sum
            total += got[p]
        sock.send_multipart([ACTIVE.encode(), total])


def _party(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from securevfl.config import load_config
    from securevfl.data.table import load_party_table
    from securevfl.methods.blocks.nets import Standardizer, make_optimizer

    torch.set_num_threads(1)
    cfg = load_config(spec["config"])
    table = load_party_table(Path(spec["files"][name]), cfg, name)
    encoder = F.encoder_of(cfg, table, name)
    opt = make_optimizer(encoder.parameters(), cfg)
    masks = PairMasks(name, spec["parties"]) if spec["aggregation"] == "mask" else None
    sock = _socket(name, spec)  # after everything that loads: the active party's clock runs
    scaler = None
    pending = None
    marks = []  # CPU seconds at each training call
    round_no = 0
    while True:
        frames = sock.recv_multipart()
        kind = frames[0]
        if kind == b"stop":
            _close(sock)
            return {"cpu_marks": marks}
        ids = np.frombuffer(frames[1], dtype=np.int64)
        if kind == b"setup":
            scaler = Standardizer().fit(table.rows(ids))
            continue
        if kind == b"train":
            marks.append(time.process_time())
        if frames[2] and pending is not None:  # the previous batch's gradient first
            grad = torch.from_numpy(
                np.frombuffer(frames[2], dtype=np.float32).reshape(pending.shape).copy()
            )
            opt.zero_grad()
            pending.backward(grad)
            opt.step()
            pending = None
        x = torch.from_numpy(scaler.transform(table.rows(ids)))
        if kind == b"eval":
            with torch.no_grad():
                out = encoder(x)
        else:
            out = encoder(x)
            pending = out
        out = out.detach().numpy()
        if masks is not None:
            out = masks.mask(out, round_no)
            round_no += 1
        sock.send_multipart([out])


def _active(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from securevfl.config import load_config
    from securevfl.methods.blocks.nets import batches, make_optimizer, task_loss
    from securevfl.metrics import task_metrics

    torch.set_num_threads(1)
    cfg = load_config(spec["config"])
    active, train_ids, test_ids, head = F.active_split(cfg, spec["files"])
    opt = make_optimizer(head.parameters(), cfg)
    sock = _socket(ACTIVE, spec)
    empty = np.zeros(0, dtype=np.float32)
    sock.send_multipart([b"setup", np.asarray(train_ids, dtype=np.int64)])
    marks = []  # CPU seconds at each training call
    grad = empty
    epoch_seconds = []
    for epoch in range(cfg.epochs):
        started = time.perf_counter()
        for ids in batches(train_ids, cfg.batch_size, seed=cfg.seed, epoch=epoch):
            marks.append(time.process_time())
            sock.send_multipart([b"train", np.asarray(ids, dtype=np.int64), grad])
            s = _received_sum(sock.recv(), spec).reshape(len(ids), cfg.width)
            z = torch.from_numpy(s.copy()).requires_grad_()
            loss = task_loss(cfg.task, head(z), torch.as_tensor(active.label_rows(ids)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            grad = z.grad.numpy()
        epoch_seconds.append(time.perf_counter() - started)
    sock.send_multipart([b"eval", np.asarray(test_ids, dtype=np.int64), grad])  # last step too
    s = _received_sum(sock.recv(), spec).reshape(len(test_ids), cfg.width)
    with torch.no_grad():
        output = head(torch.from_numpy(s.copy())).numpy()
    test = task_metrics(cfg.task, y_true=active.label_rows(test_ids), output=output)
    sock.send_multipart([b"stop", empty, empty])
    _close(sock)
    return {
        "cpu_marks": marks,
        "epoch_seconds": [round(x, 4) for x in epoch_seconds],
        "test": test,
    }


def _role_main(role: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    spec["server"] = [k.encode() for k in spec["server"]]
    if role == AGGREGATOR:
        result = _aggregator(spec)
    elif role == ACTIVE:
        result = _active(spec)
    else:
        result = _party(role, spec)
    print(json.dumps(result), flush=True)
    os._exit(0)  # nothing to tear down: the sockets' peers are done too


# --- one bare federation


def run_bare(
    prep: F.Prepared, raw: dict[str, Any], out: Path, *, timeout: float = 1800
) -> dict[str, Any]:
    """One bare federation on `prep`'s files with `raw`'s model and training settings: epoch
    seconds (the active party's clock), test metrics and each role's CPU seconds per batch."""
    import zmq

    from securevfl.config import load_config
    from securevfl.launcher import free_port

    out = Path(out)
    cfg_path = F.write_toml(raw, out / "config.toml")
    cfg = load_config(cfg_path)
    server = zmq.curve_keypair()
    spec = {
        "config": str(cfg_path),
        "files": {r: str(p) for r, p in prep.files.items()},
        "parties": list(cfg.party_names),
        "aggregation": cfg.aggregation,
        "timeout_s": timeout,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "server": [k.decode() for k in server],
    }
    spec_path = out / "bare.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    roles = [AGGREGATOR, ACTIVE, *cfg.party_names]
    load_before = F.loadavg()
    logs = {r: (out / f"{r}.out", out / f"{r}.err") for r in roles}
    procs = {}
    for r in roles:
        with logs[r][0].open("w") as stdout, logs[r][1].open("w") as stderr:
            procs[r] = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "role", r, str(spec_path)],
                env=env,
                stdout=stdout,
                stderr=stderr,
            )
    reaped: dict[str, tuple[int, Any]] = {}
    # one failed role fails the run: the others (waiting for it) are stopped at once
    F.supervise(procs, reaped, timeout=timeout, grace=0.0)
    codes = {r: code for r, (code, _) in reaped.items()}
    results: dict[str, Any] = {}
    for r in sorted(roles, key=lambda r: codes[r] <= 0):  # failed on its own before stopped
        text = logs[r][0].read_text().strip()
        if codes[r] != 0 or not text:
            err = logs[r][1].read_text()[-2000:] or f"stopped after {timeout:g} s, or by another"
            return {"ok": False, "error": f"{r} exited {codes[r]}: {err}"}
        results[r] = json.loads(text.splitlines()[-1])
    return {
        "ok": True,
        "epoch_seconds": results[ACTIVE]["epoch_seconds"],
        "median_epoch_seconds": statistics.median(results[ACTIVE]["epoch_seconds"]),
        "test": results[ACTIVE]["test"],
        "batches": len(results[ACTIVE]["cpu_marks"]),
        "cpu_us_per_batch": {r: steady_cpu_us(results[r]["cpu_marks"], cfg.epochs) for r in roles},
        "load_before": load_before,
    }


def steady_cpu_us(marks: list[float], epochs: int) -> float:
    """CPU microseconds a batch after the first epoch (its first calls pay one-off costs: lazy
    imports, torch's first kernels): from the first call of the second epoch to the last call,
    over the calls between. With one epoch, over all of them."""
    first = len(marks) // epochs if epochs > 1 else 0
    if len(marks) - 1 - first < 1:
        return float("nan")
    return round(1e6 * (marks[-1] - marks[first]) / (len(marks) - 1 - first), 1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["role"] and len(argv) == 3:
        return _role_main(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    F.size_arguments(ap, parties="2,4", epochs=10, repeats=3, work="/tmp/securevfl-bare")
    ap.add_argument("--securevfl", action="store_true", help="also securevfl's federation")
    ap.add_argument(
        "--aggregations", default="plain", help="plain and/or mask (arms bare-mask, securevfl-mask)"
    )
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.parties.split(",")]
    started = time.time()
    aggregations = args.aggregations.split(",")
    if not set(aggregations) <= {"plain", "mask"}:
        raise SystemExit(f"--aggregations {args.aggregations!r}: plain and/or mask")
    preps = {
        k: F.prepare(F.dataset_for(args.work, rows=args.rows, parties=k, data=args.data), args.work)
        for k in ks
    }
    arms = ["centralised"]
    for agg in aggregations:
        suffix = "" if agg == "plain" else f"-{agg}"
        arms += [f"bare{suffix}", *([f"securevfl{suffix}"] if args.securevfl else [])]
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for k in ks:
            for name in arms:
                base, _, agg = name.partition("-")
                run = {"centralised": F.run_centralised, "bare": run_bare}.get(
                    base, F.run_federation
                )
                raw = F.config_raw(
                    preps[k].dataset,
                    aggregation=agg or "plain",
                    epochs=args.epochs,
                    batch_size=args.batch,
                )
                r = run(preps[k], raw, args.work / f"r{rep}-k{k}-{name}")
                r.update(arm=name, parties=k, repeat=rep)
                runs.append(r)
                print(
                    f"k={k} rep={rep} {name} ok={r.get('ok')} {r.get('epoch_seconds')}", flush=True
                )
                if not r.get("ok"):
                    print(r.get("error", ""), file=sys.stderr)
    table = []
    for k in ks:
        row: dict[str, Any] = {"parties": k}
        for name in arms:
            mine = [r for r in runs if r["arm"] == name and r["parties"] == k and r.get("ok")]
            epochs = [x for r in mine for x in r.get("epoch_seconds", [])]
            if not epochs:
                continue
            row[f"{name}_epoch_s"] = round(statistics.median(epochs), 4)
            row[f"{name}_test"] = mine[-1].get("test")
            if name.startswith("bare"):
                row[f"{name}_cpu_us_per_batch"] = {
                    role: statistics.median(r["cpu_us_per_batch"][role] for r in mine)
                    for role in mine[0]["cpu_us_per_batch"]
                }
        for name in arms[1:]:
            if f"{name}_epoch_s" in row and "centralised_epoch_s" in row:
                row[f"{name}_ratio"] = round(row[f"{name}_epoch_s"] / row["centralised_epoch_s"], 2)
            plain = name.partition("-")[0]
            if name != plain and f"{name}_epoch_s" in row and f"{plain}_epoch_s" in row:
                row[f"{name}_over_plain"] = round(
                    row[f"{name}_epoch_s"] / row[f"{plain}_epoch_s"], 3
                )
        table.append(row)
    result = F.result_of("bare_federation.py", argv, args, started, table=table, runs=runs)
    F.write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
