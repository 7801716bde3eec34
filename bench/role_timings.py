"""Where a role's time goes, per call: a real Credit federation (`fedbench.run_federation`, the
processes `securevfl run` starts) whose roles time a few named functions — a passive party's
whole answer (call in to contribution out), its method's operations, its sends and receives —
and report the median wall and CPU (thread) time of each. The timing is put in by a
`sitecustomize.py` on the roles' PYTHONPATH, not in securevfl's code; it costs a few
microseconds a call, the same in every arm. `--detail` also times the parties' checks and
sums, the aggregator's round and the active party's side (`DETAIL`); a function missing from
an arm's tree is left untimed there. With `--detail` each call's start is on the clock every
process shares, so the run's timeline also says where a batch's wall time goes
(`batch_phases`: the active party's post, the parties' answers, the hop to the aggregator, its
sum, the way to the active party and the active party's own work). The table gives, per arm,
the median over the roles of a kind (party, aggregator, active) of each label's median CPU per
call, and the median over the runs of each batch phase.

    python bench/role_timings.py [--data credit_default.csv] [--parties 4] [--epochs 3]
        [--repeats 2] [--arm NAME=TREE[:KEY=VALUE,...]]... [--detail] [--out FILE.json]

An arm is `bench/fed_central.py`'s: the roles run the code in TREE (`.`: this checkout; a copy
of an older version to compare it) with config keys (section.key=value) or environment
variables (UPPER_CASE=value) set, e.g. `--arm off=.:run.aggregation=mask,SECUREVFL_MASK_AHEAD=0
--arm on=.:run.aggregation=mask,SECUREVFL_MASK_AHEAD=1`; arms are interleaved in every repeat.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import fedbench as F  # noqa: E402
from fed_central import environment_of, parse_arm, with_overrides  # noqa: E402

# (module, class, function, label): what the roles time
TIMED = (
    ("securevfl.roles.rounds", "PartyRound", "answer", "party.answer"),
    ("securevfl.roles.rounds", "PartyRound", "_operation", "party.operation"),
    ("transport.peer", "Peer", "send", "peer.send"),
    ("transport.peer", "Peer", "recv", "peer.recv"),
    ("transport.hub", "Hub", "send_each", "hub.send_each"),
)
# --detail: where a secure mode's extra CPU goes (the party's checks and sums, the aggregator's
# round, the active party's side)
DETAIL = (
    ("securevfl.roles.guard", "CallGuard", "authenticate", "guard.authenticate"),
    ("securevfl.roles.guard", "CallGuard", "check", "guard.check"),
    ("securevfl.roles.guard", "CallGuard", "after", "guard.after"),
    ("securevfl.roles.guard", "FamilyGuard", "admit", "guard.family_admit"),
    ("securevfl.roles.guard", "FamilyLog", "append", "guard.family_log"),
    ("securevfl.roles.rounds", "PartyRound", "_model_digest", "guard.model_digest"),
    ("securevfl.secure_sum", "MaskParty", "protect", "mask.protect"),
    ("securevfl.secure_sum", "MaskParty", "idle", "mask.idle"),
    ("securevfl.secure_sum", "CkksParty", "protect", "ckks.protect"),
    ("securevfl.secure_sum", "CkksParty", "idle", "ckks.idle"),
    ("securevfl.roles.aggregator", "Aggregator", "_round", "aggregator.round"),
    ("transport.hub", "Hub", "recv", "hub.recv"),
    ("transport.hub", "Hub", "_handle", "hub.handle"),
    ("securevfl.roles.rounds", "AggregatorRound", "accept", "aggregator.accept"),
    ("securevfl.roles.rounds", "AggregatorRound", "result", "aggregator.result"),
    ("securevfl.roles.active_round", "ActiveRound", "post", "active.post"),
    ("securevfl.roles.active_round", "ActiveRound", "_settle", "active.settle"),
    ("securevfl.secure_sum", "MaskActive", "reveal", "active.mask_reveal"),
    ("securevfl.secure_sum", "CkksActive", "reveal", "active.ckks_reveal"),
    # the model's own work in a split-NN role: reading the batch's rows, the optimiser
    # (PrivateTraining wraps it: Opacus's or the plain one) and autograd's backward
    ("securevfl.methods.splitnn", "SplitNNParty", "handle", "splitnn.handle"),
    ("securevfl.methods.splitnn", "SplitNNParty", "_inputs", "splitnn.inputs"),
    ("securevfl.privacy.runtime", "PrivateTraining", "step", "training.step"),
    ("securevfl.privacy.runtime", "PrivateTraining", "zero_grad", "training.zero_grad"),
    ("torch._tensor", "Tensor", "backward", "torch.backward"),
)

SITECUSTOMIZE = """
import atexit, importlib, json, os, sys, time
_OUT = os.environ.get("SECUREVFL_ROLE_TIMINGS")
if _OUT:
    _T = {}
    def _wrap(module, cls, name, label):
        try:
            owner = getattr(importlib.import_module(module), cls, None)
        except ImportError:
            owner = None
        inner = getattr(owner, name, None)
        if inner is None:  # not in this tree (an older copy of the code): not timed
            return
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                _T.setdefault(label, []).append(
                    (time.perf_counter() - wall, time.thread_time() - cpu, wall))
        setattr(owner, name, timed)
    for _spec in %r:
        _wrap(*_spec)
    def _dump():
        role = sys.argv[sys.argv.index("--name") + 1] if "--name" in sys.argv else (
            "aggregator" if "aggregator" in sys.argv else "active")
        with open(os.path.join(_OUT, role + ".json"), "w") as f:
            json.dump(_T, f)
    atexit.register(_dump)
"""


#: What `batch_phases` splits a training batch into (wall ms, but the two CPU sums), in order.
PHASES = (
    "post",  # the active party sends the batch's call (active.post)
    "to_parties",  # ... until the first party starts its answer (through the aggregator)
    "parties",  # the first answer's start to the last one's end
    "hop",  # the last answer's end to the aggregator's accepting it (send, transport, wake)
    "aggregate",  # that accept's start to the end of the aggregator's result
    "to_active",  # ... until the active party has the sum (transport, reveal: its settle ends)
    "active",  # the active party's own work until it posts the next batch
    "total",  # one post to the next
    "parties_cpu",  # CPU of the parties' answers, summed
    "ahead_cpu",  # CPU of the parties' work ahead after their sends (mask.idle, ckks.idle)
)


def batch_phases(raw: dict[str, dict[str, list]]) -> dict[str, float] | None:
    """Where a training batch's wall time goes, from the timeline of one run with `--detail`:
    `raw` is each role's samples by label, (wall s, CPU s, start s) each, the start on the
    clock all processes share (perf_counter: CLOCK_MONOTONIC). A batch runs from one
    active.post to the next (those 50 ms or more apart, set-up and evaluation, are left out)
    and counts only when every party answered once in it and the aggregator accepted and
    returned its sum; `PHASES` says what each phase is. Returns the median of each phase over
    those batches in ms, with their number as `batches`; None without such batches."""

    def calls(role: str, label: str) -> list[tuple[float, float, float]]:
        return sorted((s[2], s[2] + s[0], s[1]) for s in raw.get(role, {}).get(label, ()))

    posts = calls("active", "active.post")
    settles = calls("active", "active.settle")
    parties = sorted(r for r in raw if r not in ("active", "aggregator"))
    answers = {p: calls(p, "party.answer") for p in parties}
    ahead = [c for p in parties for label in ("mask.idle", "ckks.idle") for c in calls(p, label)]
    accepts = calls("aggregator", "aggregator.accept")
    results = calls("aggregator", "aggregator.result")
    if not parties or not posts:
        return None

    def within(rows: list, t0: float, t1: float) -> list:
        return [r for r in rows if t0 <= r[0] < t1]

    batches = []
    for (t0, post_end, _), (t1, _, _) in itertools.pairwise(posts):
        if t1 - t0 >= 0.05:
            continue
        mine = [within(answers[p], t0, t1) for p in parties]
        if any(len(a) != 1 for a in mine):
            continue
        first = min(a[0][0] for a in mine)
        last = max(a[0][1] for a in mine)
        accepted = within(accepts, first, t1)
        summed = within(results, t0, t1)
        settled = [s for s in settles if last <= s[1] < t1]
        if len(accepted) < len(parties) or len(summed) != 1 or len(settled) != 1:
            continue
        hop_end = accepted[-1][0]
        result_end = summed[0][1]
        settle_end = settled[0][1]
        batches.append(
            {
                "post": post_end - t0,
                "to_parties": first - post_end,
                "parties": last - first,
                "hop": hop_end - last,
                "aggregate": result_end - hop_end,
                "to_active": settle_end - result_end,
                "active": t1 - settle_end,
                "total": t1 - t0,
                "parties_cpu": sum(a[0][2] for a in mine),
                "ahead_cpu": sum(c[2] for c in within(ahead, t0, t1)),
            }
        )
    if not batches:
        return None
    out = {k: round(1e3 * statistics.median(b[k] for b in batches), 4) for k in PHASES}
    return {**out, "batches": len(batches)}


def summary(samples: list[list[float]]) -> dict[str, float]:
    wall = [s[0] for s in samples]
    cpu = [s[1] for s in samples]
    return {
        "calls": len(samples),
        "wall_ms_median": round(1e3 * statistics.median(wall), 4),
        "cpu_ms_median": round(1e3 * statistics.median(cpu), 4),
        "cpu_s_total": round(sum(cpu), 4),
    }


def arm_table(runs: list[dict]) -> dict:
    """One arm's summary: the median party answer CPU (over each party's median), the median
    epoch, and per "kind/label" (kind: party, aggregator or active) the median over the roles
    of that kind of their median CPU ms per call."""
    answers = [
        role["party.answer"]["cpu_ms_median"]
        for r in runs
        for role in r["roles"].values()
        if "party.answer" in role
    ]
    epochs = [e for r in runs for e in (r["epoch_seconds"] or [])]
    per_label: dict[str, list[float]] = {}
    for r in runs:
        for role, labels in r["roles"].items():
            kind = role if role in ("aggregator", "active") else "party"
            for label, stats in labels.items():
                per_label.setdefault(f"{kind}/{label}", []).append(stats["cpu_ms_median"])
    phases = [r["batch_ms_median"] for r in runs if r.get("batch_ms_median")]
    return {
        "party_answer_cpu_ms_median": statistics.median(answers) if answers else None,
        "epoch_s_median": statistics.median(epochs) if epochs else None,
        "cpu_ms_median": {k: round(statistics.median(v), 4) for k, v in sorted(per_label.items())},
        # where a batch's wall time goes (`batch_phases`), the median over the runs
        "batch_ms_median": (
            {k: round(statistics.median(p[k] for p in phases), 4) for k in PHASES}
            if phases
            else None
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=F.CREDIT)
    ap.add_argument("--parties", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--arm", action="append", default=[], help="NAME=TREE[:KEY=VALUE,...]")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "role_timings")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--detail", action="store_true", help="also time the checks, sums and rounds (DETAIL)"
    )
    args = ap.parse_args(argv)
    arms = [parse_arm(a) for a in args.arm] or [("plain", None, {})]
    ds = F.credit(args.data, parties=args.parties)
    prep = F.prepare(ds, args.work)
    site = args.work / "site"
    site.mkdir(parents=True, exist_ok=True)
    timed = TIMED + DETAIL if args.detail else TIMED
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE % (timed,))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(site), os.environ.get("PYTHONPATH")])
    )
    runs = []
    for repeat in range(args.repeats):
        for name, tree, overrides in arms:
            raw = with_overrides(
                F.config_raw(ds, aggregation="plain", epochs=args.epochs), overrides
            )
            env = environment_of(overrides)
            out = args.work / f"{name}-{repeat}"
            timings = out / "timings"
            # a run before with more parties left its roles' files here: they are not this run's
            shutil.rmtree(timings, ignore_errors=True)
            timings.mkdir(parents=True)
            env["SECUREVFL_ROLE_TIMINGS"] = str(timings)
            result = F.run_federation(prep, raw, out, env=env, pythonpath=tree)
            raw = {p.stem: json.loads(p.read_text()) for p in sorted(timings.glob("*.json"))}
            roles = {
                role: {label: summary(s) for label, s in labels.items()}
                for role, labels in raw.items()
            }
            phases = batch_phases(raw) if args.detail else None
            answers = [
                r["party.answer"]["cpu_ms_median"] for r in roles.values() if "party.answer" in r
            ]
            print(
                f"rep={repeat} {name}: epochs {result.get('epoch_seconds')} party answer CPU ms "
                f"(median per party) {answers}",
                flush=True,
            )
            runs.append(
                {
                    "arm": name,
                    "repeat": repeat,
                    "overrides": overrides,
                    "roles": roles,
                    "batch_ms_median": phases,
                    "epoch_seconds": result.get("epoch_seconds"),
                    "ok": result.get("ok"),
                }
            )
    table = {name: arm_table([r for r in runs if r["arm"] == name]) for name, _, _ in arms}
    result = {"command": "python " + " ".join(sys.argv), "machine": F.cpu_model()}
    F.write_result({**result, "table": table, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
