"""The garbage collector during a role process's start-up.

Importing torch and the rest of a role's modules, reading its table and building its model
allocate a few hundred thousand objects, and the cyclic garbage collector runs hundreds of times
meanwhile (each full pass walks every object made so far): measured in a real Credit federation
on 2 cores, ~2 s of CPU per party process went to collections before its first training call,
of ~5 s of start-up, and none during training (one young-generation pass in 281 answers). So a
role process (`securevfl party` / `securevfl active`, `cli.entry`) starts with the collector
off, and its role code turns it back on (`end`) once it has set up: a party after it answered
its first call, the active party after the set-up round. Everything alive then is frozen
(`gc.freeze`: the collector no longer walks the start-up's objects, which live as long as the
process); the few unreachable cycles the imports left (some thousands of objects, ~1-2 MB) stay
in memory. Reference counting frees everything else at once, collector or not.

Only a process whose collector this module turned off is affected: in-process federations and
the tests keep theirs as it is.
"""

from __future__ import annotations

import gc

_OFF = False  # the collector is off because `begin` turned it off


def begin() -> None:
    """Turn the collector off for the start-up of this process (if it is on)."""
    global _OFF
    if gc.isenabled():
        gc.disable()
        _OFF = True


def end() -> None:
    """The start-up is over: freeze what is alive and turn the collector back on, if `begin`
    turned it off; otherwise nothing (cheap: called after every reply)."""
    global _OFF
    if _OFF:
        _OFF = False
        gc.freeze()
        gc.enable()


def stats() -> dict:
    """For a role's statistics in metrics.json: whether the collector runs and how many objects
    the start-up froze (0 where `begin` never turned it off)."""
    return {"gc": {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}}
