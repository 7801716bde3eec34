"""The benchmark report (`securevfl bench`, `bench/report.py`, `bench/fedbench.py`) on tiny
sizes: the centralised reference trains the very model the federation trains, the summaries
compute the ratios the issue's floors are judged on, the report renders its tables and plots
from raw runs (also when cut short by its time budget), and the CLI reaches it or says why not.
Timings are never asserted; only what is computed from them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import fedbench as F  # noqa: E402
import report as R  # noqa: E402

from securevfl.bench_cmd import BenchUnavailable, run_bench  # noqa: E402
from securevfl.cli import main as cli_main  # noqa: E402


def _tiny(tmp_path: Path, *, rows: int = 240, parties: int = 2) -> tuple[F.Dataset, Path, dict]:
    ds = F.synthetic(tmp_path / "tables", rows=rows, parties=parties, cols=2)
    raw = F.config_raw(ds, aggregation="plain", epochs=2, batch_size=64)
    return ds, F.write_toml(raw, tmp_path / "cfg.toml"), raw


def test_synthetic_table_is_deterministic_and_learnable(tmp_path: Path) -> None:
    ds = F.synthetic(tmp_path / "a", rows=500, parties=3, cols=2)
    again = F.synthetic(tmp_path / "b", rows=500, parties=3, cols=2)
    assert ds.path.read_text() == again.path.read_text()
    header = ds.path.read_text().splitlines()[0].split(",")
    assert header[0] == "ID" and header[-1] == "Y" and len(header) == 2 + 3 * 2
    assert ds.parties == {f"p{k}": [f"p{k}x1", f"p{k}x2"] for k in (1, 2, 3)}
    labels = [line.rsplit(",", 1)[1] for line in ds.path.read_text().splitlines()[1:]]
    assert 0.1 < labels.count("1") / len(labels) < 0.9  # both classes present


def test_credit_split_matches_laser_vfl() -> None:
    ds = F.credit(parties=4)
    assert [len(c) for c in ds.parties.values()] == [5, 5, 5, 5]
    assert ds.parties["p1"][0] == "X1" and ds.parties["p4"][-1] == "X20"


def test_centralised_reference_trains_the_federated_model(tmp_path: Path) -> None:
    """The federated/centralised epoch ratio only means something if both train one model:
    same rows, batches, seeds and updates, so the same test metrics."""
    from securevfl.config import load_config
    from securevfl.data.table import role_data_path
    from securevfl.inproc import run_federation

    _, cfg_path, _ = _tiny(tmp_path)
    cfg = load_config(cfg_path)
    code, metrics = run_federation(cfg, out=tmp_path / "fed", config_path=cfg_path)
    assert code == 0 and metrics is not None
    files = {r: role_data_path(tmp_path / "fed", r) for r in cfg.role_names if r != "aggregator"}
    central = F.centralised(cfg_path, files)
    assert len(central["epoch_seconds"]) == len(central["epoch_cpu_seconds"]) == 2
    assert all(c > 0 for c in central["epoch_cpu_seconds"])
    for key in ("accuracy", "roc_auc", "f1"):
        assert central["test"][key] == pytest.approx(metrics["test"][key], abs=1e-5)


def _run(mode: str, rtt: float | None, epoch_s: float, *, repeat: int = 0) -> dict[str, Any]:
    """A run record as `fedbench.run_federation` returns it (4 parties, Credit-sized)."""
    sent = {"plain": 1_700_000, "mask": 3_400_000, "ckks": 30_000_000}[mode]
    roles = ["aggregator", "active", "p1", "p2", "p3", "p4"]
    return {
        "aggregation": mode,
        "parties": 4,
        "batch_size": 256,
        "epochs": 2,
        "rows": 30000,
        "dataset": "credit-4p",
        "rtt_ms": rtt,
        "ok": True,
        "epoch_seconds": [epoch_s, epoch_s],
        "median_epoch_seconds": epoch_s,
        "n_train": 25600,  # 100 batches of 256
        "bytes_sent": {r: 2 * sent for r in roles},
        "bytes_received": {r: 2 * sent for r in roles},
        "party_bytes_sent_per_epoch": sent,
        "total_bytes_sent": 12 * sent,
        "peak_rss_mib": {r: 300.0 for r in roles},
        "cpu_seconds": {r: 1.0 for r in roles},
        "test": {"accuracy": 0.8, "roc_auc": 0.77},
        "load_before": [2.0, 2.0, 2.0],
        "load_after": [2.0, 2.0, 2.0],
        "repeat": repeat,
        "rounds": 2 * 100 * 2 + 4,  # two calls per batch, and set-up and test
        "proxy": None if rtt is None else {"rtt_ms": rtt, "mean_lateness_ms": 1.5},
    }


def test_credit_summary_gives_the_overhead_and_wan_ratios() -> None:
    runs = [
        _run("plain", None, 1.0),
        _run("mask", None, 1.2),
        _run("ckks", None, 3.0),
        _run("mask", 10.0, 5.2),  # 4 s over 100 batches: 40 ms = 4 RTT per batch
        _run("mask", 50.0, 21.2),
        _run("mask", 0.0, 1.3),  # the proxy alone, no added delay
    ]
    s = R.summarise_credit(runs, mbit=100.0)
    assert s["overhead"]["mask"]["epoch_ratio"] == pytest.approx(1.2)
    assert s["overhead"]["ckks"]["bytes_ratio"] == pytest.approx(30 / 1.7)
    w10, w50, w0 = s["wan"]
    assert (w10["rtt_ms"], w50["rtt_ms"], w0["rtt_ms"]) == (10.0, 50.0, 0.0)
    assert w10["ratio"] == pytest.approx(5.2 / 1.2)
    assert w10["ratio_to_proxy_0ms"] == pytest.approx(5.2 / 1.3)
    assert "ratio_to_proxy_0ms" not in w0
    assert w10["batches_per_epoch"] == 100
    assert w10["added_ms_per_batch"] == pytest.approx(40.0)
    assert w10["added_rtts_per_batch"] == pytest.approx(4.0)
    assert w10["calls_per_batch"] == pytest.approx(2.02)
    assert w10["proxy_mean_lateness_ms"] == pytest.approx(1.5)
    # critical path per batch: a party's and the active party's bytes both ways, 200 batches
    assert w10["critical_bytes_per_batch"] == pytest.approx(4 * 2 * 3_400_000 / 200)
    assert w10["serialisation_ms_per_batch"] == pytest.approx(136_000 * 8 / 1e8 * 1000)
    assert w10["model_added_ms_per_batch"] == pytest.approx(40.0 + 10.88)


def test_pipelined_points_are_judged_against_the_unpipelined_loopback_epoch() -> None:
    """[network] pipeline_depth runs stay out of the overhead and WAN tables (those are the
    unpipelined protocol) and get their own rows: against the depth-0 loopback epoch, their own
    depth on loopback and depth 0 on the same network, with the ROC-AUC staleness costs."""
    piped = [
        {**_run("mask", None, 0.9), "pipeline_depth": 8, "test": {"roc_auc": 0.75}},
        {**_run("mask", 10.0, 1.5), "pipeline_depth": 8, "test": {"roc_auc": 0.75}},
    ]
    runs = [_run("plain", None, 1.0), _run("mask", None, 1.2), _run("mask", 10.0, 6.0), *piped]
    s = R.summarise_credit(runs, mbit=100.0)
    assert s["overhead"]["mask"]["epoch_ratio"] == pytest.approx(1.2)  # depth 0 only
    assert [w["rtt_ms"] for w in s["wan"]] == [10.0] and s["wan"][0]["ratio"] == pytest.approx(5)
    loop, ten = s["pipelined"]
    assert (loop["rtt_ms"], loop["depth"], ten["rtt_ms"]) == (None, 8, 10.0)
    assert loop["ratio_to_loopback_depth0"] == pytest.approx(0.9 / 1.2)
    assert loop["ratio_to_loopback_same_depth"] is None
    assert ten["ratio_to_loopback_depth0"] == pytest.approx(1.5 / 1.2)
    assert ten["ratio_to_loopback_same_depth"] == pytest.approx(1.5 / 0.9)
    assert ten["ratio_to_depth0_same_network"] == pytest.approx(1.5 / 6.0)
    assert (ten["roc_auc"], ten["roc_auc_depth0"]) == (0.75, 0.77)
    md = "\n".join(R._render_pipelined(s["pipelined"]))
    # the worse of the two ratios decides: 1.67x its own depth on loopback
    assert (
        "pipelined at depth 8, aggregator in its own process: does not hold** (1.25× the "
        "unpipelined" in md
    )
    assert "test ROC-AUC 0.750 against 0.770" in md


def test_runs_with_the_aggregator_in_the_active_party_are_their_own_pipelined_rows() -> None:
    """[network] aggregator_in_active runs are judged against the same configuration on
    loopback, never pooled with the separate aggregator's runs of the same depth, and stay
    out of the overhead and WAN tables even unpipelined."""
    colocated = {"aggregator_in_active": True, "test": {"roc_auc": 0.75}}
    runs = [
        _run("plain", None, 1.0),
        _run("mask", None, 1.2),
        _run("mask", 10.0, 6.0),
        {**_run("mask", None, 0.9), "pipeline_depth": 8},
        {**_run("mask", 10.0, 1.5), "pipeline_depth": 8},
        {**_run("mask", None, 1.0), "pipeline_depth": 8, **colocated},
        {**_run("mask", 10.0, 1.1), "pipeline_depth": 8, **colocated},
        {**_run("mask", None, 1.1), **colocated},
    ]
    s = R.summarise_credit(runs, mbit=100.0)
    assert s["overhead"]["mask"]["epoch_ratio"] == pytest.approx(1.2)
    assert [w["rtt_ms"] for w in s["wan"]] == [10.0]
    rows = {(p["rtt_ms"], p["depth"], p["aggregator_in_active"]): p for p in s["pipelined"]}
    assert set(rows) == {
        (None, 8, False),
        (10.0, 8, False),
        (None, 8, True),
        (10.0, 8, True),
        (None, 0, True),
    }
    ten = rows[10.0, 8, True]
    assert ten["ratio_to_loopback_same_depth"] == pytest.approx(1.1 / 1.0)
    assert ten["ratio_to_loopback_depth0"] == pytest.approx(1.1 / 1.2)
    assert rows[10.0, 8, False]["ratio_to_loopback_same_depth"] == pytest.approx(1.5 / 0.9)
    md = "\n".join(R._render_pipelined(s["pipelined"]))
    assert (
        "pipelined at depth 8, aggregator in the active party's process: holds** (0.92× the "
        "unpipelined loopback epoch, 1.10× the same configuration on loopback)" in md
    )
    assert "pipelined at depth 8, aggregator in its own process: does not hold**" in md
    # a 10 ms point whose configuration did not run on loopback (the quick plan) says so
    alone = [r for r in s["pipelined"] if (r["rtt_ms"], r["aggregator_in_active"]) == (10.0, True)]
    alone[0]["ratio_to_loopback_same_depth"] = None
    md = "\n".join(R._render_pipelined(alone))
    assert (
        "(0.92× the unpipelined loopback epoch, the same configuration not run on loopback)" in md
    )


def test_federated_vs_centralised_floor_is_judged_on_both_bounds() -> None:
    def row(parties: int, wall_ratio: float, cpu_ratio: float | None) -> dict[str, Any]:
        return {"parties": parties, "ratio": wall_ratio, "ratio_to_cpu": cpu_ratio}

    assert R.fed_verdict(row(4, 1.0, 2.9)) == "holds"  # even the high estimate is within 3x
    assert R.fed_verdict(row(4, 3.5, 9.0)) == "fails"  # even the low estimate is over
    assert R.fed_verdict(row(4, 1.8, 6.4)) == "undecided under this load"
    assert R.fed_verdict(row(16, 9.0, 20.0)) == "(reported)"  # the floor is for 2..8
    assert R.fed_verdict(row(4, 1.0, None)) == "not judged (no CPU time)"
    # the same floor for the federation with the aggregator in the active party's process
    both = {**row(4, 3.5, 9.0), "colocated_ratio": 1.0, "colocated_ratio_to_cpu": 2.9}
    assert (R.fed_verdict(both), R.fed_verdict(both, arm="colocated_")) == ("fails", "holds")
    assert R.fed_verdict(row(4, 1.0, 2.9), arm="colocated_") == "-"  # not measured


def test_report_renders_tables_plots_and_the_floors(tmp_path: Path) -> None:
    runs = [
        _run("plain", None, 1.0),
        _run("mask", None, 1.05),
        _run("ckks", None, 3.0),
        _run("plain", 10.0, 5.0),
        _run("mask", 10.0, 1.4),  # within 1.5x of loopback
        # pipelined, the aggregator in the active party's process: plotted against itself
        {**_run("mask", None, 1.0), "pipeline_depth": 8, "aggregator_in_active": True},
        {**_run("mask", 10.0, 1.1), "pipeline_depth": 8, "aggregator_in_active": True},
    ]
    scaling = {
        "parties": [
            {**_run(m, None, 1.0 + k / 10), "parties": k, "rows": 10_000}
            for k in (2, 4)
            for m in ("plain", "mask")
        ],
        "rows": [],
        "batch": [],
        "centralised": [
            {
                "ok": True,
                "parties": k,
                "rows": 10_000,
                "batch_size": 256,
                "median_epoch_seconds": 0.25,
                "epoch_seconds": [0.25],
                "peak_rss_mib": 200.0,
                "test": {"accuracy": 0.8, "roc_auc": 0.77},
            }
            for k in (2, 4)
        ],
        "skipped": ["quick"],
        "not_run": ["ckks k16"],
    }
    results = {
        "command": "securevfl bench --quick",
        "quick": True,
        "started": "now",
        "wall_seconds": 60,
        "machine": {"cpu_model": "test CPU", "cpu_count": 2, "loadavg": [1.0, 1.0, 1.0]},
        "versions": {"python": "3"},
        # raw runs only, as report.json holds them while a report is under way
        "suites": {
            "credit": {"runs": runs, "mbit": 100.0},
            "scaling": scaling,
            "gpu": {"available": False, "note": "no GPU on this machine"},
        },
    }
    (tmp_path / "report.json").write_text(json.dumps(results))
    assert cli_main(["bench", "--render", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "Command: `securevfl bench --quick`" in md and "test CPU" in md
    assert "| mask | 1.05 |" in md  # overhead table: mask epoch 1.05x plain
    assert "mask epoch at 10 ms RTT ≤ 1.5× loopback: holds** (1.33×)" in md
    assert "| 2 | 10 000 | 0.25 | 1.20 | 4.80 |" in md  # federated plain / centralised
    assert "Not run, the time budget" in md and "ckks k16" in md
    assert "no GPU on this machine: no GPU numbers" in md
    for png in ("overhead.png", "wan.png", "scaling_parties.png"):
        assert (tmp_path / png).stat().st_size > 1000 and f"]({png})" in md


def test_budget_spent_starts_nothing_and_says_so(tmp_path: Path) -> None:
    data = tmp_path / "credit_default.csv"  # never read: the budget is spent before any run
    data.write_text("ID,X1,Y\n1,0.5,0\n")
    bench = R.Bench(
        out=tmp_path / "out",
        work=tmp_path / "work",
        quick=True,
        data=data,
        suites=["credit", "scaling", "crypto"],
        command="test",
        budget_minutes=0.0,
    )
    results = bench.run()
    assert results["suites"]["credit"]["not_run"] == ["every credit run (time budget)"]
    scaling = results["suites"]["scaling"]
    assert scaling["parties"] == [] and scaling["centralised"] == []
    assert "2 parties (all modes)" in scaling["not_run"]
    assert results["suites"]["crypto"]["masked_sum"]["not_run"]
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").rglob("*.csv"))
    md = R.render(results, tmp_path / "out").read_text()
    assert md.count("Not run, the time budget") >= 3


def test_bench_without_the_checkout_says_where_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(BenchUnavailable, match="source checkout.*does not ship bench/"):
        run_bench(["--quick"], report=tmp_path / "bench" / "report.py")


def test_cli_bench_passes_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr("securevfl.bench_cmd.run_bench", lambda argv: seen.append(argv) or 0)
    assert cli_main(["bench", "--quick", "--out", "o", "--only", "credit"]) == 0
    assert cli_main(["bench", "--budget-minutes", "30", "--render"]) == 0
    assert seen == [
        ["--quick", "--out", "o", "--only", "credit"],
        ["--budget-minutes", "30.0", "--render"],
    ]


@pytest.mark.slow
def test_real_federation_behind_the_wan_proxy(tmp_path: Path) -> None:
    """One real multi-process run through the proxy: every role exits 0 and the bytes cross
    the proxy (one to three minutes on a loaded 2-core machine, hence slow)."""
    ds, _, raw = _tiny(tmp_path, rows=400)
    prep = F.prepare(ds, tmp_path / "work")
    r = F.run_federation(prep, raw, tmp_path / "run", rtt_ms=5.0, mbit=100.0, timeout=300)
    assert r["ok"], r.get("error")
    assert len(r["epoch_seconds"]) == 2 and r["proxy"]["connections"] >= 3
    assert r["proxy"]["bytes_up"] > 0 and r["proxy"]["bytes_down"] > 0


def test_the_gpu_section_shows_time_memory_and_the_overlap_ratio() -> None:
    def run(epochs: list[float], auc: float, kernel: float | None, spans: dict) -> dict:
        roles = (
            {}
            if kernel is None
            else {
                "active": {
                    "kernel_ms": kernel,
                    "kernels": 10,
                    "span_ms_by_op": {},
                    "peak_allocated_mib": 3.0,
                },
                "p1": {
                    "kernel_ms": kernel,
                    "kernels": 20,
                    "span_ms_by_op": spans,
                    "peak_allocated_mib": 5.0,
                },
            }
        )
        return {
            "epoch_seconds": epochs,
            "epochs": len(epochs),
            "test": {"roc_auc": auc},
            "device_time": roles,
            "nvidia_smi_peak_mib": {"p1": 600.0} if roles else {},
            "arm": {"hidden": [64], "batch_size": 256},
        }

    g = {
        "available": True,
        "device_name": "Test GPU",
        "epochs": 3,
        "runs": {
            "cpu-plain": run([5.0, 1.0, 1.0], 0.75, None, {}),
            "cuda-plain": run([9.0, 2.0, 2.0], 0.75, 30.0, {"forward": 12.0}),
            "cuda-mask": run([9.0, 2.2, 2.2], 0.75, 30.0, {"forward": 12.0}),
            "cuda-mask-overlap": run([9.0, 2.75, 2.75], 0.75, 30.0, {"forward": 12.0}),
        },
        "metric_abs_diff": {"cuda-plain vs cpu-plain": {"roc_auc": 1e-7}},
    }
    md = "\n".join(R._render_gpu(g))
    assert "Test GPU" in md
    assert "| cuda-plain | 64 | 256 | 2.00 | 0.75 | 20.00 | 5.00 | 600.00 |" in md  # 60 ms / 3
    assert "| cuda-mask | p1 | 30.00 | 20 | forward 12 | 5.00 | 600.00 |" in md
    assert "cuda-mask-overlap ÷ cuda-mask" in md and "1.25×" in md  # 2.75 / 2.2
    assert "mask ÷ plain on cuda: 1.10×" in md
    assert "Largest test-metric difference cuda-plain vs cpu-plain: 1.00e-07" in md


def test_the_readme_block_is_generated_from_the_report_and_replaced_in_place(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench" / "results" / "r1"
    out.mkdir(parents=True)
    results = {
        "command": "python bench/report.py --only gpu",
        "started": "2026-11-24T14:17",
        "machine": {"cpu_model": "test CPU", "cpu_count": 16, "loadavg": [0.2, 0.1, 0.0]},
        "suites": {"gpu": {"available": False, "note": "no GPU here"}},
    }
    (out / "report.json").write_text(json.dumps(results))
    readme = tmp_path / "README.md"
    mark = "<!-- bench/report.py --readme: bench/results/r1 {} -->"
    readme.write_text(
        f"# Title\n\nbefore\n{mark.format('begin')}\nold text\n{mark.format('end')}\nafter\n"
    )
    assert R.main(["--render", "--out", str(out), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old text" not in text and text.startswith("# Title\n\nbefore\n")
    assert text.endswith(f"{mark.format('end')}\nafter\n")
    assert "#### GPU" in text  # "## GPU" two levels down
    assert "no GPU here: no GPU numbers" in text
    assert "`python bench/report.py --render --out bench/results/r1 --readme" in text
    assert "](bench/results/r1/report.md)" in text and "test CPU, 16 cores" in text
    assert R.main(["--render", "--out", str(out), "--readme", str(readme)]) == 0
    assert readme.read_text() == text  # idempotent
    block = R.readme_block(results, out, readme)
    assert block in text
    readme.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="no block for bench/results/r1: put the two lines"):
        R.main(["--render", "--out", str(out), "--readme", str(readme)])


def test_readme_block_links_plots_from_the_readme_folder(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "results" / "r2"
    out.mkdir(parents=True)
    lines = R.readme_block({"suites": {}}, out, tmp_path / "README.md")
    assert lines.startswith("_Generated from `results/r2/report.json`")
    fake = "![x](plot.png) and ![y](other/keep.png)"
    monkeypatch.setattr(R, "_render_gpu", lambda g: ["## GPU", fake])
    got = R.readme_block({"suites": {}}, out, tmp_path / "README.md")
    assert "#### GPU" in got
    assert "![x](results/r2/plot.png) and ![y](other/keep.png)" in got


def test_benchmark_roles_import_the_code_of_the_tree_they_are_given(tmp_path: Path) -> None:
    """`run_federation(pythonpath=TREE)` compares an older copy of the code: its roles (started
    with `python -m securevfl`, which puts the working directory first on the import path) must
    import that copy even when the benchmark runs from this checkout, and this checkout's code
    when no tree is given."""
    import subprocess

    old = tmp_path / "old"
    (old / "securevfl").mkdir(parents=True)
    (old / "securevfl" / "__init__.py").write_text("")
    (old / "securevfl" / "__main__.py").write_text("import securevfl; print(securevfl.__file__)")
    repo = Path(__file__).resolve().parents[2]
    env, cwd = F.role_environment(str(old))
    assert env["OMP_NUM_THREADS"] == "1"
    done = subprocess.run(
        [sys.executable, "-m", "securevfl"],
        env=env, cwd=cwd, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert Path(done.stdout.strip()).resolve() == old / "securevfl" / "__init__.py"
    env, cwd = F.role_environment(None)
    probe = "import securevfl, sys; sys.stdout.write(securevfl.__file__)"
    here = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=cwd, capture_output=True, text=True, check=True
    )
    assert Path(here.stdout).resolve().is_relative_to(repo)


def test_a_benchmark_arm_names_its_tree_config_overrides_and_role_environment() -> None:
    import fed_central as FC

    name, tree, overrides = FC.parse_arm(
        "overlap=.:run.aggregation=mask,network.pipeline_depth=2,network.heartbeat_interval=5.0,"
        "network.aggregator_in_active=true,SECUREVFL_OVERLAP_SUMS=1"
    )
    assert (name, tree) == ("overlap", None)
    assert FC.environment_of(overrides) == {"SECUREVFL_OVERLAP_SUMS": "1"}
    raw = FC.with_overrides({"run": {"aggregation": "plain"}}, overrides)
    network = {"pipeline_depth": 2, "heartbeat_interval": 5.0, "aggregator_in_active": True}
    assert raw == {"run": {"aggregation": "mask"}, "network": network}
    env, _ = F.role_environment(None, FC.environment_of(overrides))
    assert env["SECUREVFL_OVERLAP_SUMS"] == "1" and env["OMP_NUM_THREADS"] == "1"
    with pytest.raises(SystemExit, match="ENV_VAR=value"):
        FC.parse_arm("bad=.:aggregation")


def test_the_bare_federation_trains_the_centralised_model_over_real_processes(
    tmp_path: Path,
) -> None:
    """`bench/bare_federation.py`, the cost floor of the process layout, is only a yardstick if
    it trains the very model of the centralised reference (same test metrics) in separate role
    processes, and reports each role's CPU per batch."""
    import bare_federation as B

    ds, _, raw = _tiny(tmp_path)
    prep = F.prepare(ds, tmp_path / "work")
    bare = B.run_bare(prep, raw, tmp_path / "bare", timeout=120)
    assert bare["ok"], bare.get("error")
    assert len(bare["epoch_seconds"]) == 2 and bare["batches"] == 2 * 3  # 192 train rows / 64
    assert set(bare["cpu_us_per_batch"]) == {"aggregator", "active", "p1", "p2"}
    assert all(v > 0 for v in bare["cpu_us_per_batch"].values())
    central = F.centralised(F.write_toml(raw, tmp_path / "central.toml"), prep.files)
    for key in ("accuracy", "roc_auc", "f1"):
        assert bare["test"][key] == pytest.approx(central["test"][key], abs=1e-5)


def test_a_bare_role_that_fails_ends_the_run_at_once_with_its_error(tmp_path: Path) -> None:
    """A party that cannot start (its table is missing) is reported by name with its own error
    as soon as it exits; the others, waiting for it, are not left running."""
    import dataclasses
    import time

    import bare_federation as B

    ds, _, raw = _tiny(tmp_path)
    prep = F.prepare(ds, tmp_path / "work")
    broken = dataclasses.replace(prep, files={**prep.files, "p1": tmp_path / "nowhere.csv"})
    started = time.monotonic()
    bare = B.run_bare(broken, raw, tmp_path / "bare", timeout=100)
    assert not bare["ok"] and bare["error"].startswith("p1 exited"), bare
    assert "nowhere.csv" in bare["error"]
    assert time.monotonic() - started < 60  # not the timeout


def test_the_bare_cpu_per_batch_leaves_out_the_first_epoch() -> None:
    import bare_federation as B

    marks = [0.0, 0.5, 0.6, 1.0, 1.001, 1.002, 1.003, 1.004]  # 2 epochs of 4 calls
    assert B.steady_cpu_us(marks, 2) == 1000.0  # 1.001 -> 1.004 s: 3 calls, not the warm-up
    assert B.steady_cpu_us(marks[:5], 1) == round(1e6 * 1.001 / 4, 1)


def test_the_bare_masks_cancel_in_the_sum_and_hide_each_value() -> None:
    """The bare masked arm pays for real keystreams: each party's masked words alone are not its
    encoding, the ring sum over the parties decodes to the sum of the values."""
    import bare_federation as B
    import numpy as np

    rng = np.random.default_rng(0)
    parties = ["p1", "p2", "p3"]
    values = {p: rng.standard_normal((8, 4)).astype(np.float32) for p in parties}
    masked = {p: B.PairMasks(p, parties).mask(values[p], 5) for p in parties}
    for p in parties:
        encoded = np.rint(values[p].astype(np.float64) * B.FRACTION).astype(np.int64)
        assert not np.array_equal(masked[p].view(np.int64), encoded)
    total = masked["p1"] + masked["p2"] + masked["p3"]  # uint64: wraps, as the aggregator adds
    decoded = B._received_sum(total.tobytes(), {"aggregation": "mask"}).reshape(8, 4)
    np.testing.assert_allclose(decoded, sum(values.values()), atol=3 * 2.0**-20)
    again = B.PairMasks("p1", parties).mask(values["p1"], 6)  # another call: other masks
    assert not np.array_equal(again, masked["p1"])


def test_every_benchmark_result_names_the_cpu_it_ran_on(monkeypatch, tmp_path) -> None:
    """A VM can move between hosts from one run to the next (this one did: Intel Xeon, then AMD
    EPYC), so every result says which CPU it measured; none where the system does not say."""
    from types import SimpleNamespace

    args = SimpleNamespace(rows=10, epochs=1, repeats=1, batch=4)
    result = F.result_of("x.py", ["--rows", "10"], args, 0.0, table=[])
    assert result["machine"]["cpu_model"] == F.cpu_model()
    assert R.machine().get("cpu_model") == F.cpu_model()
    if Path("/proc/cpuinfo").exists():
        assert F.cpu_model()
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t: x\n")
    real = Path.read_text
    monkeypatch.setattr(
        Path,
        "read_text",
        lambda self, *a, **k: real(cpuinfo if str(self) == "/proc/cpuinfo" else self, *a, **k),
    )
    assert F.cpu_model() == "Test CPU 9000"
    cpuinfo.write_text("processor\t: 0\n")
    assert F.cpu_model() is None


def test_paired_ratios_compare_arms_repeat_by_repeat_with_a_bootstrap_interval() -> None:
    """`fed_central.paired_ratios`: the ratio of each repeat's two median epochs (a repeat's
    slow machine hits both arms), their median, and a seeded 95% bootstrap interval of the
    median that contains it; a failed run or a single repeat gives no comparison."""
    import fed_central as FC

    def run(arm: str, rep: int, epoch: float, ok: bool = True) -> dict:
        return {"arm": arm, "parties": 4, "repeat": rep, "ok": ok, "median_epoch_seconds": epoch}

    plain = [0.50, 0.60, 0.40, 0.55, 0.52]
    mask = [0.55, 0.69, 0.44, 0.66, 0.572]  # 1.10, 1.15, 1.10, 1.20, 1.10
    runs = [run("plain", i, p) for i, p in enumerate(plain)]
    runs += [run("mask", i, m) for i, m in enumerate(mask)]
    runs.append(run("mask", 5, 9.0))  # no plain run in repeat 5: not paired
    got = FC.paired_ratios(runs, arm="mask", reference="plain", parties=4)
    assert got["ratios"] == [1.1, 1.15, 1.1, 1.2, 1.1]
    assert got["median"] == pytest.approx(1.1)
    lo, hi = got["ci95"]
    assert 1.1 - 1e-9 <= lo <= got["median"] <= hi <= 1.2 + 1e-9 and hi > lo
    assert got == FC.paired_ratios(runs, arm="mask", reference="plain", parties=4)  # seeded
    failed = [r if r["repeat"] else {**r, "ok": False} for r in runs]
    assert len(FC.paired_ratios(failed, arm="mask", reference="plain", parties=4)["ratios"]) == 4
    assert FC.paired_ratios(runs[:1] + runs[5:6], arm="mask", reference="plain", parties=4) is None
