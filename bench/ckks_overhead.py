"""CKKS against plain on Credit (split-NN, 4 parties x 5 columns, batch 256, width 16), side by side
in one run: plain; ``ckks-before``, the CKKS sum before the raw wire format (SEAL's zstd
serialisation through a tmpfs file per ciphertext, encryptions of zero on a worker started at
once); ``ckks``, today's defaults (raw wire, zeros made by the party's own thread at once after
its send, while it waits for the next call), with the parameters a run sizes from the default
value bound ([secure]
bound = 2^20); and ckks with ``[secure] ckks.magnitude`` declared (default 1024). The sized
chains have no special prime (``crypto.ckks.choose_params``); ``ckks-special`` and
``ckks-m<magnitude>-special`` fix the chains that were sized before, with SEAL's 20-bit special
prime ((34, 33, 20) and (56, 20) at scale 2^40), so the two are compared in the same run
(``--variants`` picks).
``--ablation`` adds the other ways of making the encryptions of zero
(``SECUREVFL_CKKS_ZEROS``): ``ckks-thread`` (the default until 2026-11-24: a worker thread
woken by each call, which waits 2 ms first), ``ckks-raw-nodelay`` (that worker started at once),
``ckks-fresh`` (none made ahead), ``ckks-process`` (a nice-19 helper process per party),
``ckks-idle2ms`` (the party's own thread, 2 ms after its send); ``--variants`` runs a
subset (plain always runs). Variants are interleaved per repeat, each a real multi-process
federation over loopback ZeroMQ + CURVE (`bench/fedbench.py`); the switches are environment
variables (``SECUREVFL_CKKS_WIRE``, ``SECUREVFL_CKKS_PREP_DELAY``, ``SECUREVFL_CKKS_ZEROS``),
which the role processes inherit. Records per run: epoch times, bytes sent per party per epoch,
CPU seconds per role (wait4; a party's includes its reaped helper), the CKKS parameters each
run chose and their security level, and the ratios to plain (epoch median and bytes, and the
per-repeat epoch ratios against the plain run of the same repeat, to show their spread), with
the load average before each run; and whether SEAL's encryption releases the GIL. In-process,
per batch: the CPU of each crypto step alone (`per_batch_breakdown`, best of 20: a lower bound)
and of each role's stage as a run calls it (`per_batch_stages`: the real secure-sum classes,
the party's zero worker included, mean over 30 batches). ``--split-epochs`` runs each variant
again for two more epochs and splits each role's CPU into per-epoch and one-off seconds (the
whole-run ``extra_cpu_seconds_per_epoch`` counts one-off costs as per-epoch ones).

    nice -n 5 python bench/ckks_overhead.py --epochs 2 --repeats 3 --ablation \
        --variants ckks,ckks-process,ckks-fresh --out bench/results/ckks_overhead_3.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fedbench as F  # noqa: E402

from crypto.ckks import (  # noqa: E402
    WIRE_ENV,
    WIRE_RAW,
    WIRE_SEAL,
    CkksParams,
    choose_params,
    describe_params,
    security_level,
)

PREP_DELAY_ENV = "SECUREVFL_CKKS_PREP_DELAY"  # read by securevfl.secure_sum
ZEROS_ENV = "SECUREVFL_CKKS_ZEROS"  # read by securevfl.secure_sum (thread, process, idle, fresh)

REPO = Path(__file__).resolve().parents[1]

# what choose_params picked before chains lost their special prime (Credit, 4 parties, 12 bits):
# the default bound 2^20, and ckks.magnitude = 1024
SPECIAL_DEFAULT = CkksParams(4096, (34, 33, 20), 40)
SPECIAL_1024 = CkksParams(4096, (56, 20), 40)


def fixed(params: CkksParams) -> dict[str, Any]:
    """[secure] keys that fix `params` (chains with a special prime: SEAL's layout)."""
    return {
        "ckks.poly_modulus_degree": params.poly_modulus_degree,
        "ckks.coeff_mod_bit_sizes": list(params.coeff_mod_bit_sizes),
        "ckks.scale_bits": params.scale_bits,
    }


def chains(parties: int) -> dict[str, CkksParams]:
    """label -> the chains compared per batch: sized (no special prime) and the earlier ones."""
    from securevfl.secure_sum import CKKS_MIN_DEGREE  # what a run's sizing starts from

    return {
        "2^20 data-only": choose_params(
            precision_bits=12, magnitude=2.0**20, terms=parties + 1, min_degree=CKKS_MIN_DEGREE
        ).params,
        "2^20 special": SPECIAL_DEFAULT,
        "1024 data-only": choose_params(
            precision_bits=12, magnitude=1024.0, terms=parties + 1, min_degree=CKKS_MIN_DEGREE
        ).params,
        "1024 special": SPECIAL_1024,
    }


def variants(
    magnitude: float, *, ablation: bool = False
) -> dict[str, tuple[str, dict[str, Any], dict[str, str]]]:
    """label -> (aggregation, extra [secure] keys, environment of the role processes)."""
    out: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
        "plain": ("plain", {}, {}),
        "ckks-before": (
            "ckks",
            {},
            {WIRE_ENV: WIRE_SEAL, PREP_DELAY_ENV: "0", ZEROS_ENV: "thread"},
        ),
    }
    if ablation:
        out["ckks-raw-nodelay"] = (
            "ckks",
            {},
            {WIRE_ENV: WIRE_RAW, PREP_DELAY_ENV: "0", ZEROS_ENV: "thread"},
        )
        out["ckks-fresh"] = ("ckks", {}, {ZEROS_ENV: "fresh"})  # no zeros made ahead
        # made by a nice-19 helper process per party
        out["ckks-process"] = ("ckks", {}, {ZEROS_ENV: "process"})
        # the default before 2026-11-24 evening: a worker thread woken by each call, after 2 ms
        out["ckks-thread"] = ("ckks", {}, {ZEROS_ENV: "thread"})
        # the party's own thread after its send, 2 ms after it
        out["ckks-idle2ms"] = ("ckks", {}, {ZEROS_ENV: "idle", PREP_DELAY_ENV: "0.002"})
    # the default: raw wire, zeros made by the party's own thread at once after its send
    out["ckks"] = ("ckks", {}, {})
    out["ckks-special"] = ("ckks", fixed(SPECIAL_DEFAULT), {})
    out[f"ckks-m{magnitude:g}"] = ("ckks", {"ckks.magnitude": magnitude}, {})
    if magnitude == 1024.0:
        out[f"ckks-m{magnitude:g}-special"] = ("ckks", fixed(SPECIAL_1024), {})
    return out


def run_with_env(env: dict[str, str], fn: Any, *args: Any) -> Any:
    """fn(*args) with `env` set (and the switches of the other variants unset) in this
    process's environment, which fedbench hands to every role it starts."""
    switches = (WIRE_ENV, PREP_DELAY_ENV, ZEROS_ENV)
    saved = {k: os.environ.get(k) for k in (*switches, *env)}
    for k in switches:
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def per_batch_breakdown(*, parties: int, values: int = 4096, rounds: int = 20) -> dict[str, Any]:
    """In-process CPU time of every CKKS step of one Credit batch (256 x 16 = 4096 values), for
    each parameter set a run chooses and each wire format: best of `rounds`, milliseconds,
    per step and role (time.process_time of this single-threaded process)."""
    import numpy as np

    from crypto.ckks import CkksKeyHolder, CkksPublic, DecryptionRelease, PackedCiphertexts

    def best(fn: Any, setup: Any = None) -> tuple[float, Any]:
        times, out = [], None
        for _ in range(rounds):
            if setup is not None:
                setup()
            t = time.process_time()
            out = fn()
            times.append(time.process_time() - t)
        return round(1e3 * min(times), 3), out

    result: dict[str, Any] = {}
    release = DecryptionRelease(precision_bits=12, flood_bits=10)
    for chain, params in chains(parties).items():
        holder = CkksKeyHolder(params=params)
        x = np.random.default_rng(0).normal(size=values)
        for wire in (WIRE_SEAL, WIRE_RAW):
            pub = CkksPublic(context_bytes=holder.public_context_bytes(), wire=wire)
            codec = pub._codec
            steps: dict[str, float] = {}
            steps["party: encryption of zero (off the critical path)"], zero = best(
                lambda: codec.zero(pub._encryptor)  # noqa: B023
            )
            fresh: list[Any] = []  # a zero per timed round: adding the values uses it up
            steps["party: add the values to a zero (encode, add)"], zero = best(
                lambda: codec.encrypt_values(x, fresh.pop()),  # noqa: B023
                setup=lambda: fresh.append(codec.zero(pub._encryptor)),  # noqa: B023
            )
            steps["party: serialise"], chunk = best(lambda: codec.dump(zero, values))  # noqa: B023
            steps["aggregator: deserialise one"], (ct, _) = best(
                lambda: codec.load(chunk, expected_len=values, what="c")  # noqa: B023
            )
            other, _ = codec.load(chunk, expected_len=values, what="c")
            steps["aggregator: add one"], _ = best(
                lambda: codec.evaluator.add_inplace(ct, other)  # noqa: B023
            )
            steps["aggregator: serialise the sum"], total = best(
                lambda: codec.dump(ct, values)  # noqa: B023
            )
            hc = holder._codec
            steps["active: deserialise"], _ = best(
                lambda: hc.load(total, expected_len=values, what="s")  # noqa: B023
            )
            loaded: list[Any] = []  # decrypting a coefficient-form sum brings it into NTT form
            steps["active: decrypt and decode"], decoded = best(
                lambda: hc.decrypt_values(loaded.pop(), holder._decryptor, values),  # noqa: B023
                setup=lambda: loaded.append(  # noqa: B023
                    hc.load(total, expected_len=values, what="s")[0]  # noqa: B023
                ),
            )
            steps["active: flood and round"], _ = best(
                lambda: release.apply(decoded, params, terms=parties + 1)  # noqa: B023
            )
            packed = PackedCiphertexts(chunks=[total], length=values)
            steps["active: decrypt_sum (all of it)"], _ = best(
                lambda: holder.decrypt_sum(  # noqa: B023
                    packed,  # noqa: B023
                    shape=(values,),
                    release=release,
                    terms=parties + 1,
                )
            )
            critical = (
                steps["party: add the values to a zero (encode, add)"]
                + steps["party: serialise"]
                + parties * steps["aggregator: deserialise one"]
                + (parties - 1) * steps["aggregator: add one"]
                + steps["aggregator: serialise the sum"]
                + steps["active: decrypt_sum (all of it)"]
            )
            key = f"{'-'.join(map(str, params.coeff_mod_bit_sizes))} {wire}"
            result[key] = {
                "chain": chain,
                "params": list(params.coeff_mod_bit_sizes),
                "encoding": params.encoding,
                "special_prime": params.special_prime,
                "scale_bits": params.scale_bits,
                "wire": pub.wire_format,
                "chunk_bytes": len(chunk),
                "ms": steps,
                "ms_sum_of_crypto_steps_one_party_chain": round(critical, 3),
                "ms_cpu_all_roles": round(
                    parties
                    * (
                        steps["party: encryption of zero (off the critical path)"]
                        + steps["party: add the values to a zero (encode, add)"]
                        + steps["party: serialise"]
                    )
                    + parties * steps["aggregator: deserialise one"]
                    + (parties - 1) * steps["aggregator: add one"]
                    + steps["aggregator: serialise the sum"]
                    + steps["active: decrypt_sum (all of it)"],
                    3,
                ),
            }
    return result


def per_batch_stages(
    *,
    parties: int,
    values: int = 4096,
    rounds: int = 30,
    zeros: str = "thread",
    params: CkksParams | None = None,
) -> dict[str, Any]:
    """CPU milliseconds per batch of each role's secure-sum stage as a run calls it: the real
    `securevfl.secure_sum` classes (`CkksParty.protect` with its zero worker in mode `zeros`,
    `CkksAggregator.accept` of each contribution then `combine_accepted`, `CkksActive.reveal`
    with the run's flooding), `params` (default: those a run sizes from the default bound), the
    mean over
    `rounds` batches after 3 warm-up ones (not the best: what a run pays). Stage calls are
    timed with time.thread_time (the calling thread only). A party waits 5 ms after its call,
    as it waits for the network, so its zero worker runs then; the process CPU outside the
    main thread (time.process_time counts every thread) is that worker's. Also returns the
    largest error of a revealed sum against the exact sum, which the flooding and rounding
    bound; `per_batch_breakdown` times the crypto steps alone."""
    import numpy as np

    from crypto.ckks import CkksKeyHolder, DecryptionRelease
    from securevfl.secure_sum import CkksActive, CkksAggregator, CkksParty, SumSession

    if params is None:
        params = choose_params(precision_bits=12, magnitude=2.0**20, terms=parties + 1).params
    holder = CkksKeyHolder(params=params)
    context = holder.public_context_bytes()
    names = [f"p{i + 1}" for i in range(parties)]
    stages = [
        CkksParty(SumSession(name=n, session=b"s" * 16, ckks_public_context=context), zeros=zeros)
        for n in names
    ]
    aggregator = CkksAggregator(
        SumSession(name="aggregator", session=b"s" * 16, ckks_public_context=context)
    )
    release = DecryptionRelease(precision_bits=12, flood_bits=10)
    active = CkksActive(
        SumSession(name="active", session=b"s" * 16, ckks_release=release), key_holder=holder
    )
    rng = np.random.default_rng(0)
    shape = (values // 16, 16)
    spent = {"party: protect (main thread)": 0.0, "aggregator: accept + combine": 0.0}
    spent["active: reveal"] = 0.0
    error = 0.0

    def batch(r: int, record: bool) -> None:
        nonlocal error
        xs = [rng.normal(size=shape).astype(np.float32) for _ in names]
        sent = {}
        for n, stage, x in zip(names, stages, xs, strict=True):
            t = time.thread_time()
            sent[n] = stage.protect(x, round=r, group=names, key="h")
            if record:
                spent["party: protect (main thread)"] += time.thread_time() - t
            time.sleep(0.005)  # the party waits for the network: its zero worker runs
        t = time.thread_time()
        accepted = {n: aggregator.accept(a, key="h", sender=n) for n, a in sent.items()}
        combined = aggregator.combine_accepted(accepted, group=names, key="h")
        t2 = time.thread_time()
        value = active.reveal(combined, group=names, key="h", shape=shape)
        t3 = time.thread_time()
        if record:
            spent["aggregator: accept + combine"] += t2 - t
            spent["active: reveal"] += t3 - t2
            exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
            error = max(error, float(np.max(np.abs(value - exact))))

    for r in range(3):
        batch(r, False)
    started, started_main = time.process_time(), time.thread_time()
    for r in range(3, 3 + rounds):
        batch(r, True)
    total = time.process_time() - started
    main_thread = time.thread_time() - started_main
    for stage in stages:  # the zero workers stop here, not at exit
        stage.close()
    ms = {k: round(1e3 * v / rounds, 3) for k, v in spent.items()}
    ms["party: protect (main thread)"] = round(ms["party: protect (main thread)"] / parties, 3)
    all_roles = 1e3 * total / rounds
    ms["party: zero worker (the process CPU outside the main thread, per party)"] = round(
        1e3 * (total - main_thread) / rounds / parties, 3
    )
    return {
        "params": list(params.coeff_mod_bit_sizes),
        "special_prime": params.special_prime,
        "scale_bits": params.scale_bits,
        "zeros": zeros,
        "parties": parties,
        "values": values,
        "rounds": rounds,
        "ms": ms,
        "ms_cpu_all_roles": round(all_roles, 3),
        "max_abs_error": error,
        "flood_std": release.flood_std(params, terms=parties),
    }


def split_cpu(
    short: dict[str, float], long: dict[str, float], *, epochs_short: int, epochs_long: int
) -> dict[str, dict[str, float]]:
    """Per role, the CPU seconds a run spends per epoch and once (start-up, keys, contexts,
    test), from the wait4 CPU of the same federation run for two epoch counts:
    per epoch = (long - short) / (epochs_long - epochs_short), once = short - epochs_short *
    per epoch. `extra_cpu_seconds_per_epoch` divides a whole run by its epochs, so a variant's
    one-off costs (e.g. CKKS contexts) show up there as per-epoch costs."""
    if epochs_long <= epochs_short:
        raise ValueError(f"epochs_long ({epochs_long}) must exceed epochs_short ({epochs_short})")
    if set(short) != set(long):
        raise ValueError(f"the runs have different roles: {sorted(short)} vs {sorted(long)}")
    out: dict[str, dict[str, float]] = {}
    for role in sorted(short):
        per_epoch = (long[role] - short[role]) / (epochs_long - epochs_short)
        out[role] = {
            "per_epoch": round(per_epoch, 3),
            "once": round(short[role] - epochs_short * per_epoch, 3),
        }
    return out


def gil_check(*, zeros: int = 100) -> dict[str, Any]:
    """Whether SEAL releases the GIL in encryption: the wall time of `zeros` public-key
    encryptions of zero alone, then with a second thread spinning in Python. Released, the two
    run on two cores and the time stays; held, the threads take turns and it about doubles."""
    import threading

    from crypto.ckks import CkksKeyHolder, CkksPublic

    params = choose_params(precision_bits=12, magnitude=2.0**20, terms=5).params
    pub = CkksPublic(context_bytes=CkksKeyHolder(params=params).public_context_bytes())
    codec, encryptor = pub._codec, pub._encryptor

    def timed() -> float:
        started = time.perf_counter()
        for _ in range(zeros):
            codec.zero(encryptor)
        return time.perf_counter() - started

    timed()  # warm up
    alone = timed()
    stop = threading.Event()
    spins = [0]

    def spin() -> None:
        while not stop.is_set():
            spins[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        with_spinner = timed()
    finally:
        stop.set()
        thread.join()
    return {
        "zeros": zeros,
        "seconds_alone": round(alone, 4),
        "seconds_with_a_spinning_python_thread": round(with_spinner, 4),
        "slowdown": round(with_spinner / alone, 2),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
    }


def chosen(secure: dict[str, Any], parties: int) -> dict[str, Any]:
    """The CKKS parameters a run with these [secure] keys sizes or fixes (as
    securevfl.secure_sum)."""
    if "ckks.poly_modulus_degree" in secure:
        params = CkksParams(
            secure["ckks.poly_modulus_degree"],
            tuple(secure["ckks.coeff_mod_bit_sizes"]),
            secure["ckks.scale_bits"],
        )
        sizing = describe_params(params, terms=parties + 1)
        return {**sizing.as_dict(), "security_bits_by_table": security_level(params)}
    magnitude = secure.get("ckks.magnitude", 2.0**20)
    sizing = choose_params(precision_bits=12, magnitude=magnitude, terms=parties + 1)
    return {**sizing.as_dict(), "security_bits_by_table": security_level(sizing.params)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=F.CREDIT)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ckks_overhead.json")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--magnitude", type=float, default=1024.0)
    ap.add_argument("--ablation", action="store_true", help="add ckks-raw-nodelay, ckks-fresh")
    ap.add_argument("--variants", default="", help="comma-separated subset (plain always runs)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the in-process breakdown")
    ap.add_argument(
        "--split-epochs",
        action="store_true",
        help="also run each variant for --epochs + 2 and split each role's CPU into per-epoch "
        "and one-off seconds",
    )
    args = ap.parse_args()
    ds = F.credit(args.data, parties=4)
    breakdown = {} if args.no_breakdown else per_batch_breakdown(parties=len(ds.parties))
    stages = (
        {}
        if args.no_breakdown
        else {
            f"{z} {chain}": per_batch_stages(parties=len(ds.parties), zeros=z, params=params)
            for chain, params in chains(len(ds.parties)).items()
            for z in ("thread", "fresh")
        }
    )
    for z, st in stages.items():
        print(f"stages per batch, {z}: {st['ms']} (all roles {st['ms_cpu_all_roles']} ms)")
    gil = {} if args.no_breakdown else gil_check()
    if gil:
        print(f"GIL in SEAL's encryption: {gil}", flush=True)
    chosen_variants = variants(args.magnitude, ablation=args.ablation)
    if args.variants:
        wanted = {"plain", *args.variants.split(",")}
        unknown = wanted - set(chosen_variants)
        if unknown:
            raise SystemExit(
                f"unknown variants {sorted(unknown)}; choose from {list(chosen_variants)}"
            )
        chosen_variants = {k: v for k, v in chosen_variants.items() if k in wanted}
    for key, b in breakdown.items():
        print(
            f"{key}: {b['chunk_bytes']} bytes a chunk, crypto on one party's chain "
            f"{b['ms_sum_of_crypto_steps_one_party_chain']} ms, all roles "
            f"{b['ms_cpu_all_roles']} ms CPU a batch",
            flush=True,
        )
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="ckks-overhead-") as tmp:
        prep = F.prepare(ds, Path(tmp))
        for rep in range(args.repeats):
            for label, (aggregation, secure, env) in chosen_variants.items():

                def config(epochs: int, aggregation=aggregation, secure=secure) -> dict:
                    raw = F.config_raw(ds, aggregation=aggregation, epochs=epochs)
                    if secure:
                        raw["secure"] = dict(secure)
                    return raw

                raw = config(args.epochs)
                print(f"{label} (repeat {rep + 1}/{args.repeats}) ...", flush=True)
                r = run_with_env(env, F.run_federation, prep, raw, Path(tmp) / f"r{rep}-{label}")
                r["env"] = env
                if not r.get("ok"):
                    raise SystemExit(f"{label} failed: {r.get('error', r.get('exit_codes'))}")
                r["cpu_seconds_all_roles"] = round(sum(r["cpu_seconds"].values()), 2)
                if aggregation == "ckks":
                    r["ckks_params"] = chosen(secure, len(ds.parties))
                print(
                    f"  epochs {r['epoch_seconds']} s, "
                    f"{r['party_bytes_sent_per_epoch'] / 2**20:.2f} MiB/party/epoch, "
                    f"CPU {r['cpu_seconds_all_roles']} s (all roles), load {r['load_before']}",
                    flush=True,
                )
                runs.setdefault(label, []).append(r)
                if args.split_epochs:
                    raw = config(args.epochs + 2)
                    print(f"{label} (repeat {rep + 1}, {args.epochs + 2} epochs) ...", flush=True)
                    longer = run_with_env(
                        env, F.run_federation, prep, raw, Path(tmp) / f"r{rep}-{label}-long"
                    )
                    if not longer.get("ok"):
                        raise SystemExit(f"{label} failed: {longer.get('error')}")
                    r["cpu_split"] = split_cpu(
                        r["cpu_seconds"],
                        longer["cpu_seconds"],
                        epochs_short=args.epochs,
                        epochs_long=args.epochs + 2,
                    )
                    r["longer_run"] = {
                        k: longer[k] for k in ("epoch_seconds", "cpu_seconds", "load_before")
                    }
                    print(f"  CPU split per role: {r['cpu_split']}", flush=True)
    summary: dict[str, Any] = {}
    for label, rs in runs.items():
        epochs = [e for r in rs for e in r["epoch_seconds"]]
        summary[label] = {
            "median_epoch_seconds": statistics.median(epochs),
            "epochs_pooled": len(epochs),
            "party_bytes_sent_per_epoch": statistics.median(
                r["party_bytes_sent_per_epoch"] for r in rs
            ),
            "cpu_seconds_all_roles": statistics.median(r["cpu_seconds_all_roles"] for r in rs),
            "test": rs[0]["test"],
        }
        if all("cpu_split" in r for r in rs):
            roles = sorted(rs[0]["cpu_split"])
            summary[label]["cpu_split_median"] = {
                role: {
                    part: statistics.median(r["cpu_split"][role][part] for r in rs)
                    for part in ("per_epoch", "once")
                }
                for role in roles
            }
    base = summary["plain"]
    for label, s in summary.items():
        s["epoch_ratio"] = s["median_epoch_seconds"] / base["median_epoch_seconds"]
        # each repeat's median epoch against the plain run of the same repeat
        s["epoch_ratio_per_repeat"] = [
            round(statistics.median(r["epoch_seconds"]) / statistics.median(p["epoch_seconds"]), 3)
            for r, p in zip(runs[label], runs["plain"], strict=True)
        ]
        s["bytes_ratio"] = s["party_bytes_sent_per_epoch"] / base["party_bytes_sent_per_epoch"]
        s["extra_cpu_seconds_per_epoch"] = (
            s["cpu_seconds_all_roles"] - base["cpu_seconds_all_roles"]
        ) / args.epochs
        if "cpu_split_median" in s and "cpu_split_median" in base:
            # per-epoch CPU only (one-off costs apart), all roles, against plain
            s["extra_cpu_seconds_per_epoch_split"] = round(
                sum(v["per_epoch"] for v in s["cpu_split_median"].values())
                - sum(v["per_epoch"] for v in base["cpu_split_median"].values()),
                3,
            )
            s["extra_cpu_seconds_once_split"] = round(
                sum(v["once"] for v in s["cpu_split_median"].values())
                - sum(v["once"] for v in base["cpu_split_median"].values()),
                3,
            )
    result = {
        "benchmark": "split-NN Credit 4x5 columns, batch 256, width 16; plain vs ckks",
        "command": "python " + " ".join(["bench/ckks_overhead.py", *sys.argv[1:]]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_count": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
        "epochs": args.epochs,
        "repeats": args.repeats,
        "floors": {"epoch_ratio": 1.5, "bytes_ratio": 10.0},
        "per_batch_ms": breakdown,
        "per_batch_stages": stages,
        "gil_check": gil,
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for label, s in summary.items():
        print(
            f"{label:>16}: epoch {s['median_epoch_seconds']:.2f} s ({s['epoch_ratio']:.2f}x), "
            f"{s['party_bytes_sent_per_epoch'] / 2**20:.2f} MiB/party/epoch "
            f"({s['bytes_ratio']:.2f}x), +{s['extra_cpu_seconds_per_epoch']:.2f} CPU s/epoch, "
            f"per repeat {s['epoch_ratio_per_repeat']}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
