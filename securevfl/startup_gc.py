"""The garbage collector during a role process's start-up.

Importing torch and the rest of a role's modules allocates a few hundred thousand objects, and
the cyclic garbage collector runs hundreds of times meanwhile (each full pass walks every object
made so far): measured in a real Credit federation on 2 cores, ~2 s of CPU per party process
went to collections before its first training call, most of it while torch imported, and none
during training (one young-generation pass in 281 answers). So a role process (`securevfl
party` / `securevfl active`, `cli.entry`) starts with the collector off and turns it back on
(`end`) once its modules are imported, before it reads any data (a large table's set-up keeps
the collector, so the memory it allocates stays bounded as before). Everything alive then is
frozen (`gc.freeze`: the collector no longer walks the imported modules' objects, which live as
long as the process); the few thousand unreachable objects the imports left (~1-2 MB) stay in
memory. Reference counting frees everything else at once, collector or not.

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
    """The imports are done: freeze what is alive and turn the collector back on, if `begin`
    turned it off; otherwise nothing."""
    global _OFF
    if _OFF:
        _OFF = False
        gc.freeze()
        gc.enable()


def stats() -> dict:
    """For a role's statistics in metrics.json: whether the collector runs and how many objects
    the start-up froze (0 where `begin` never turned it off)."""
    return {"gc": {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}}
