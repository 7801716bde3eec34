"""Command line: `securevfl run | aggregator | active | party | keys | split | demo | methods |
audit`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import tomllib
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from securevfl.config import ConfigError, RunConfig, load_config
from securevfl.errors import EXIT_PIPE_CLOSED, SecureVFLError, exit_code_for
from securevfl.roles import protocol as P

EXAMPLES = Path(__file__).parent / "examples"


def _overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """`--set run.aggregation=plain` -> {"run.aggregation": "plain"} (values parsed as TOML)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or "." not in key:
            raise ConfigError("--set", f"expected SECTION.KEY=VALUE, got {pair!r}")
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value  # a bare string
    return out


_FORCE_HELP = "with --resume: continue even if the config differs from the run's (recorded)"


def _role_args(
    p: argparse.ArgumentParser, *, name: bool = False, data: bool = True, resume: bool = True
) -> None:
    p.add_argument("--config", required=True, type=Path, help="the federation's TOML config")
    p.add_argument("--out", type=Path, default=Path("run"), help="this role's run directory")
    p.add_argument("--keys", type=Path, help="keys directory (default: [network] keys)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    if name:
        p.add_argument("--name", required=True, help="this party's name ([parties.NAME])")
    if data:
        p.add_argument(
            "--data", type=Path, help="this role's own CSV (default: RUN_DIR/data/<role>.csv)"
        )
        p.add_argument("--address", help="the aggregator's address (default: [network] aggregator)")
        # the local launcher's: read the address from this file once the binding role wrote it
        p.add_argument("--address-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--force", action="store_true", help=_FORCE_HELP)
    if resume:
        p.add_argument(
            "--score",
            action="store_true",
            help="score the rows of --data with the trained model in --out (no training)",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="securevfl",
        description="Privacy-hardened vertical federated learning (secure sums, CKKS, DP).",
    )
    from securevfl import __version__

    parser.add_argument("--version", action="version", version=f"securevfl {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error, not just one line"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", help="run a whole federation on this machine (one process per role)"
    )
    run.add_argument("config", type=Path)
    run.add_argument("--out", type=Path, required=True, help="run directory")
    run.add_argument("--resume", action="store_true", help="continue the run in --out")
    run.add_argument("--force", action="store_true", help=_FORCE_HELP)
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value, e.g. --set run.aggregation=plain",
    )

    agg = sub.add_parser("aggregator", help="run the aggregator (ZeroMQ hub) on this host")
    _role_args(agg, data=False, resume=False)
    agg.add_argument("--bind", help="address to bind (default: [network] bind or aggregator)")
    active = sub.add_parser("active", help="run the active party (labels) on this host")
    _role_args(active)
    active.add_argument("--predictions", type=Path, help="with --score: where to write them")
    _role_args(sub.add_parser("party", help="run one passive party on this host"), name=True)

    keys = sub.add_parser("keys", help="make CURVE and masking key pairs and the allowlist")
    keys.add_argument("--out", type=Path, required=True)
    keys.add_argument("--config", type=Path, help="take the role names from this config")
    keys.add_argument("--roles", help="comma-separated role names (instead of --config)")
    keys.add_argument("--force", action="store_true", help="replace existing keys")

    split = sub.add_parser("split", help="split the config's table into one CSV per role")
    split.add_argument("--config", required=True, type=Path)
    split.add_argument("--out", required=True, type=Path)

    demo = sub.add_parser("demo", help="secure training on the embedded breast-cancer table")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"))
    demo.add_argument("--aggregation", default="mask", choices=["plain", "mask", "ckks"])

    example = sub.add_parser(
        "example", help="write one of the shipped example configs (list them without a name)"
    )
    example.add_argument("name", nargs="?", help="e.g. credit-laser, breast-cancer, vfem-simulated")
    example.add_argument("--out", type=Path, default=Path("."), help="directory to write it to")
    example.add_argument(
        "--force", action="store_true", help="overwrite a config or table already in --out"
    )

    align = sub.add_parser(
        "align",
        help="private set intersection of each party's ids with the label holder's (PSI)",
        description="Each party learns which of its rows the label holder has, the label holder "
        "which of its rows each party has, and nothing else about the other ids (ECDH-PSI over "
        "CurveZMQ; the active party binds, the parties connect). Without --role, every role "
        "runs on this machine from the config's table, split as `securevfl run` splits it.",
    )
    align.add_argument("--config", required=True, type=Path)
    align.add_argument("--out", required=True, type=Path)
    align.add_argument("--role", help="run one role (the active party binds --bind)")
    align.add_argument("--data", type=Path, help="this role's own table (with --role)")
    align.add_argument("--keys", type=Path, help="keys directory (default: [network] keys)")
    align.add_argument("--bind", default="tcp://127.0.0.1:5560", help="the active party's address")
    align.add_argument("--address-file", type=Path, help=argparse.SUPPRESS)

    predict = sub.add_parser(
        "predict",
        help="score new rows with a trained run (one process per role, only sums cross)",
    )
    predict.add_argument("run_dir", type=Path, help="the trained run's directory")
    predict.add_argument("--data", type=Path, required=True, help="the table of rows to score")
    predict.add_argument(
        "--predictions", type=Path, help="output CSV (default: RUN_DIR/predict/predictions.csv)"
    )

    methods = sub.add_parser(
        "methods",
        help="list the methods, or one method's options and what its operations release",
    )
    methods.add_argument("name", nargs="?", help="a method to describe")

    audit = sub.add_parser(
        "audit",
        help="the privacy spent in a run: epsilon per role and mechanism, from its ledger",
        description="Recompute epsilon(delta) per role and mechanism from RUN_DIR/ledger.jsonl "
        "alone, and list the releases with no formal guarantee.",
    )
    audit.add_argument("run_dir", type=Path, help="the run directory (holds ledger.jsonl)")
    audit.add_argument("--json", action="store_true", help="print the report as JSON")
    audit.add_argument(
        "--accountant",
        choices=["rdp", "prv"],
        help="Opacus accountant (default: the run's [privacy] accountant)",
    )
    audit.add_argument(
        "--delta",
        type=float,
        help="report epsilon at this delta (default: the delta the run recorded)",
    )
    audit.add_argument(
        "--attack",
        action="store_true",
        help="also run label inference on the gradients each passive party "
        "received (needs [privacy] record_received = true and the active "
        "party's labels; binary tasks)",
    )
    audit.add_argument(
        "--labels",
        type=Path,
        help="the active party's CSV with the labels, for --attack "
        "(default: RUN_DIR/data/<active>.csv)",
    )

    bench = sub.add_parser(
        "bench",
        help="the benchmark report: overhead, WAN, scaling, privacy-utility, crypto, GPU "
        "(needs the source checkout's bench/)",
    )
    bench.add_argument("--quick", action="store_true", help="smoke-sized: fewer points, one repeat")
    bench.add_argument("--out", type=Path, help="report directory (default: bench/results/report)")
    bench.add_argument("--only", help="comma-separated suites: credit,scaling,privacy_utility,...")
    bench.add_argument("--data", type=Path, help="the Credit table (credit_default.csv)")
    bench.add_argument("--work", type=Path, help="keep the run directories here (default: temp)")
    bench.add_argument("--render", action="store_true", help="only re-render OUT/report.md")
    bench.add_argument(
        "--budget-minutes", type=float, help="start no new run after this many minutes"
    )

    for command in sub.choices.values():  # `securevfl run ... --debug` as well as before it
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _prepare_threads(args)  # before anything imports NumPy or torch
    debug = getattr(args, "debug", False)
    previous, interrupted = _interrupt_once()
    status = None
    try:
        status = _dispatch(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except ConfigError as exc:
        _say(f"config error: {exc}", debug)
        return exc.exit_code
    except SecureVFLError as exc:  # an ordinary mistake or stop: one line, no traceback
        _say(str(exc), debug)
        return exit_code_for(exc)
    except KeyboardInterrupt as exc:
        if not os.environ.get(P.LAUNCHED_ENV):  # a launched role: its launcher says it once
            _say("interrupted; continue later with --resume", debug)
        return exit_code_for(exc)
    except BrokenPipeError:  # whoever read the output stopped (`securevfl audit RUN | head`)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the exit's flush goes nowhere
        os.close(devnull)
        # finished: its own status stands; cut short by the closed pipe: as a shell reports it
        return EXIT_PIPE_CLOSED if status is None else status
    except OSError as exc:  # a path that cannot be read or written: the user's to fix
        _say(f"{exc}", debug)
        return P.EXIT_USAGE
    except Exception as exc:
        _say(
            f"internal error: {type(exc).__name__}: {exc} (rerun with --debug to see where)", debug
        )
        return exit_code_for(exc)
    finally:
        if previous is not None and not interrupted:
            signal.signal(signal.SIGINT, previous)


# the commands that run one role of a federation (torch, models, sockets loaded): they end
# without the interpreter's finalisation, see `entry`
ROLE_PROCESSES = ("aggregator", "active", "party")


def entry() -> None:
    """The `securevfl` command and `python -m securevfl`: `main`, then the exit. A role process
    exits at once when its work is done: tearing down torch and the rest of the interpreter
    took ~2 s of CPU per role on 2 cores after every run had finished (the launcher, and every
    user, waited for it). Everything a role writes is on disk by then (the ledger and the
    family log are flushed per record, checkpoints renamed into place, the logs flushed per
    line); what Python's own exit does first — the exit hooks, the join of every non-daemon
    thread and the pools' shut-down — still runs, then only the deallocation is skipped."""
    argv = sys.argv[1:]
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in ("active", "party"):  # collector off until its modules are imported
        from securevfl import startup_gc

        startup_gc.begin()
    status = main(argv)
    if command in ROLE_PROCESSES:
        _exit_without_teardown(status)
    raise SystemExit(status)


def _exit_without_teardown(status: int) -> None:
    import atexit
    import logging

    threading._shutdown()  # type: ignore[attr-defined]  # what exit runs first: joins threads
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or None: nothing left to say
            pass
    os._exit(status)


def _interrupt_once() -> tuple[Any, list[int]]:
    """Ctrl-C stops the command once, and a second one (the terminal sends it to every process
    of the group, and `securevfl run` passes it on to its roles as well) cannot break the
    clean-up it started — closing the connections, the checkpoint `--resume` continues from —
    nor the process's exit after it: once interrupted, SIGINT stays ignored. Returns the handler
    it replaced (None where none was replaced: not the main thread, or a caller that set its
    own) and a list that is non-empty once it fired (a caller restores the handler only if
    not)."""
    fired: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        return None, fired
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return None, fired

    def interrupt(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        fired.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    return previous, fired


def _say(line: str, debug: bool) -> None:
    """One line on stderr for the user; with --debug, the traceback before it."""
    if debug:
        traceback.print_exc()
    print(f"securevfl: {line}", file=sys.stderr)


# command -> whether its role processes share this machine (their thread count, see
# securevfl.threads); other commands start no role
ROLE_COMMANDS = {
    "aggregator": False,
    "active": False,
    "party": False,
    "run": True,
    "predict": True,
    "demo": True,
}


def _prepare_threads(args: argparse.Namespace) -> None:
    """Set the role's thread count ([run] threads) in the environment, where BLAS and OpenMP
    read it when NumPy and torch are first imported, and where `run` passes it to its roles."""
    shared = ROLE_COMMANDS.get(args.command)
    if shared is None:
        return
    from securevfl.threads import prepare_threads

    config = getattr(args, "config", None)
    if args.command == "predict":
        config = args.run_dir / "config.toml"
    try:
        overrides = _overrides(getattr(args, "set", []))
    except ConfigError:  # said once the command runs
        overrides = None
    prepare_threads(config, shared=shared, overrides=overrides)
    if args.command in ("aggregator", "active", "party"):
        from securevfl.threads import pin_from_env

        try:
            pin_from_env()  # before any thread starts: the role's threads share the core
        except ValueError as exc:
            print(f"securevfl: {exc}", file=sys.stderr)
            raise SystemExit(P.EXIT_USAGE) from None


def _preflight_run(args: argparse.Namespace) -> None:
    from securevfl.preflight import check_run

    cfg = load_config(args.config, overrides=_overrides(args.set))
    check_run(cfg, out=args.out, resume=args.resume)


def _bench_argv(args: argparse.Namespace) -> list[str]:
    """`securevfl bench`'s options as `bench/report.py` takes them."""
    argv = ["--quick"] if args.quick else []
    for flag in ("out", "only", "data", "work", "budget_minutes"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + (["--render"] if args.render else [])


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        from securevfl.launcher import launch

        _preflight_run(args)  # data, keys, run directory: before any process starts
        _check_privacy(load_config(args.config, overrides=_overrides(args.set)))
        return launch(
            args.config,
            out=args.out,
            resume=args.resume,
            overrides=_overrides(args.set),
            override_args=args.set,
            force=args.force,
        )
    if args.command in ("aggregator", "active", "party"):
        return run_role(args)
    if args.command == "keys":
        return _keys(args)
    if args.command == "split":
        from securevfl.data.table import split_federation

        cfg = load_config(args.config)
        for role, path in split_federation(cfg, args.out).items():
            print(f"{role}: {path}")
        return P.EXIT_OK
    if args.command == "demo":
        from securevfl.demo import run_demo

        return run_demo(out=args.out, aggregation=args.aggregation)
    if args.command == "audit":
        return _audit(args)
    if args.command == "methods":
        return _methods(args)
    if args.command == "align":
        return _align(args)
    if args.command == "example":
        return _example(args)
    if args.command == "bench":
        from securevfl.bench_cmd import run_bench

        return run_bench(_bench_argv(args))
    if args.command == "predict":
        from securevfl.launcher import score_rows

        return score_rows(args.run_dir, data=args.data, predictions=args.predictions)
    raise AssertionError(args.command)


def _check_privacy(cfg: RunConfig) -> None:
    """Fail before any process starts on a privacy setting that needs N to be judged (delta
    >= 1/N, a budget that cannot pay for one step, an unreachable target epsilon). N is read
    from the table as the split will make it; the active party checks again with the exact N."""
    dp = [
        cfg.label_dp,
        cfg.head_dp_sgd,
        cfg.delta,
        cfg.active_max_epsilon,
        *(x for p in cfg.parties for x in (p.embedding_dp, p.dp_sgd, p.max_epsilon)),
    ]
    if all(x is None for x in dp):
        return
    from securevfl.data.table import DataError, read_csv_columns, stratified, train_test_split
    from securevfl.privacy.runtime import check_federation

    try:
        ids, _, labels = read_csv_columns(
            cfg.data_path, id_column=cfg.id_column, columns=[], label=cfg.label
        )
    except DataError as exc:
        raise ConfigError("[data] path", str(exc)) from None
    train, _ = train_test_split(
        ids,
        test_fraction=cfg.test_fraction,
        seed=cfg.seed,
        labels=labels,
        stratify=stratified(cfg),
    )
    check_federation(cfg, n_train=len(train))


def _example(args: argparse.Namespace) -> int:
    """Copy a shipped example config (package data) and say where its data must go."""
    shipped = {p.stem.replace("_", "-"): p for p in sorted(EXAMPLES.glob("*.toml"))}
    if args.name is None:
        for name, path in shipped.items():
            print(f"{name:<16} {_first_sentence(path.read_text())}")
        return P.EXIT_OK
    if args.name not in shipped:
        raise ConfigError(
            "example NAME", f"unknown example {args.name!r}; known: {sorted(shipped)}"
        )
    source = shipped[args.name]
    target = args.out / source.name
    data = args.out / tomllib.loads(source.read_text()).get("data", {}).get("path", "data.csv")
    write_table = _example_table_writer(args.name)
    ours = (target, data) if write_table else (target,)  # never the user's own table
    there = [str(f) for f in ours if f.exists()]
    if there and not args.force:  # a config the user edited, a table of their own
        raise ConfigError(
            "example --out",
            f"{', '.join(there)} already exist(s); choose another --out, or "
            "add --force to overwrite",
        )
    args.out.mkdir(parents=True, exist_ok=True)
    target.write_text(source.read_text())
    if write_table is not None:
        write_table(data)
        print(f"wrote {target} and its table {data}")
    else:
        print(f"wrote {target}; put the table at {data.resolve()} (or edit [data] path),")
    print(f"then: securevfl run {target} --out {args.out / 'run'}")
    return P.EXIT_OK


def _first_sentence(toml_text: str) -> str:
    """The first sentence of a config's leading comment (it may span lines)."""
    lines = []
    for line in toml_text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    text = " ".join(lines)
    sentence = text.split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= 120 else sentence.split(": ")[0]


def _example_table_writer(name: str) -> Any:
    """`write(path)` for an example whose table ships with the package or is simulated
    (breast-cancer: scikit-learn's copy; vfem-simulated: the notes' design); None for one whose
    table the user brings (credit-laser)."""
    if name == "breast-cancer":
        from securevfl.demo import write_breast_cancer_csv

        return write_breast_cancer_csv
    if name == "vfem-simulated":
        from securevfl.data.synthetic_tables import write_vfem_simulated_csv

        return write_vfem_simulated_csv
    return None


def _align(args: argparse.Namespace) -> int:
    """`securevfl align`: one role (--role), or every role on this machine as processes."""
    import subprocess

    cfg = load_config(args.config)
    out = args.out.resolve()
    if args.role is not None:
        from securevfl.align import align_active, align_party

        keys = args.keys or cfg.keys_dir
        if args.data is None:
            raise ConfigError("--data", "give this role's own table")
        logger = P.role_logger(f"align-{args.role}", out)
        if args.role == cfg.active_name:
            summary = align_active(
                cfg, data=args.data, keys_dir=keys, bind=args.bind, out=out, logger=logger
            )
            for party, s in summary["parties"].items():
                print(
                    f"{party}: {s['intersection']} of {summary['active']} ids shared "
                    f"({s['seconds']} s, {s['bytes_sent'] + s['bytes_received']} bytes)"
                )
            return P.EXIT_OK
        if args.role not in cfg.party_names:
            raise ConfigError(
                "--role", f"no role {args.role!r}; the config has {list(cfg.role_names)}"
            )
        address = args.bind
        if args.address_file is not None:
            from securevfl.launcher import await_address

            address = await_address(args.address_file, timeout=cfg.startup_timeout)
        n = align_party(
            cfg,
            name=args.role,
            data=args.data,
            keys_dir=keys,
            address=address,
            out=out,
            logger=logger,
        )
        print(f"{args.role}: {n} rows shared with the label holder")
        return P.EXIT_OK
    from securevfl.data.table import split_federation
    from securevfl.keys import generate_keys
    from securevfl.launcher import LOCAL_ANY, rendezvous

    files = split_federation(cfg, out / "source")
    keys = out / "keys"
    generate_keys(cfg.role_names, keys, overwrite=True)
    base = [
        sys.executable,
        "-m",
        "securevfl",
        "align",
        "--config",
        str(args.config.resolve()),
        "--out",
        str(out),
        "--keys",
        str(keys),
    ]
    # the label holder binds a port the kernel picks and writes it; the parties read it
    endpoint, binder_env, others_env = rendezvous(out, os.environ)
    procs = [
        subprocess.Popen(
            [*base, "--role", r, "--data", str(files[r]), "--bind", LOCAL_ANY]
            if r == cfg.active_name
            else [*base, "--role", r, "--data", str(files[r]), "--address-file", str(endpoint)],
            env=binder_env if r == cfg.active_name else others_env,
        )
        for r in cfg.role_names
    ]
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


def _methods(args: argparse.Namespace) -> int:
    """What the registry holds: every method, or one method's declaration."""
    from securevfl.methods import method_names, method_spec
    from securevfl.methods.options import describe

    if args.name is None:
        for name in method_names():
            spec = method_spec(name)
            print(f"{name:<16} {spec.description}")
        return P.EXIT_OK
    try:
        spec = method_spec(args.name)
    except KeyError as exc:
        raise ConfigError("methods NAME", str(exc.args[0])) from None
    print(f"{spec.name}: {spec.description}")
    print(f"tasks: {', '.join(spec.tasks)}; runs on sums: {'yes' if spec.runs_on_sums else 'no'}")
    print("[method] options:")
    for o in describe(spec.options) or [{"name": "(none)", "type": "", "default": "", "doc": ""}]:
        print(f"  {o['name']} ({o['type']}, default {o['default']!r}): {o['doc']}")
    print("party operations (what each may release):")
    for op in spec.operations:
        print(f"  {op.name}: {op.doc}" + ("  [updates the model]" if op.updates else ""))
        for r in op.releases:
            where = "a secure sum" if r.to == "sum" else "the active party, in the clear"
            print(f"    {r.tensor} -> {where}: {r.why}")
    return P.EXIT_OK


def _audit(args: argparse.Namespace) -> int:
    import json
    import warnings

    from securevfl.privacy.audit import format_report
    from securevfl.privacy.run_audit import AuditError, audit_run

    if args.delta is not None and not 0.0 < args.delta < 1.0:
        raise ConfigError("--delta", f"must be in (0, 1), got {args.delta}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = audit_run(
                args.run_dir,
                accountant=args.accountant,
                delta=args.delta,
                attack=args.attack,
                labels=args.labels,
            )
    except AuditError as exc:
        print(f"securevfl audit: {exc}", file=sys.stderr)
        return P.EXIT_USAGE
    for w in caught:  # e.g. PRV falling back to RDP: say so, once, without a traceback
        print(f"securevfl audit: warning: {w.message}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(format_report(report), end="")
    return P.EXIT_OK


def _keys(args: argparse.Namespace) -> int:
    from securevfl.keys import KeyMaterialError, generate_keys

    if args.config is not None:
        roles = list(load_config(args.config).role_names)
    elif args.roles:
        roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    else:
        raise ConfigError(
            "--config/--roles", "give the config (or the role names) to make keys for"
        )
    try:
        public = generate_keys(roles, args.out, overwrite=args.force)
    except KeyMaterialError as exc:
        print(f"securevfl: {exc}", file=sys.stderr)
        return P.EXIT_USAGE
    print(
        f"wrote {public} (give it to every host) and {args.out / 'secret'}/<role>.json "
        "(give each only to its role's host)"
    )
    return P.EXIT_OK


def run_role(args: argparse.Namespace) -> int:
    """Run one role in this process; map failures to exit statuses with one clear line."""
    cfg = load_config(args.config, overrides=_overrides(args.set))
    role = {"aggregator": "aggregator", "active": cfg.active_name}.get(args.command)
    if args.command == "party":
        if args.name not in cfg.party_names:
            raise ConfigError(
                "--name",
                f"no passive party {args.name!r} in the config; it has {list(cfg.party_names)}",
            )
        role = args.name
    run_dir = args.out.resolve()
    keys_dir = args.keys or cfg.keys_dir
    is_aggregator = args.command == "aggregator"
    bind = (
        (args.bind or cfg.bind_address or _bind_from(cfg.aggregator_address))
        if is_aggregator
        else None
    )
    data = None if is_aggregator else (args.data or (run_dir / "data" / f"{role}.csv"))
    address_file = None if is_aggregator else getattr(args, "address_file", None)
    address = None if is_aggregator or address_file else (args.address or cfg.aggregator_address)
    from securevfl.preflight import check_role

    check_role(  # keys, data, port: one line and exit status 2 before anything starts
        cfg,
        command=args.command,
        role=role,
        keys_dir=keys_dir,
        out=run_dir,
        data=data,
        bind=bind,
        address=address,
        scoring=getattr(args, "score", False),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = P.role_logger(role, run_dir)
    try:
        if not getattr(args, "score", False):
            from securevfl.run_record import role_run_record

            # --resume: the run's recorded config must match (exit 2 unless --force)
            role_run_record(
                cfg,
                run_dir=run_dir,
                role=role,
                data_file=data,
                resume=args.resume,
                force=args.force,
                logger=logger,
                config_path=args.config,
                overrides=_overrides(args.set),
            )
        if is_aggregator and args.resume:
            logger.info(
                "resuming: the aggregator keeps no state between runs (a new session, rounds "
                "start again); the active party's checkpoints decide where training resumes"
            )
        if is_aggregator:  # it sums NumPy arrays: no torch (a second of start-up it would wait)
            from securevfl.roles.aggregator import run_aggregator

            return run_aggregator(cfg, keys_dir=keys_dir, bind=bind, logger=logger)
        device = _device(cfg)
        from securevfl.threads import apply_torch_threads, thread_count

        apply_torch_threads(thread_count(default=cfg.threads or 1))
        if address_file is not None:  # after the slow imports: the binding role has had time
            from securevfl.launcher import await_address

            address = await_address(address_file, timeout=cfg.startup_timeout)
        from securevfl.device_time import device_clock

        clock = device_clock(device, role=role, run_dir=run_dir)  # None on a CPU
        with clock if clock is not None else contextlib.nullcontext():
            return _run_model_role(
                args, cfg, role, run_dir, keys_dir, data, address, logger, device, clock
            )
    except P.RunAborted as exc:
        logger.error("%s", exc, extra=P.FILE_ONLY)
        print(f"securevfl {role}: {exc}", file=sys.stderr)
        return exc.exit_code
    except ConfigError:
        raise
    except Exception as exc:  # one line on stderr; the traceback in the role's log
        logger.error("failed: %s\n%s", exc, traceback.format_exc(), extra=P.FILE_ONLY)
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(
            f"securevfl {role}: failed: {exc} (details in {run_dir / 'logs' / (role + '.log')})",
            file=sys.stderr,
        )
        return exit_code_for(exc)


def _run_model_role(
    args: Any,
    cfg: RunConfig,
    role: str,
    run_dir: Path,
    keys_dir: Path,
    data: Path,
    address: str,
    logger: logging.Logger,
    device: Any,
    clock: Any,
) -> int:
    """The active party or a passive party, once its config, device and threads are set."""
    where = {
        "run_dir": run_dir,
        "keys_dir": keys_dir,
        "data_path": data,
        "address": address,
        "logger": logger,
        "device": device,
    }
    from securevfl import startup_gc

    if args.command == "active":
        from securevfl.roles.active import run_active, run_active_scoring

        startup_gc.end()  # imported: the collector runs again before any data is read
        if args.score:
            predictions = args.predictions or run_dir / "predict" / "predictions.csv"
            return run_active_scoring(cfg, predictions=predictions, **where)
        return run_active(cfg, resume=args.resume, **where)
    from securevfl.roles.party import run_party

    startup_gc.end()
    return run_party(cfg, name=role, scoring=args.score, device_time=clock, **where)


def _bind_from(address: str) -> str:
    """Where the aggregator listens when neither --bind nor [network] bind says: the host and
    port the parties connect to (tcp://HOST:PORT), so it never listens on every interface
    unless told to (``bind = "tcp://*:PORT"``)."""
    return address


def _device(cfg: RunConfig) -> Any:
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[run] device", 'cuda was asked for but no GPU is visible; use "cpu"')
    return torch.device(cfg.device)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
