"""`securevfl.startup_gc`: off for a role process's start-up, on again (start-up objects frozen)
once set up; a process whose collector it did not turn off is left alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.securevfl.conftest import REPO


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_begin_turns_the_collector_off_and_end_freezes_and_turns_it_on_once():
    out = _python(
        """
        import gc
        from securevfl import startup_gc
        startup_gc.begin()
        print(gc.isenabled(), startup_gc.stats()["gc"])
        junk = [[i] for i in range(1000)]
        startup_gc.end()
        print(gc.isenabled(), gc.get_freeze_count() > 1000, startup_gc.stats()["gc"]["enabled"])
        frozen = gc.get_freeze_count()
        startup_gc.end()  # again: nothing more
        print(gc.get_freeze_count() == frozen)
        """
    )
    assert out.splitlines() == [
        "False {'enabled': False, 'frozen': 0}",
        "True True True",
        "True",
    ]


def test_end_leaves_a_collector_it_did_not_turn_off_alone():
    out = _python(
        """
        import gc
        from securevfl import startup_gc
        startup_gc.end()
        print(gc.isenabled(), gc.get_freeze_count())
        gc.disable()  # someone else's choice
        startup_gc.end()
        print(gc.isenabled(), gc.get_freeze_count())
        """
    )
    assert out.splitlines() == ["True 0", "False 0"]
