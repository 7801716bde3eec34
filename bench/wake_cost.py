"""What one hop between two role processes costs on this machine, and how much of it is the
wake-up of an idle core: round trips of a Credit-sized exchange (a fused call out, a 256 x 16
float32 contribution back) between this process and a child, each pinned to one core,

- over raw pyzmq (a ROUTER and a DEALER, CURVE on or off) and over securevfl's transport
  (`transport.Hub` and `transport.Peer`: CURVE, envelopes, validation);
- with the two processes on different cores and on the same core;
- with nothing else running, and with an idle-priority (SCHED_IDLE) busy loop on every core
  used, which keeps those cores from halting (`--spin`).

Reports the median round trip (ms) over `--repeats` runs of `--trips` trips each, and for
securevfl's transport the CPU (thread time) of one receive on each side.

    python bench/wake_cost.py [--trips 2000] [--repeats 3] [--spin] [--out FILE.json]

Needs two cores. Every process it starts ends by itself (the child after its trips, a
spinner at its deadline or when this process is gone)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for path in (str(ROOT), str(BENCH)):
    if path not in sys.path:
        sys.path.insert(0, path)

import fedbench as F  # noqa: E402
import numpy as np  # noqa: E402

KINDS = {"call", "contribution"}
WARMUP = 100
PARTY = "p1"


def call_envelope(round: int) -> Any:
    """What the aggregator relays for one split-NN batch: the backward of batch t fused ahead
    of the forward of batch t+1 (`securevfl.roles.rounds.fuse`), with the active party's tag,
    256 rows, width 16."""
    from securevfl.methods import SumSpec
    from securevfl.roles.guard import call_tags
    from securevfl.roles.rounds import Call, fuse

    session = bytes(16)
    ids = np.arange(256, dtype=np.int64)
    common = {"session": session.hex(), "ids": ids, "to": (PARTY,)}
    backward = Call(
        op="backward", round=round, inputs={"grad": np.zeros((256, 16), np.float32)}, **common
    )
    forward = Call(op="forward", round=round + 1, sums=(SumSpec("z", "z", (PARTY,)),), **common)
    env = fuse([backward, forward], sender="aggregator")
    env.meta["auth"] = call_tags(
        env.meta, session=session, round=env.round, tensors=env.tensors, keys={PARTY: bytes(32)}
    )
    return env


def contribution_envelope(call: Any) -> Any:
    """A party's answer to `call`: its 256 x 16 float32 representation."""
    from transport import Envelope

    return Envelope(
        kind="contribution",
        sender=PARTY,
        session=call.session,
        round=call.round,
        tensors={"z": np.zeros((256, 16), np.float32)},
        meta={"shapes": {"z": [256, 16]}},
    )


def time_trips(trips: int, trip: Callable[[int], float]) -> tuple[float, float]:
    """Run `trip(i)` WARMUP + `trips` times; (wall ms per timed trip, the mean of what the
    timed trips returned: the CPU ms of one receive, or 0)."""
    started, spent = 0.0, 0.0
    for i in range(WARMUP + trips):
        if i == WARMUP:
            started = time.perf_counter()
        cpu = trip(i)
        if i >= WARMUP:
            spent += cpu
    return (time.perf_counter() - started) / trips * 1e3, spent / trips


def timed_recv(recv: Callable[[], Any]) -> tuple[Any, float]:
    """`recv()`'s result and the CPU ms (this thread's) it took."""
    t = time.thread_time()
    out = recv()
    return out, (time.thread_time() - t) * 1e3


def _raw_child(endpoint: str, keys: tuple | None, cpu: int, trips: int) -> None:
    import zmq

    from transport.envelope import pack

    os.sched_setaffinity(0, {cpu})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    sock.connect(endpoint)
    sock.send(b"hello")
    answer = pack(contribution_envelope(call_envelope(1)))
    for _ in range(WARMUP + trips):
        sock.recv_multipart(copy=False)
        sock.send_multipart(answer, copy=False)
    sock.close(linger=1000)
    ctx.term()


def raw_trip(*, curve: bool, cpus: tuple[int, int], trips: int) -> dict:
    """Round trips over a bare ROUTER/DEALER pair, the same bytes securevfl sends (packed
    once: no envelope work, no checks)."""
    import zmq

    from transport.envelope import pack

    os.sched_setaffinity(0, {cpus[0]})
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    keys = None
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        router.curve_server = True
        router.curve_publickey, router.curve_secretkey = server_public, server_secret
        keys = (public, secret, server_public)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    spawn = mp.get_context("spawn")
    child = spawn.Process(target=_raw_child, args=(f"tcp://127.0.0.1:{port}", keys, cpus[1], trips))
    child.start()
    try:
        rid, _ = router.recv_multipart()
        frames = [rid, *pack(call_envelope(1))]

        def trip(_: int) -> float:
            router.send_multipart(frames, copy=False)
            router.recv_multipart(copy=False)
            return 0.0

        trip_ms, _ = time_trips(trips, trip)
    finally:
        child.join(timeout=30)
        router.close(linger=0)
        ctx.term()
    return {"round_trip_ms": round(trip_ms, 4)}


def _peer_child(endpoint: str, pair, hub_public: bytes, cpu: int, trips: int, q) -> None:
    from transport import Peer

    os.sched_setaffinity(0, {cpu})
    peer = Peer(name=PARTY, connect=endpoint, keypair=pair, server_public=hub_public, kinds=KINDS)

    answer = contribution_envelope(call_envelope(1))  # made once, as the raw child's

    def trip(_: int) -> float:
        cpu_ms = timed_recv(lambda: peer.recv(timeout=30))[1]
        peer.send(answer)  # each send stamps a new seq
        return cpu_ms

    _, recv_ms = time_trips(trips, trip)
    q.put(recv_ms)
    time.sleep(0.5)  # the hub has the last reply before the socket goes
    peer.close()


def securevfl_trip(*, cpus: tuple[int, int], trips: int) -> dict:
    """Round trips between a `transport.Hub` and a `transport.Peer` in another process."""
    from transport import Allowlist, CurveKeyPair, Hub

    os.sched_setaffinity(0, {cpus[0]})
    hub_pair, pair = CurveKeyPair.generate(), CurveKeyPair.generate()
    hub = Hub(
        bind="tcp://127.0.0.1:0",
        keypair=hub_pair,
        allowlist=Allowlist({PARTY: pair.public}),
        kinds=KINDS,
    )
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    child = spawn.Process(
        target=_peer_child, args=(hub.endpoint, pair, hub_pair.public, cpus[1], trips, q)
    )
    child.start()
    try:
        hub.wait_for([PARTY], timeout=30)

        call = call_envelope(1)  # made once, as the raw case's: the trips time the transport

        def trip(_: int) -> float:
            hub.send(PARTY, call)  # each send stamps a new seq
            return timed_recv(lambda: hub.recv(timeout=30))[1]

        trip_ms, hub_ms = time_trips(trips, trip)
        peer_ms = q.get(timeout=30)
    finally:
        child.join(timeout=30)
        hub.close()
    return {
        "round_trip_ms": round(trip_ms, 4),
        "hub_recv_cpu_ms": round(hub_ms, 4),
        "peer_recv_cpu_ms": round(peer_ms, 4),
    }


def _spinner(cpu: int, parent: int, seconds: float) -> None:
    """A busy loop at idle priority on `cpu`: any other task there preempts it at once."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    end = time.monotonic() + seconds
    while time.monotonic() < end and os.getppid() == parent:
        for _ in range(10000):
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trips", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spin", action="store_true", help="also with SCHED_IDLE spinners")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("needs two cores", file=sys.stderr)
        return 2
    a, b = cores[0], cores[1]
    cases = {
        "raw, no CURVE": lambda c: raw_trip(curve=False, cpus=c, trips=args.trips),
        "raw, CURVE": lambda c: raw_trip(curve=True, cpus=c, trips=args.trips),
        "securevfl transport": lambda c: securevfl_trip(cpus=c, trips=args.trips),
    }
    placements = {"different cores": (a, b), "same core": (a, a)}
    spins = [False, True] if args.spin else [False]
    rows = []
    for spin in spins:
        for where, cpus in placements.items():
            for name, run in cases.items():
                samples = []
                for _ in range(args.repeats):
                    spinners = []
                    if spin:
                        spawn = mp.get_context("spawn")
                        for cpu in sorted(set(cpus)):
                            s = spawn.Process(target=_spinner, args=(cpu, os.getpid(), 120.0))
                            s.start()
                            spinners.append(s)
                        time.sleep(0.2)
                    try:
                        samples.append(run(cpus))
                    finally:
                        for s in spinners:
                            s.terminate()
                            s.join(timeout=10)
                row = {
                    "transport": name,
                    "placement": where,
                    "idle_spinners": spin,
                    **{k: round(statistics.median(s[k] for s in samples), 4) for k in samples[0]},
                    "samples": samples,
                }
                print(
                    f"{name:20s} {where:16s} spin={spin!s:5s} "
                    f"{row['round_trip_ms']:.3f} ms a round trip",
                    flush=True,
                )
                rows.append(row)
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": F.cpu_model(),
        "cores": len(cores),
        "trips": args.trips,
        "table": [{k: v for k, v in r.items() if k != "samples"} for r in rows],
        "rows": rows,
    }
    F.write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
