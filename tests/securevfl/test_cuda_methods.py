"""Every method trains on a GPU (`[run] device = "cuda"`) to the metrics it reaches on the CPU:
the example of each registered method, in-process, on cpu and on cuda with the same seed.
Runs only where torch sees a GPU (never in CI; on a GPU machine:
`pytest tests/securevfl/test_cuda_methods.py`)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from securevfl import inproc
from securevfl.config import parse_config
from securevfl.methods import method_names, method_spec
from tests.securevfl.conftest import permissive_policy
from tests.securevfl.fixed_seeds import fixed_seeds

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU torch can see")


def _metrics(tmp_path, name: str, device: str) -> dict:
    directory = tmp_path / f"{name}-{device}"
    directory.mkdir(parents=True)
    raw = fixed_seeds(method_spec(name).example(directory))  # cpu and cuda compared
    raw.setdefault("run", {}).update(device=device, transport="inproc")
    if name in ("local", "ensemble"):  # their sums are over one party: plain only
        raw["run"]["aggregation"] = "plain"
    cfg = parse_config(permissive_policy(raw), source=directory / "config.toml")
    code, metrics = inproc.run_federation(cfg, out=directory / "run", stdout=io.StringIO())
    assert code == 0, (directory / "run" / "logs" / "active.log").read_text()[-3000:]
    return metrics


@pytest.mark.parametrize("name", [n for n in method_names() if not n.startswith("test-")])
def test_each_method_on_cuda_reaches_its_cpu_metrics(tmp_path, name):
    cpu, cuda = _metrics(tmp_path, name, "cpu"), _metrics(tmp_path, name, "cuda")
    assert cuda["test"].keys() == cpu["test"].keys()
    for key, value in cpu["test"].items():
        if isinstance(value, float) and math.isfinite(value):
            assert cuda["test"][key] == pytest.approx(value, rel=1e-3, abs=1e-3), key
