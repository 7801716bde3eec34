"""A model version is held to its sums whichever way the party comes back to it, tested from the
attacker's side: three real `securevfl party` processes face a modified active party that also
plays the aggregator (`test_hostile_roles.Attacker`).

- Replaying training steps from a checkpoint the party keeps brings back weights whose rows a
  later checkpoint dropped from the log: their sums are folded, not forgotten, and the party
  refuses to sum the same rows over fewer parties.
- `securevfl predict` scores at the trained weights: a scoring session is held to training's
  sums of the same rows (each predict run writes the rows to a file of its own, which is not
  another version), and a party started to score neither trains nor checkpoints.
- Repeating sums already made costs the party's disk nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from securevfl.data.table import split_rows
from securevfl.methods import SumSpec
from securevfl.roles import protocol as P
from tests.securevfl.test_hostile_roles import PARTIES, Attacker, refused

pytestmark = pytest.mark.multiprocess

NONE = np.empty(0, dtype=np.int64)
PAIR = ("p1", "p2")


def sums(group):
    return [SumSpec(key="S", tensor="rep", group=tuple(group))]


def served(replies, parties=PARTIES):
    assert set(replies) == set(parties), replies
    assert all(r.kind == P.CONTRIB for r in replies.values()), {
        p: r.meta.get("rule") for p, r in replies.items()
    }


def step(a: Attacker, rows, grad) -> None:
    served(a.call("forward", ids=rows, args={"train": True}, sums=sums(PARTIES)))
    served(a.call("backward", ids=rows, args={"forward": a.round}, inputs={"grad": grad}))


def log_size(a: Attacker, party: str) -> int:
    return (a.run_dir / "guard" / f"{party}-families.log").stat().st_size


def test_replayed_steps_bring_back_a_version_held_to_its_sums(tmp_path):
    """Steps g1, g2, g3 with checkpoints after g1 and g3: the version after g2 is no
    checkpoint's, and the second checkpoint folds its rows away. Set up again from the first
    checkpoint and replay g2: the weights, so the sums, are g2's again (bit for bit), and rows
    summed over all three parties at g2 are refused over {p1,p2} (their difference would be p3's
    representation). Fifty repeats of one sum leave the log as it was."""
    a = Attacker(tmp_path)
    rows, a_rows, c_rows = a.ids[100:140], a.ids[:20], a.ids[20:40]
    grads = [np.random.default_rng(i).normal(size=(40, 4)).astype(np.float32) for i in range(3)]
    try:
        served(a.setup())
        step(a, rows, grads[0])
        served(a.call("checkpoint", ids=NONE, args={"epoch": 0}))
        step(a, rows, grads[1])
        at_g2 = a.call("forward", ids=a.ids[:40], args={"train": False}, sums=sums(PARTIES))
        served(at_g2)
        size = log_size(a, "p1")
        for _ in range(50):  # the same sum again: nothing new for the log
            served(a.call("forward", ids=c_rows, args={"train": False}, sums=sums(PARTIES)))
        assert log_size(a, "p1") == size
        step(a, rows, grads[2])
        served(a.call("checkpoint", ids=NONE, args={"epoch": 1}))
        served(a.setup(args={"resume_epoch": 0}))  # back at the first checkpoint, this session
        step(a, rows, grads[1])  # the same step: the same weights as at g2
        again = a.call("forward", ids=c_rows, args={"train": False}, sums=sums(PARTIES))
        served(again)
        total = sum(r.tensors["S"] for r in again.values()).reshape(20, -1)
        before = sum(r.tensors["S"] for r in at_g2.values()).reshape(40, -1)
        # masks cancel: the encoded sums, equal (the 20-row call is too small for the 32-bit
        # ring, the 40-row one is not: compared mod 2^32, both true sums far below 2^31)
        assert (total.dtype, before.dtype) == (np.uint64, np.uint32)
        assert np.array_equal(total.astype(np.uint32), before[20:])
        subset = a.call("forward", ids=a_rows, args={"train": False}, to=PAIR, sums=sums(PAIR))
        refused(subset, "differencing", parties=PAIR)
    finally:
        a.close()


def test_a_scoring_party_is_held_to_training_s_sums_and_never_trains(tmp_path):
    """Training sums rows A over all three parties at the checkpointed weights. Two predict
    sessions, each on a fresh split of the rows to score (as `securevfl predict` writes them):
    A over {p1,p2} is refused in the first, B (summed over all three in the first) over {p1,p2}
    in the second. A party started with --score refuses a backward, a checkpoint and a set-up to
    train, whatever the active party says."""
    t = Attacker(tmp_path)
    a_rows, b_rows = t.ids[:20], t.ids[20:40]
    cfg = t.cfg
    try:
        served(t.setup())
        rows = t.ids[100:140]
        step(t, rows, np.random.default_rng(1).normal(size=(40, 4)).astype(np.float32))
        served(t.call("checkpoint", ids=NONE, args={"epoch": 0}))
        served(t.call("forward", ids=a_rows, args={"train": False}, sums=sums(PARTIES)))
    finally:
        t.close()

    def scoring_session():
        files = split_rows(cfg, tmp_path / "data.csv", tmp_path / "run" / "predict" / "data")
        s = Attacker(tmp_path, again=True, score=True, party_data=files)
        return s

    s = scoring_session()
    try:
        refused(s.setup(args={"resume_epoch": 0}), "mode")  # a set-up to train
        served(s.setup(args={"predict": True, "resume_epoch": 0}))
        refused(
            s.call("forward", ids=a_rows, args={"train": False}, to=PAIR, sums=sums(PAIR)),
            "differencing",
            parties=PAIR,
        )
        served(s.call("forward", ids=b_rows, args={"train": False}, sums=sums(PARTIES)))
        grad = np.zeros((len(b_rows), 4), dtype=np.float32)
        forward = s.call("forward", ids=b_rows, args={"train": True}, sums=sums(PARTIES))
        served(forward)
        backward = s.call("backward", ids=b_rows, args={"forward": s.round}, inputs={"grad": grad})
        refused(backward, "mode")
        refused(s.call("checkpoint", ids=NONE, args={"epoch": 0}), "mode")
    finally:
        s.close()
    s = scoring_session()
    try:
        served(s.setup(args={"predict": True, "resume_epoch": 0}))
        refused(
            s.call("forward", ids=b_rows, args={"train": False}, to=PAIR, sums=sums(PAIR)),
            "differencing",
            parties=PAIR,
        )
    finally:
        s.close()


def test_a_vfem_party_keeps_its_model_s_standardisation(tmp_path):
    """VFEM releases beta'(x - center) / scale per row, and `prepare` (the active party's call)
    sets center and scale. A resumed session at the same beta that prepares p1 without
    standardisation and the others as before would get, from two sums of the same rows over
    the same three parties, p1's term alone (the others cancel). The party keeps its model's
    first `prepare` in its checkpoint and refuses another; the same one is served."""

    def vfem(raw):
        raw["run"]["method"] = "vfem"
        raw["data"]["task"] = "regression"
        raw.pop("model", None)
        raw.pop("train", None)
        raw["policy"]["clear_releases"] = ["design.spectrum", "finish.coef", "finish.var"]

    def prepare(a, to, standardize):
        args = {"intercept": True, "standardize": standardize}
        return a.call("prepare", ids=a.ids, to=to, args=args)

    m = [SumSpec(key="m", tensor="m", group=PARTIES)]
    t = Attacker(tmp_path, edit=vfem)
    try:
        served(t.setup())
        served(prepare(t, PARTIES, True))
        design = {"kind": "complete", "reset": True}
        served(t.call("design", ids=t.ids, args=design, collect=("spectrum",)))
        e = np.random.default_rng(3).normal(size=len(t.ids))
        inputs = {"e": e, "w": np.zeros(len(t.ids))}
        served(t.call("mstep", ids=t.ids, inputs=inputs, args={"sigma2": 1.0, "eta": 0.5}))
        served(t.call("checkpoint", ids=NONE, args={"epoch": 0}))
        served(t.call("predict", ids=t.ids[:20], sums=m))
    finally:
        t.close()
    a = Attacker(tmp_path, again=True, edit=vfem)
    try:
        served(a.setup(args={"resume_epoch": 0}))
        refused(prepare(a, ("p1",), False), "method", parties=("p1",))
        served(prepare(a, ("p2", "p3"), True), parties=("p2", "p3"))
        served(prepare(a, ("p1",), True), parties=("p1",))  # the model's own: served
        served(a.call("predict", ids=a.ids[:20], sums=m))
    finally:
        a.close()
