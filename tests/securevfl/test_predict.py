"""A trained model scores new rows: `securevfl predict RUN_DIR --data FILE` (one process per
role, each reading only its own columns of the new rows, only sums crossing) writes
predictions with the ids as written, equal to in-process scoring (`securevfl.load`)."""

from __future__ import annotations

import csv

import numpy as np
import pytest

import securevfl
from tests.securevfl.conftest import make_config, securevfl_cli, write_toml
from tests.securevfl.test_real_tables import _text_table


def text_raw(method="splitnn", aggregation="plain"):
    return {
        "run": {"method": method, "aggregation": aggregation, "seed": 0},
        "data": {"path": "data.csv", "id": "customer", "label": "outcome", "positive": "churn"},
        "parties": {
            "crm": {"columns": ["job", "city"]},
            "bank": {"columns": ["score", "member", "income"]},
        },
        "train": {"epochs": 3, "batch_size": 64, "lr": 0.01},
        "model": {"hidden": [16], "width": 4},
        "network": {"heartbeat_interval": 0.3, "peer_timeout": 10.0},
    }


@pytest.mark.multiprocess
def test_securevfl_predict_equals_in_process_scoring(tmp_path):
    _text_table(tmp_path / "data.csv", n=300)
    _text_table(tmp_path / "new.csv", n=60, seed=5)  # unseen rows, categories the same
    config = write_toml(text_raw(), tmp_path / "config.toml")
    done = securevfl_cli("run", str(config), "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-2000:]
    done = securevfl_cli("predict", str(tmp_path / "run"), "--data", str(tmp_path / "new.csv"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "scored: accuracy" in done.stdout  # the new file has labels: metrics printed
    with (tmp_path / "run" / "predict" / "predictions.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    ids, outputs = securevfl.load(tmp_path / "run").predict(tmp_path / "new.csv")
    by_id = {r["id"]: float(r["output"]) for r in rows}
    assert sorted(by_id) == sorted(ids.tolist()) and len(ids) == 60
    assert all(i.startswith("cust-") for i in ids)  # the ids as written
    assert np.allclose([by_id[i] for i in ids], outputs.reshape(-1), atol=1e-6, rtol=0)


def test_predict_before_training_says_so_at_once_naming_the_roles(tmp_path):
    """`securevfl predict` on a run that never trained (or lost a role's checkpoints) stops
    before starting any role (exit 2), naming the roles without a checkpoint and the fix."""
    import time

    from securevfl.roles.checkpoint import save_checkpoint

    _text_table(tmp_path / "data.csv", n=60)
    run = tmp_path / "run"
    run.mkdir()
    write_toml(text_raw(), run / "config.toml")
    started = time.monotonic()
    done = securevfl_cli("predict", str(run), "--data", str(tmp_path / "data.csv"), timeout=60)
    assert done.returncode == 2, done.stderr
    assert "holds no trained checkpoint of ['active', 'crm', 'bank']" in done.stderr
    assert "train the model first (securevfl run CONFIG --out" in done.stderr
    assert time.monotonic() - started < 30 and not (run / "pids.json").exists()
    for role in ("active", "crm"):
        save_checkpoint(run, role, 0, {"method": {}})
    done = securevfl_cli("predict", str(run), "--data", str(tmp_path / "data.csv"), timeout=60)
    assert done.returncode == 2 and "checkpoint of ['bank']" in done.stderr, done.stderr


def test_a_laser_model_scores_rows_with_missing_blocks_in_process(tmp_path):
    from securevfl.inproc import run_federation

    _text_table(tmp_path / "data.csv", n=400)
    raw = text_raw(method="laser", aggregation="mask")
    raw["run"]["transport"] = "inproc"
    raw["parties"]["extra"] = {"columns": ["score"]}
    raw["parties"]["bank"]["columns"] = ["member", "income"]
    raw["missing"] = {"train": {"kind": "mcar", "p": 0.2}}
    raw["train"]["epochs"] = 12
    cfg = make_config(raw, tmp_path)
    code, metrics = run_federation(cfg, out=tmp_path / "run")
    assert code == 0
    _text_table(tmp_path / "new.csv", n=80, seed=9)
    lines = (tmp_path / "new.csv").read_text().splitlines()
    blank = [lines[0]] + [
        ",".join(c if j != 3 else "" for j, c in enumerate(line.split(","))) if i % 2 else line
        for i, line in enumerate(lines[1:])
    ]
    (tmp_path / "new.csv").write_text("\n".join(blank) + "\n")  # half the rows lack "extra"
    ids, classes = securevfl.load(tmp_path / "run", config=cfg).predict(tmp_path / "new.csv")
    assert len(ids) == 80 and set(np.unique(classes)) <= {0, 1}
    y = np.array(["churn" in line for line in lines[1:]], dtype=int)
    order = {f"cust-{i:05d}": i for i in range(80)}
    scored = np.mean(classes == y[[order[i] for i in ids]])
    assert scored > 0.65 and scored > metrics["test"]["accuracy"] - 0.1, (scored, metrics["test"])


def test_the_package_says_its_version():
    done = securevfl_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"securevfl {securevfl.__version__}"
