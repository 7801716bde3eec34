"""Exit statuses: one table in `securevfl.errors`, the README's copy equal to it, and every error
class mapped to a status of that table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from securevfl import errors

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_exit_table() -> dict[int, str]:
    text = README.read_text()
    section = text[text.index("### Exit statuses") :]
    section = section[: section.index("\n## ")]
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", section, flags=re.M)
    return {int(code): meaning for code, meaning in rows}


def test_the_readme_table_is_the_code_table():
    assert readme_exit_table() == errors.EXIT_STATUSES


def error_classes() -> list[type]:
    return [
        v
        for v in vars(errors).values()
        if isinstance(v, type) and issubclass(v, errors.SecureVFLError)
    ]


@pytest.mark.parametrize("cls", error_classes(), ids=lambda c: c.__name__)
def test_every_error_class_ends_with_a_documented_status(cls):
    code = cls.exit_code if isinstance(cls.__dict__.get("exit_code"), int) else None
    if code is None:  # a status computed per instance (RunAborted)
        for exc in (cls("x"), cls("x", lost="p"), cls("x", refused=True)):
            assert errors.exit_code_for(exc) in errors.EXIT_STATUSES
        return
    assert code in errors.EXIT_STATUSES


def test_statuses_of_the_roles_failures():
    assert errors.exit_code_for(errors.ConfigError("[run] x", "bad")) == 2
    assert errors.exit_code_for(errors.DataError("no column")) == 2
    assert errors.exit_code_for(errors.RunAborted("gone", lost="p1")) == 4
    assert errors.exit_code_for(errors.RunAborted("refused", refused=True)) == 5
    assert errors.exit_code_for(errors.RunAborted("failed")) == 1
    assert errors.exit_code_for(errors.PolicyRefusal("p1", "collect", "clear release")) == 5
    budget = errors.BudgetExceeded(
        role="a", mechanism="label_dp", max_epsilon=1.0, epsilon=2.0, delta=1e-5
    )
    assert errors.exit_code_for(budget) == 3
    assert errors.exit_code_for(KeyboardInterrupt()) == 130
    assert errors.exit_code_for(ValueError("internal")) == 1
