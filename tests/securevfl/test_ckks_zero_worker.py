"""In ``thread`` mode (kept to compare with the default ``idle``), a CKKS party's worker makes
the next call's encryptions of zero only after a short delay (SEAL holds the GIL: started at
once it would hold up the send of the contribution just made), and a next call that comes
sooner wakes it at once instead of waiting the delay out."""

from __future__ import annotations

import time

import numpy as np
import pytest

from crypto.ckks import CkksKeyHolder, PackedCiphertexts, choose_params
from securevfl import secure_sum
from securevfl.secure_sum import CkksParty, SumSession


def _party() -> tuple[CkksKeyHolder, CkksParty]:
    holder = CkksKeyHolder(
        params=choose_params(precision_bits=12, magnitude=2.0**10, terms=3).params
    )
    ctx = holder.public_context_bytes()
    return holder, CkksParty(
        SumSession(name="a", session=b"s" * 16, ckks_public_context=ctx), zeros="thread"
    )


def test_the_worker_waits_before_it_encrypts_zeros(monkeypatch) -> None:
    monkeypatch.setattr(secure_sum, "CKKS_PREP_DELAY_S", 0.5)
    _, party = _party()
    party.protect(np.ones(10), round=0, group=["a", "b"], key="h")
    assert party.public.ready_zeros == 0  # still waiting: nothing competes with the send
    party._ahead.result(timeout=60)  # the delay runs out, then the zero is made
    assert party.public.ready_zeros == 1


def test_a_next_call_wakes_the_worker_and_uses_its_zero(monkeypatch) -> None:
    monkeypatch.setattr(secure_sum, "CKKS_PREP_DELAY_S", 600.0)  # far longer than the test
    holder, party = _party()
    party.protect(np.ones(10), round=0, group=["a", "b"], key="h")
    started = time.monotonic()
    arrays = party.protect(np.arange(10.0), round=1, group=["a", "b"], key="h")
    assert time.monotonic() - started < 60  # woken, not waiting out the 600 s
    packed = PackedCiphertexts(chunks=[arrays["h/0"].tobytes()], length=10)
    np.testing.assert_allclose(holder.decrypt_sum(packed, shape=(10,)), np.arange(10.0), atol=1e-4)
    # the first worker, woken, made its zero and the second call used it; the second worker
    # is waiting out its own delay
    assert party.public.ready_zeros == 0
    party._join()
    assert party.public.ready_zeros == 1


def test_a_zero_delay_starts_at_once(monkeypatch) -> None:
    monkeypatch.setattr(secure_sum, "CKKS_PREP_DELAY_S", 0.0)
    _, party = _party()
    party.protect(np.ones(10), round=0, group=["a", "b"], key="h")
    party._ahead.result(timeout=60)
    assert party.public.ready_zeros == 1


def test_the_delay_comes_from_the_environment_and_bad_values_are_refused(monkeypatch) -> None:

    monkeypatch.setenv("SECUREVFL_CKKS_PREP_DELAY", "0.01")
    assert secure_sum._prep_delay() == 0.01
    assert secure_sum._prep_delay(0.0) == 0.01  # the idle mode's delay reads it too
    monkeypatch.delenv("SECUREVFL_CKKS_PREP_DELAY")
    assert secure_sum._prep_delay() == 0.002  # the worker thread's default
    assert secure_sum._prep_delay(0.0) == 0.0  # the idle mode's: its send has gone already
    for bad in ("soon", "-1", "nan", "100"):
        monkeypatch.setenv("SECUREVFL_CKKS_PREP_DELAY", bad)
        with pytest.raises(ValueError, match=r"SECUREVFL_CKKS_PREP_DELAY=.*unset it .*0\.002"):
            secure_sum._prep_delay()


def test_close_stops_the_worker_after_its_pending_zero(monkeypatch) -> None:
    import threading

    monkeypatch.setattr(secure_sum, "CKKS_PREP_DELAY_S", 600.0)  # woken by close, not the delay
    _, party = _party()
    party.protect(np.ones(10), round=0, group=["a", "b"], key="h")
    party.close()
    assert party.public.ready_zeros == 1  # the pending preparation was finished, not dropped
    assert not any(t.name.startswith("a-ckks-zeros") for t in threading.enumerate())
    party.protect(np.ones(10), round=1, group=["a", "b"], key="h")  # usable again
    party.close()
