"""`securevfl bench`: the benchmark report (`bench/report.py` of the source checkout).

The benchmarks drive real federations, the WAN emulator and the crypto micro-benchmarks from
the repository's `bench/` directory, which the wheel does not ship; an installed package without
it gets a `BenchUnavailable` error that says where to get it.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from securevfl.errors import SecureVFLError

REPORT = Path(__file__).resolve().parents[1] / "bench" / "report.py"


class BenchUnavailable(SecureVFLError):
    """The benchmark scripts are not next to this installation of securevfl."""


def load_report(path: Path = REPORT) -> ModuleType:
    """Import `bench/report.py` from `path`; refuses (BenchUnavailable) when it is missing."""
    if not path.is_file():
        raise BenchUnavailable(
            f"securevfl bench needs the benchmark scripts of the source checkout ({path} is "
            "missing: the installed package does not ship bench/); clone the repository, "
            "`pip install -e .` in it and run `securevfl bench` (or `python bench/report.py`) "
            "from there"
        )
    spec = importlib.util.spec_from_file_location("securevfl_bench_report", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_bench(argv: Sequence[str], *, report: Path = REPORT) -> int:
    """Run the report with `argv` (its options: --quick, --out, --only, --data, --work,
    --render); returns its exit status."""
    return int(load_report(report).main(list(argv), prog="securevfl bench"))
