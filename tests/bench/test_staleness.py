"""`bench/staleness.py`: depth d is compared with depth 0 of the same seed and epochs, every
depth trains, and the report (JSON, Markdown, PNG) names the command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import staleness  # noqa: E402


def run(depth: int, epochs: int, seed: int, auc: float) -> dict:
    return {"depth": depth, "epochs": epochs, "seed": seed, "metrics": {"roc_auc": auc}}


def test_each_depth_is_paired_with_depth_zero_of_its_seed_and_epochs() -> None:
    runs = [
        run(0, 2, 0, 0.70),
        run(0, 2, 1, 0.80),
        run(4, 2, 0, 0.65),
        run(4, 2, 1, 0.79),
        run(0, 5, 0, 0.75),
        run(4, 5, 0, 0.76),
    ]
    rows = {(r["depth"], r["epochs"]): r for r in staleness.table(runs)}
    assert rows[(4, 2)]["roc_auc"] == pytest.approx(0.72)
    assert rows[(4, 2)]["minus_depth0"] == pytest.approx(-0.03)  # mean of -0.05 and -0.01
    assert (rows[(4, 2)]["paired_min"], rows[(4, 2)]["paired_max"]) == pytest.approx((-0.05, -0.01))
    assert rows[(4, 5)]["minus_depth0"] == pytest.approx(0.01)
    assert rows[(0, 2)]["minus_depth0"] == 0
    text = staleness.markdown(
        {"command": "python bench/staleness.py", "table": list(rows.values())}
    )
    assert "| 4 | 2 | 2 | 0.7200 | 0.6500 … 0.7900 | -0.0300 | -0.0500 … -0.0100 |" in text


def test_it_trains_every_depth_and_writes_json_markdown_and_a_plot(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 600
    x = rng.normal(size=(n, 20))
    y = (x[:, :5].sum(axis=1) > 0).astype(int)
    header = "ID," + ",".join(f"X{i}" for i in range(1, 21)) + ",Y"
    lines = [header] + [f"{i}," + ",".join(f"{v:.4f}" for v in x[i]) + f",{y[i]}" for i in range(n)]
    data = tmp_path / "credit.csv"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "st.json"
    argv = [
        "--depths",
        "0,2",
        "--epochs",
        "1",
        "--seeds",
        "0",
        "--data",
        str(data),
        "--out",
        str(out),
    ]
    assert staleness.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"] == "python bench/staleness.py " + " ".join(argv)
    assert {(r["depth"], r["epochs"], r["seed"]) for r in report["runs"]} == {(0, 1, 0), (2, 1, 0)}
    for r in report["runs"]:
        assert 0.0 <= r["metrics"]["roc_auc"] <= 1.0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| 2 | 1 | 1 |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        staleness.main(["--depths", "2", "--data", str(data), "--out", str(out)])
