"""Soak: many secure sums in one long-lived federation; memory and file descriptors stay flat.

    python bench/soak.py                                  # 10^4 mask + 10^4 ckks rounds
    python bench/soak.py --rounds 2000 --ckks-rounds 500 --out /tmp/soak.json

One federation of four OS processes over TCP loopback with CurveZMQ (`transport.Hub` in the
aggregator, `transport.Peer` in the others): the aggregator, the active party (the CKKS key
holder) and two passive parties. Each round the aggregator tells the parties to go, each party
protects a small vector with its secure-sum stage (`securevfl.secure_sum`: `MaskParty` or
`CkksParty`), the aggregator accepts and combines the two contributions, the active party
reveals the sum, checks it against the parties' inputs (which it can recompute from the round
number: they are seeded by it) and acknowledges. The mask phase runs first, then the ckks phase,
in the same processes and over the same connections.

The bench samples every role's resident memory (VmRSS) and open file descriptors (/proc/PID/fd)
from outside, every `--sample-every` rounds. Growth is measured from the first sample taken
after a warm-up (`--warmup` rounds of each phase: allocators, libzmq and SEAL reach their
working set there) to the last sample of the phase; the check is RSS growth < 5 % and an
unchanged descriptor count for every role. Writes bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "bench" / "results" / "soak.json"
PARTIES = ("alpha", "beta")
ROLES = ("aggregator", "active", *PARTIES)
KINDS = ("setup", "go", "contribution", "combined", "ack", "stop")
PHASES = ("mask", "ckks")
TIMEOUT = 120.0  # any one wait; a stuck federation fails the bench instead of hanging it
CKKS_PRECISION_BITS = 12


def party_input(name: str, phase: str, rnd: int, length: int) -> Any:
    """A party's vector for a round: reproducible by the active party, which checks sums."""
    import numpy as np

    seed = [PARTIES.index(name), PHASES.index(phase), rnd]
    return np.random.default_rng(seed).normal(size=length)


# ------------------------------------------------------------------------------ the roles


def _peer(name: str, keys: dict[str, Any], endpoint: str) -> Any:
    from transport import CurveKeyPair, Peer

    return Peer(
        name=name,
        connect=endpoint,
        keypair=CurveKeyPair.from_json(keys["curve"][name]),
        server_public=keys["curve"]["aggregator"]["public"].encode(),
        kinds=KINDS,
        heartbeat_interval=0.5,
        peer_timeout=30.0,
    )


def _mask_session(name: str, keys: dict[str, Any], session: bytes) -> Any:
    from crypto import MaskingKeyPair
    from securevfl.secure_sum import SumSession

    return SumSession(
        name=name,
        session=session,
        mask_keypair=MaskingKeyPair.from_json(keys["mask"][name]) if name in PARTIES else None,
        mask_publics={p: bytes.fromhex(keys["mask"][p]["public"]) for p in PARTIES},
    )


def _recv(endpoint: Any, kind: str) -> Any:
    env = endpoint.recv(timeout=TIMEOUT)
    if env.kind != kind:
        raise RuntimeError(f"{endpoint.name} expected {kind!r}, got {env.kind!r}")
    return env


def aggregator_role(keys: dict[str, Any], plan: dict[str, Any], conn: Any) -> None:
    from securevfl.secure_sum import CkksAggregator, MaskAggregator, SumSession
    from transport import Allowlist, CurveKeyPair, Envelope, Hub

    hub = Hub(
        name="aggregator",
        bind="tcp://127.0.0.1:0",
        keypair=CurveKeyPair.from_json(keys["curve"]["aggregator"]),
        allowlist=Allowlist({r: keys["curve"][r]["public"] for r in ROLES[1:]}),
        kinds=KINDS,
        heartbeat_interval=0.5,
        peer_timeout=30.0,
    )
    try:
        conn.send(hub.endpoint)
        hub.wait_for(ROLES[1:], timeout=TIMEOUT)
        setup = _recv(hub, "setup")  # the key holder's public CKKS context, for the parties
        for p in PARTIES:
            hub.send(p, Envelope(kind="setup", sender="aggregator", tensors=setup.tensors))
        context = setup.tensors["context"].tobytes()
        session = bytes.fromhex(plan["session"])
        stages = {
            "mask": MaskAggregator(_mask_session("aggregator", keys, session)),
            "ckks": CkksAggregator(
                SumSession(name="aggregator", session=session, ckks_public_context=context)
            ),
        }
        group = list(PARTIES)
        for phase in PHASES:
            stage = stages[phase]
            for rnd in range(plan["rounds"][phase]):
                for p in PARTIES:
                    hub.send(p, Envelope(kind="go", sender="aggregator", round=rnd))
                accepted = {}
                while len(accepted) < len(PARTIES):
                    env = _recv(hub, "contribution")
                    accepted[env.sender] = stage.accept(env.tensors, key="s", sender=env.sender)
                combined = stage.combine_accepted(accepted, group=group, key="s")
                hub.send(
                    "active",
                    Envelope(kind="combined", sender="aggregator", round=rnd, tensors=combined),
                )
                _recv(hub, "ack")
                conn.send((phase, rnd))  # progress, for the sampler
        for r in ROLES[1:]:
            hub.send(r, Envelope(kind="stop", sender="aggregator"))
        conn.send(("done", hub.rejected))
    finally:
        time.sleep(0.5)  # let the stops leave
        hub.close()


def active_role(keys: dict[str, Any], plan: dict[str, Any], endpoint: str) -> None:
    import numpy as np

    from crypto.ckks import CkksKeyHolder, DecryptionRelease, choose_params
    from securevfl.secure_sum import CkksActive, MaskActive, SumSession
    from transport import Envelope

    peer = _peer("active", keys, endpoint)
    try:
        params = choose_params(
            precision_bits=CKKS_PRECISION_BITS, magnitude=2.0**10, terms=len(PARTIES) + 1
        ).params
        holder = CkksKeyHolder(params=params)
        context = np.frombuffer(holder.public_context_bytes(), dtype=np.uint8)
        peer.send(Envelope(kind="setup", sender="active", tensors={"context": context}))
        session = bytes.fromhex(plan["session"])
        release = DecryptionRelease(precision_bits=CKKS_PRECISION_BITS, flood_bits=10)
        stages = {
            "mask": MaskActive(_mask_session("active", keys, session)),
            "ckks": CkksActive(
                SumSession(name="active", session=session, ckks_release=release),
                key_holder=holder,
            ),
        }
        tolerance = {"mask": 2.0 ** -(20 - 2), "ckks": 2.0 ** -(CKKS_PRECISION_BITS - 2)}
        worst = dict.fromkeys(PHASES, 0.0)
        n = plan["length"]
        for phase in PHASES:
            for rnd in range(plan["rounds"][phase]):
                env = _recv(peer, "combined")
                got = stages[phase].reveal(env.tensors, group=list(PARTIES), key="s", shape=(n,))
                want = sum(party_input(p, phase, rnd, n) for p in PARTIES)
                error = float(np.abs(got - want).max())
                worst[phase] = max(worst[phase], error)
                if error > tolerance[phase]:
                    raise RuntimeError(f"{phase} round {rnd}: the sum is off by {error}")
                peer.send(Envelope(kind="ack", sender="active", round=rnd))
        _recv(peer, "stop")
        Path(plan["report"]).write_text(json.dumps({"max_abs_error": worst}))
    finally:
        peer.close()


def party_role(name: str, keys: dict[str, Any], plan: dict[str, Any], endpoint: str) -> None:
    from securevfl.secure_sum import CkksParty, MaskParty, SumSession
    from transport import Envelope

    peer = _peer(name, keys, endpoint)
    try:
        setup = _recv(peer, "setup")
        session = bytes.fromhex(plan["session"])
        stages = {
            "mask": MaskParty(_mask_session(name, keys, session)),
            "ckks": CkksParty(
                SumSession(
                    name=name,
                    session=session,
                    ckks_public_context=setup.tensors["context"].tobytes(),
                )
            ),
        }
        for phase in PHASES:
            for rnd in range(plan["rounds"][phase]):
                _recv(peer, "go")
                x = party_input(name, phase, rnd, plan["length"])
                tensors = stages[phase].protect(x, round=rnd, group=list(PARTIES), key="s")
                peer.send(Envelope(kind="contribution", sender=name, round=rnd, tensors=tensors))
        _recv(peer, "stop")
    finally:
        peer.close()


# ------------------------------------------------------------------------------ the sampler


def usage(pid: int) -> dict[str, int]:
    """Resident memory (KiB) and open descriptors of a live process."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def growth(samples: list[dict[str, Any]], phase: str, warmup: int) -> dict[str, Any]:
    """Per role: RSS and descriptors at the first sample after the warm-up and at the end."""
    mine = [s for s in samples if s["phase"] == phase and s["round"] >= warmup]
    out: dict[str, Any] = {}
    if len(mine) < 2:
        return out
    first, last = mine[0], mine[-1]
    for role in ROLES:
        rss = [s["roles"][role]["rss_kib"] for s in mine]
        fds = [s["roles"][role]["fds"] for s in mine]
        out[role] = {
            "rss_kib_after_warmup": first["roles"][role]["rss_kib"],
            "rss_kib_end": last["roles"][role]["rss_kib"],
            "rss_kib_max": max(rss),
            "rss_growth": (last["roles"][role]["rss_kib"] - first["roles"][role]["rss_kib"])
            / first["roles"][role]["rss_kib"],
            "fds_min": min(fds),
            "fds_max": max(fds),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10_000, help="mask rounds")
    ap.add_argument("--ckks-rounds", type=int, default=10_000)
    ap.add_argument("--length", type=int, default=16, help="values per sum")
    ap.add_argument(
        "--warmup", type=int, default=500, help="rounds of each phase before the baseline"
    )
    ap.add_argument("--sample-every", type=int, default=250)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    import secrets
    import tempfile

    from crypto import MaskingKeyPair
    from transport import CurveKeyPair

    keys = {
        "curve": {r: CurveKeyPair.generate().to_json() for r in ROLES},
        "mask": {r: MaskingKeyPair.generate().to_json() for r in PARTIES},
    }
    rounds = {"mask": args.rounds, "ckks": args.ckks_rounds}
    warmup = {p: min(args.warmup, max(rounds[p] // 10, 1)) for p in PHASES}
    report = Path(tempfile.mkdtemp(prefix="securevfl-soak-")) / "active.json"
    plan = {
        "rounds": rounds,
        "length": args.length,
        "session": secrets.token_bytes(16).hex(),
        "report": str(report),
    }
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    os.environ.update(env)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = {"aggregator": ctx.Process(target=aggregator_role, args=(keys, plan, child))}
    procs["aggregator"].start()
    started = time.monotonic()
    status = "ok"
    samples: list[dict[str, Any]] = []
    phase_seconds: dict[str, float] = {}
    rejected = None
    try:
        if not parent.poll(TIMEOUT):
            raise RuntimeError("the aggregator did not bind")
        endpoint = parent.recv()
        procs["active"] = ctx.Process(target=active_role, args=(keys, plan, endpoint))
        for p in PARTIES:
            procs[p] = ctx.Process(target=party_role, args=(p, keys, plan, endpoint))
        for name in ROLES[1:]:
            procs[name].start()
        phase_started = time.monotonic()
        last_phase = PHASES[0]
        while True:
            if not parent.poll(TIMEOUT):
                dead = {r: p.exitcode for r, p in procs.items() if not p.is_alive()}
                raise RuntimeError(f"no progress in {TIMEOUT} s (ended roles: {dead})")
            phase, value = parent.recv()
            if phase == "done":
                rejected = value
                phase_seconds[last_phase] = time.monotonic() - phase_started
                break
            if phase != last_phase:
                phase_seconds[last_phase] = time.monotonic() - phase_started
                phase_started, last_phase = time.monotonic(), phase
            rnd = value
            if rnd % args.sample_every == 0 or rnd == rounds[phase] - 1:
                samples.append(
                    {
                        "phase": phase,
                        "round": rnd,
                        "seconds": round(time.monotonic() - started, 2),
                        "roles": {r: usage(p.pid) for r, p in procs.items()},
                    }
                )
                if rnd % (args.sample_every * 8) == 0:
                    print(f"{phase} round {rnd}: {samples[-1]['roles']}", flush=True)
        for p in procs.values():
            p.join(TIMEOUT)
        codes = {r: p.exitcode for r, p in procs.items()}
        if any(c != 0 for c in codes.values()):
            status = f"a role failed: exit codes {codes}"
    except Exception as exc:  # reported in the result, with what was sampled until then
        status = f"failed: {exc}"
    finally:
        for p in procs.values():  # only our own children, by handle
            if p.is_alive():
                p.kill()
                p.join()
    accuracy = json.loads(report.read_text()) if report.exists() else {}
    per_phase = {p: growth(samples, p, warmup[p]) for p in PHASES}
    worst_rss = max(
        (g["rss_growth"] for ph in per_phase.values() for g in ph.values()), default=None
    )
    fds_flat = all(g["fds_min"] == g["fds_max"] for ph in per_phase.values() for g in ph.values())
    result = {
        "summary": {
            "status": status,
            "rounds": rounds,
            "values_per_sum": args.length,
            "warmup_rounds": warmup,
            "seconds_per_round": {
                p: phase_seconds[p] / rounds[p] for p in PHASES if p in phase_seconds
            },
            "max_rss_growth": worst_rss,
            "rss_growth_below_5_percent": worst_rss is not None and worst_rss < 0.05,
            "fds_flat": fds_flat and bool(samples),
            "max_abs_error": accuracy.get("max_abs_error"),
            "hub_rejected_messages": rejected,
            "wall_seconds": round(time.monotonic() - started, 1),
        },
        "per_phase": per_phase,
        "command": "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_1min": round(os.getloadavg()[0], 2),
        },
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    s = result["summary"]
    return 0 if status == "ok" and s["rss_growth_below_5_percent"] and s["fds_flat"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
