"""The installable package: a wheel with the three top-level packages, the example configs as
package data and the `securevfl` command; a clash with another distribution's `crypto` or
`transport` is refused at import with a message; `securevfl example` writes a config."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from securevfl.config import load_config
from securevfl.data.table import read_csv_columns

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_the_packages_the_examples_and_the_command(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = next(tmp_path.glob("securevfl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for wanted in (
        "securevfl/cli.py",
        "crypto/psi.py",
        "transport/hub.py",
        "securevfl/examples/credit_laser.toml",
        "securevfl/methods/ridge.py",
    ):
        assert wanted in names, wanted
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "securevfl = securevfl.cli:entry" in zipfile.ZipFile(wheel).read(entry).decode()


def test_a_foreign_crypto_package_is_refused_at_import(tmp_path):
    (tmp_path / "crypto").mkdir()
    (tmp_path / "crypto" / "__init__.py").write_text("# someone else's crypto\n")
    done = subprocess.run(
        [sys.executable, "-c", "import securevfl"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
    )
    assert done.returncode != 0
    assert "another installed distribution also provides 'crypto'" in done.stderr


def _example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "securevfl", "example", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


def _party_columns(config: Path) -> np.ndarray:
    cfg = load_config(config)
    columns = [c for p in cfg.parties for c in p.columns]
    return read_csv_columns(cfg.data_path, id_column="ID", columns=columns)[1]


def test_securevfl_example_writes_a_runnable_config(tmp_path):
    done = _example("vfem-simulated", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "vfem_simulated.toml").exists() and "its table" in done.stdout
    x = _party_columns(tmp_path / "vfem_simulated.toml")
    assert len(x) == 2000 and np.isnan(x).any()  # parties lack rows: empty cells
    done = _example("breast-cancer", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert _party_columns(tmp_path / "breast_cancer.toml").shape == (569, 30)
    (tmp_path / "credit_default.csv").write_text("ID,Y\n")  # the user's own table, in place
    done = _example("credit-laser", "--out", str(tmp_path))
    assert done.returncode == 0 and "put the table at" in done.stdout, done.stderr
    assert (tmp_path / "credit_default.csv").read_text() == "ID,Y\n"
    edited = (tmp_path / "breast_cancer.toml").read_text() + "\n# edited\n"
    (tmp_path / "breast_cancer.toml").write_text(edited)
    again = _example("breast-cancer", "--out", str(tmp_path))  # nothing of the user's is lost
    assert again.returncode == 2 and "--force" in again.stderr, again.stderr
    assert (tmp_path / "breast_cancer.toml").read_text() == edited
    assert _example("breast-cancer", "--out", str(tmp_path), "--force").returncode == 0
    assert (tmp_path / "breast_cancer.toml").read_text() != edited
    listing = _example()
    assert "credit-laser" in listing.stdout and "breast-cancer" in listing.stdout
