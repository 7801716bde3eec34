"""Federated plain epoch against the centralised single-process epoch of the same model, side by
side in one invocation (issue 17's floor: <= 3x with 2..8 parties on a 2-core machine).

Each arm is a real multi-process federation (`fedbench.run_federation`: the commands
`securevfl run` starts, CURVE on loopback); the centralised reference is `fedbench.centralised`
in a fresh process. Both time the same thing: the training batches of one epoch (the
federation's epoch clock stops before its per-epoch checkpoint round and restarts after it;
evaluation runs after training on both sides, untimed). Arms, centralised runs and party counts
are interleaved in every repeat so that a change in the machine's load hits them alike.

    python bench/fed_central.py [--rows 10000 | --data credit_default.csv] [--parties 2,4,8]
        [--epochs 3] [--repeats 2] [--arm NAME=TREE[:KEY=VALUE,...]]... [--reference NAME]
        [--out FILE.json]

An arm runs the roles with PYTHONPATH=TREE (a copy of the code, e.g. `git archive HEAD`, to
compare an older version) and the config overrides KEY=VALUE (e.g.
network.aggregator_in_active=true, run.aggregation=mask) or, for an upper-case KEY without a
dot, the roles' environment variable KEY (e.g. SECUREVFL_OVERLAP_SUMS=1). Default arms:
`plain` (this tree) and `plain+aia` (this tree, the aggregator in the active party's process).
Every other arm is also compared with the reference arm (`--reference`, default the first)
repeat by repeat: `NAME_paired` in the table, the per-repeat ratios, their median and a 95%
bootstrap interval of it (`paired_ratios`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import fedbench as F  # noqa: E402


def parse_arm(text: str) -> tuple[str, str | None, dict[str, Any]]:
    """NAME=TREE[:section.key=value,...,ENV_VAR=value,...] -> (name, tree or None for this one,
    overrides); an upper-case key without a dot is an environment variable of the roles."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--arm {text!r}: expected NAME=TREE[:section.key=value,...]")
    tree, _, opts = rest.partition(":")
    overrides: dict[str, Any] = {}
    for pair in filter(None, opts.split(",")):
        key, sep, value = pair.partition("=")
        if sep and key.isupper() and "." not in key:
            overrides[key] = value
            continue
        if not sep or "." not in key:
            raise SystemExit(
                f"--arm {text!r}: override {pair!r} is not section.key=value or ENV_VAR=value"
            )
        try:  # numbers, true/false and lists as TOML would read them; anything else a string
            overrides[key] = json.loads(value)
        except ValueError:
            overrides[key] = value
    return name, (None if tree in ("", ".") else str(Path(tree).resolve())), overrides


def environment_of(overrides: dict[str, Any]) -> dict[str, str]:
    """The overrides that are environment variables (upper-case, no dot)."""
    return {k: str(v) for k, v in overrides.items() if k.isupper() and "." not in k}


def with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(raw))
    for key, value in overrides.items():
        if key in environment_of(overrides):
            continue
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
    return out


def paired_ratios(
    runs: list[dict[str, Any]], *, arm: str, reference: str, parties: int, draws: int = 10000
) -> dict[str, Any] | None:
    """`arm`'s epoch against `reference`'s, repeat by repeat (each repeat runs both back to back,
    so a change of the machine's speed between repeats cancels): the per-repeat ratios of their
    median epochs, the median ratio, and a 95% interval of that median from `draws` bootstrap
    resamples of the repeats (seeded: the same runs give the same interval). None when fewer
    than two repeats have both arms."""
    import numpy as np

    def median_epoch(name: str, rep: int) -> float | None:
        found = [
            r["median_epoch_seconds"]
            for r in runs
            if r["arm"] == name and r["parties"] == parties and r["repeat"] == rep and r["ok"]
        ]
        return found[0] if found else None

    ratios = []
    for rep in sorted({r["repeat"] for r in runs}):
        a, b = median_epoch(arm, rep), median_epoch(reference, rep)
        if a is not None and b:
            ratios.append(a / b)
    if len(ratios) < 2:
        return None
    values = np.asarray(ratios)
    picks = np.random.default_rng(0).integers(0, len(values), size=(draws, len(values)))
    medians = np.median(values[picks], axis=1)
    return {
        "reference": reference,
        "ratios": [round(float(x), 4) for x in values],
        "median": float(np.median(values)),
        "ci95": [float(np.quantile(medians, 0.025)), float(np.quantile(medians, 0.975))],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    F.size_arguments(ap, parties="2,4,8", epochs=3, repeats=2, work="/tmp/securevfl-fed-central")
    ap.add_argument("--arm", action="append", default=[])
    ap.add_argument(
        "--reference",
        default=None,
        help="the arm the others are compared with repeat by repeat (default: the first)",
    )
    args = ap.parse_args(argv)
    arms = [
        parse_arm(a)
        for a in (args.arm or ["plain=.", "plain+aia=.:network.aggregator_in_active=true"])
    ]
    names = [name for name, _, _ in arms]
    reference = args.reference or names[0]
    if reference not in names:
        ap.error(f"--reference {reference!r} is not one of the arms {names}")
    ks = [int(k) for k in args.parties.split(",")]
    started = time.time()
    runs: list[dict[str, Any]] = []
    preps = {}
    for k in ks:
        ds = F.dataset_for(args.work, rows=args.rows, parties=k, data=args.data)
        preps[k] = F.prepare(ds, args.work)
    for rep in range(args.repeats):
        for k in ks:
            prep = preps[k]
            raw = F.config_raw(
                prep.dataset, aggregation="plain", epochs=args.epochs, batch_size=args.batch
            )
            c = F.run_centralised(prep, raw, args.work / f"r{rep}-k{k}-centralised")
            c.update(arm="centralised", parties=k, repeat=rep)
            runs.append(c)
            print(f"k={k} rep={rep} centralised {c.get('epoch_seconds')}", flush=True)
            for name, tree, overrides in arms:
                r = F.run_federation(
                    prep,
                    with_overrides(raw, overrides),
                    args.work / f"r{rep}-k{k}-{name}",
                    pythonpath=tree,
                    env=environment_of(overrides),
                )
                r.update(arm=name, repeat=rep, tree=tree or "this", overrides=overrides)
                runs.append(r)
                print(
                    f"k={k} rep={rep} {name} ok={r['ok']} {r.get('epoch_seconds')} "
                    f"processes={r['processes']} load={r['load_before']}",
                    flush=True,
                )
                if not r["ok"]:
                    print(r.get("error", ""), file=sys.stderr)
                if args.out is not None:  # what is done so far survives an interrupted run
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.with_suffix(".partial.json").write_text(
                        json.dumps(runs, indent=1, default=str) + "\n"
                    )
    table = []
    for k in ks:
        cen = [
            x
            for r in runs
            if r["arm"] == "centralised" and r["parties"] == k
            for x in r.get("epoch_seconds", [])
        ]
        cpu = [
            x
            for r in runs
            if r["arm"] == "centralised" and r["parties"] == k
            for x in r.get("epoch_cpu_seconds", [])
        ]
        row: dict[str, Any] = {
            "parties": k,
            "centralised_epoch_s": statistics.median(cen),
            "centralised_cpu_s": statistics.median(cpu),
        }
        for name, _, _ in arms:
            fed = [
                x
                for r in runs
                if r["arm"] == name and r["parties"] == k and r["ok"]
                for x in r["epoch_seconds"]
            ]
            if fed:
                row[f"{name}_epoch_s"] = statistics.median(fed)
                row[f"{name}_ratio"] = statistics.median(fed) / row["centralised_epoch_s"]
                row[f"{name}_ratio_to_cpu"] = statistics.median(fed) / row["centralised_cpu_s"]
            if name != reference:
                paired = paired_ratios(runs, arm=name, reference=reference, parties=k)
                if paired is not None:
                    row[f"{name}_paired"] = paired
                    print(
                        f"k={k} {name}/{reference}: median {paired['median']:.3f}, 95% interval "
                        f"{paired['ci95'][0]:.3f}-{paired['ci95'][1]:.3f} over "
                        f"{len(paired['ratios'])} repeats",
                        flush=True,
                    )
        table.append(row)
    result = F.result_of(
        "fed_central.py",
        argv or sys.argv[1:],
        args,
        started,
        arms=[{"name": n, "tree": t or "this", "overrides": o} for n, t, o in arms],
        table=table,
        runs=runs,
    )
    F.write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
