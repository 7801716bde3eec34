"""The Credit split (X1..X20, four parties of five columns): plain, mask and ckks give the same
test metrics (within 0.005) for the same config and seed. Long: run with `make test-slow`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.securevfl.conftest import securevfl_cli

CREDIT = Path(__file__).resolve().parents[3] / "shared" / "data" / "credit_default.csv"

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.mark.skipif(not CREDIT.exists(), reason="needs ../shared/data/credit_default.csv")
def test_credit_plain_mask_ckks_agree(tmp_path):
    parties = "\n".join(
        f"[parties.p{k + 1}]\ncolumns = {[f'X{5 * k + i + 1}' for i in range(5)]}".replace("'", '"')
        for k in range(4)
    )
    results = {}
    for aggregation in ("plain", "mask", "ckks"):
        config = tmp_path / f"{aggregation}.toml"
        config.write_text(
            # shared_init: the three runs compared start from one model (the parties' own
            # private initial weights would differ between them)
            f'[run]\nmethod = "splitnn"\naggregation = "{aggregation}"\nseed = 0\n'
            "shared_init = true\n"
            f'[data]\npath = "{CREDIT}"\ntask = "binary"\ntest_fraction = 0.2\n'
            f"{parties}\n[train]\nepochs = 2\nbatch_size = 256\nlr = 0.001\n"
            "[model]\nhidden = [64]\nwidth = 16\n"
            '[policy]\naggregations = ["plain", "mask", "ckks"]\nconfig_seeds = true\n'
        )
        done = securevfl_cli("run", str(config), "--out", str(tmp_path / aggregation), timeout=900)
        assert done.returncode == 0, done.stderr
        results[aggregation] = json.loads((tmp_path / aggregation / "metrics.json").read_text())
    for secure in ("mask", "ckks"):
        for key in ("accuracy", "f1", "roc_auc"):
            assert abs(results["plain"]["test"][key] - results[secure]["test"][key]) <= 0.005
