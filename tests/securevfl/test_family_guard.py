"""`FamilyGuard`, the passive party's differencing check, against its definition: a row's family
is the groups of every call of one model version that summed it, and a call is refused exactly
when some row's family plus the call's groups isolates fewer than min_group parties. The guard
keeps rows in merged blocks (linear, not quadratic, in an evaluation's calls); the oracle here
keeps a plain dict of every row's groups."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from securevfl.roles.guard import FamilyGuard, FamilyLog
from securevfl.secure_sum import isolating_set

PARTIES = ("p1", "p2", "p3", "p4")


class Oracle:
    def __init__(self, min_group: int) -> None:
        self.min_group = min_group
        self.rows: dict[str, dict[int, tuple[frozenset[str], ...]]] = {}

    def admit(self, tensor, ids, groups) -> bool:
        groups = tuple(dict.fromkeys(groups))
        seen = self.rows.setdefault(tensor, {})
        for row in ids.tolist():
            family = tuple(dict.fromkeys(seen.get(row, ()) + groups))
            if isolating_set(family, self.min_group) is not None:
                return False
        for row in ids.tolist():
            seen[row] = tuple(dict.fromkeys(seen.get(row, ()) + groups))
        return True


def random_group(rng) -> frozenset[str]:
    size = int(rng.integers(2, len(PARTIES) + 1))
    return frozenset(rng.choice(PARTIES, size=size, replace=False).tolist())


@pytest.mark.parametrize("seed", range(6))
def test_the_guard_refuses_exactly_what_the_definition_refuses(seed):
    rng = np.random.default_rng(seed)
    guard, oracle = FamilyGuard(min_group=2), Oracle(min_group=2)
    refused = admitted = 0
    for _ in range(120):
        if rng.random() < 0.05:
            guard.new_version()
            oracle.rows.clear()
        tensor = str(rng.choice(["rep", "grad"]))
        # overlapping, repeated and fresh rows, in any order, sometimes with duplicates
        ids = rng.integers(0, 300, size=int(rng.integers(1, 40)))
        groups = [random_group(rng) for _ in range(int(rng.integers(1, 3)))]
        expected = oracle.admit(tensor, ids, groups)
        reason = guard.admit(tensor, ids, groups)
        assert (reason is None) == expected, (ids, groups, reason)
        if reason is not None:
            assert "combine into the contribution of" in reason and f"{tensor!r}" in reason
            row = int(reason.split()[1].rstrip(":"))
            assert row in ids.tolist()
        refused += reason is not None
        admitted += reason is None
    assert refused > 5 and admitted > 5  # both branches exercised


def test_a_refused_call_records_nothing():
    guard = FamilyGuard(min_group=2)
    ids = np.arange(10)
    assert guard.admit("rep", ids, [frozenset(PARTIES)]) is None
    # {p1..p4} minus {p1,p2,p3} isolates p4: refused, and the family is left as it was
    assert guard.admit("rep", ids[:3], [frozenset(("p1", "p2", "p3"))]) is not None
    assert guard.admit("rep", ids[5:], [frozenset(PARTIES)]) is None  # the same sum again
    assert guard.admit("rep", np.arange(10, 20), [frozenset(("p1", "p2", "p3"))]) is None


def test_disjoint_calls_keep_logarithmically_many_blocks():
    """An evaluation: many calls of fresh rows with the same group. The rows are stored in
    O(log n) blocks (so each call's look-up is O(k log n)), each row once, sorted."""
    guard = FamilyGuard(min_group=2)
    calls, k = 300, 64
    rng = np.random.default_rng(0)
    order = rng.permutation(calls * k)
    for c in range(calls):
        assert guard.admit("rep", order[c * k : (c + 1) * k], [frozenset(PARTIES)]) is None
        blocks = guard._tensors["rep"].blocks
        assert len(blocks) <= math.ceil(math.log2(c + 1)) + 2, (c, [len(b) for b, _ in blocks])
    rows = np.concatenate([b for b, _ in blocks])
    assert len(rows) == calls * k and np.array_equal(np.sort(rows), np.arange(calls * k))
    assert all(np.all(np.diff(b) > 0) for b, _ in blocks)
    # a row seen in the first call is still found: a subset of the group is refused for it
    assert guard.admit("rep", order[:1], [frozenset(("p1", "p2", "p3"))]) is not None


def _bare_guard(min_group: int = 2):
    """A `CallGuard` with only what the model-version bookkeeping reads."""
    from securevfl.methods import method_spec
    from securevfl.roles.guard import CallGuard

    guard = CallGuard.__new__(CallGuard)
    guard.families = FamilyGuard(min_group=min_group)
    guard.fresh_noise = False
    guard.log = None
    guard.version = None
    guard.set_up_at = []
    guard.spec = method_spec("splitnn")
    return guard


class _Update:
    op = "backward"  # split-NN declares it as an update


def test_a_model_version_is_its_weights_and_comes_back_with_its_sums(tmp_path):
    """Weights seen before (an update that moved nothing, a restored best model, a new session
    loading the same checkpoint) bring back every sum released at them; new weights start
    empty; a method without a digest keeps the old rule (every update is a new version)."""
    path = tmp_path / "guard" / "p1-families.log"
    ids = np.arange(10, dtype=np.int64)
    whole, pair = frozenset(PARTIES[:3]), frozenset(PARTIES[:2])

    def summed(guard, group) -> bool:
        reason = guard.families.admit("rep", ids, [group])
        if reason is None:
            guard.log.append(guard.version, "rep", [group], ids)
        return reason is None

    guard = _bare_guard()
    guard.attach(path, lambda: b"A")
    assert summed(guard, whole)
    guard.after(_Update(), digest=lambda: b"A")  # the update moved nothing
    assert not summed(guard, pair)
    guard.after(_Update(), digest=lambda: b"B")  # new weights: a new version
    assert summed(guard, pair)
    guard.after(_Update(), digest=lambda: b"A")  # back to A (e.g. restore_best)
    assert not summed(guard, pair)
    guard.after(_Update(), digest=lambda: None)  # no digest: every update is a new version
    assert guard.version is None and guard.families.admit("rep", ids, [pair]) is None
    guard.log.close()

    again = _bare_guard()  # another session, its model at A's weights
    again.attach(path, lambda: b"A")
    assert not summed(again, pair)
    again.attach(path, lambda: b"B")
    assert not summed(again, whole)  # at B the pair was summed: whole - pair isolates p3
    again.log.close()


def test_the_family_log_drops_a_record_cut_short_and_goes_on(tmp_path):
    path = tmp_path / "families.log"
    log = FamilyLog(path)
    log.append(b"v1", "rep", [frozenset(("p1", "p2"))], np.array([3, 1, 2]))
    log.append(b"v2", "rep", [frozenset(("p1", "p3")), frozenset(("p2", "p3"))], np.arange(5))
    log.close()
    whole = path.read_bytes()
    path.write_bytes(whole + whole[: len(whole) // 3])  # a crash in the middle of a record
    log = FamilyLog(path)
    assert path.stat().st_size == len(whole)
    ((tensor, groups, ids, everywhere),) = list(log.records(b"v1"))
    assert not everywhere
    assert tensor == "rep" and groups == [frozenset(("p1", "p2"))] and ids.tolist() == [3, 1, 2]
    assert [g for _, g, _, _ in log.records(b"v2")] == [
        [frozenset(("p1", "p3")), frozenset(("p2", "p3"))]
    ]
    log.append(b"v1", "rep", [frozenset(("p2", "p3"))], np.array([7]))
    assert [i.tolist() for _, _, i, _ in log.records(b"v1")] == [[3, 1, 2], [7]]
    assert list(log.records(b"unknown")) == []
    log.close()


def test_a_family_log_record_is_written_as_the_general_record_of_its_fields(tmp_path):
    """`append` packs a model digest's record from pieces (the tensor's and groups' part
    packed once): the bytes are exactly `_record` of the fields, for every version, and the
    file reads back after a reopen."""
    path = tmp_path / "families.log"
    log = FamilyLog(path)
    groups = [frozenset(("p1", "p2", "p3")), frozenset(("p2", "p4"))]
    expected = b""
    for i in range(3):
        version = hashlib.blake2b(bytes([i]), digest_size=16).digest()
        ids = np.arange(i, i + 5, dtype=np.int64)
        log.append(version, "rep", groups, ids)
        fields = {"v": version.hex(), "t": "rep", "g": [sorted(g) for g in groups]}
        expected += FamilyLog._record(fields, ids)
    log.append(b"short", "rep", groups[:1], np.array([9]))  # not a digest: the general path
    expected += FamilyLog._record(
        {"v": b"short".hex(), "t": "rep", "g": [["p1", "p2", "p3"]]}, np.array([9])
    )
    log.close()
    assert path.read_bytes() == expected
    reopened = FamilyLog(path)
    version = hashlib.blake2b(bytes([2]), digest_size=16).digest()
    ((tensor, got, ids, everywhere),) = list(reopened.records(version))
    assert (tensor, got, ids.tolist(), everywhere) == ("rep", groups, [2, 3, 4, 5, 6], False)
    reopened.close()


def test_a_checkpoint_keeps_the_rows_of_the_versions_a_session_starts_at_and_folds_the_rest(
    tmp_path,
):
    """Training makes a version a step; at a checkpoint the log keeps the rows of the current
    version, the session's first and those of the checkpoints still on disk, and folds every
    other version into one record per tensor of its groups, for every row (a version can be
    come back to by replaying steps from a checkpoint: the weights are the version)."""
    path = tmp_path / "p1-families.log"
    ids = np.arange(4, dtype=np.int64)
    whole = [frozenset(PARTIES[:3])]
    guard = _bare_guard()
    guard.attach(path, lambda: b"start")
    for version in (b"start", b"s1", b"s2", b"e0", b"s3", b"e1", b"s4", b"e2"):
        guard.after(_Update(), digest=lambda version=version: version)
        assert guard.families.admit("rep", ids, whole) is None
        guard.log.append(version, "rep", whole, ids)
        if version.startswith(b"e"):  # the end of an epoch: its checkpoint
            epoch = int(version[1:])
            guard.checkpointed(epoch, [e for e in (epoch - 1, epoch) if e >= 0])
    guard.log.close()

    reopened = FamilyLog(path)
    versions = (b"start", b"s1", b"s2", b"e0", b"s3", b"e1", b"s4", b"e2")
    records = {v: list(reopened.records(v)) for v in versions}
    kept = {v for v in versions if all(not everywhere for *_, everywhere in records[v])}
    assert kept == {b"start", b"e1", b"e2"}  # the first, and the two checkpoints on disk
    for v in set(versions) - kept:  # folded: the groups, no rows
        ((tensor, groups, ids, everywhere),) = records[v]
        assert everywhere and tensor == "rep" and groups == whole and ids.size == 0
    assert reopened.pins == {1: b"e1", 2: b"e2"}
    reopened.close()


def test_a_folded_version_counts_its_groups_for_every_row():
    """Rows 0-3 summed over {p1,p2,p3} at a version later folded: coming back to it, a sum of
    any rows (others too) over {p1,p2} would difference with it, and is refused; a sum over
    the same group is not."""
    guard = FamilyGuard(min_group=2)
    guard.admit_everywhere("rep", [frozenset(PARTIES[:3])])
    assert guard.admit("rep", np.arange(100, 104), [frozenset(PARTIES[:3])]) is None
    reason = guard.admit("rep", np.arange(200, 204), [frozenset(PARTIES[:2])])
    assert reason is not None and "combine into the contribution of ['p3']" in reason
    assert guard.admit("rep", np.arange(100, 104), [frozenset(PARTIES[:2])]) is not None
    guard.new_version()
    assert guard.admit("rep", np.arange(200, 204), [frozenset(PARTIES[:2])]) is None


def test_a_digest_from_kept_views_is_the_digest_read_afresh():
    """A party digests its weights after every update from byte views it keeps: they must give
    the same digest as reading the weights again, after an in-place step, a `.data` swap, a
    new module and a tensor past the byte-for-byte size."""
    import torch

    from securevfl.methods.blocks.nets import mlp
    from securevfl.roles.guard import model_digest

    class Method:
        pass

    method = Method()
    method.encoder = mlp(6, (8,), 4, seed=1)
    views: dict = {}
    first = model_digest(method, views=views)
    assert first == model_digest(method) and views
    with torch.no_grad():
        method.encoder[0].weight.add_(1.0)  # what an optimizer step does
    stepped = model_digest(method, views=views)
    assert stepped == model_digest(method) != first
    method.encoder[0].weight.data = torch.zeros(8, 6)  # new storage under the same parameter
    assert model_digest(method, views=views) == model_digest(method) != stepped
    method.encoder = mlp(6, (8,), 4, seed=1)  # a new module with the first weights
    assert model_digest(method, views=views) == first
    method.extra = [torch.nn.Linear(300, 300)]  # 90,300 values: summed, not viewed
    assert model_digest(method, views=views) == model_digest(method) != first


def test_a_digest_from_a_kept_plan_follows_every_change_of_the_modules():
    """The kept plan (`_DigestPlan`: the modules' named tensors) must be dropped whenever the
    modules change shape: a submodule replaced, a parameter added, deleted or written into the
    module's dicts directly, a buffer registered, a dict replaced. Each time the digest from
    the kept plan must be the digest read afresh, and differ from the one before."""
    import torch

    from securevfl.methods.blocks.nets import mlp
    from securevfl.roles.guard import model_digest

    class Method:
        pass

    method = Method()
    method.encoder = mlp(6, (8,), 4, seed=1)
    method.heads = [torch.nn.Linear(4, 2)]
    views: dict = {}
    digests = [model_digest(method, views=views)]

    def changed(change, *, back_to: int | None = None) -> None:
        with torch.no_grad():
            change()
        got = model_digest(method, views=views)
        assert got == model_digest(method)
        if back_to is None:
            assert got not in digests
        else:  # the weights of an earlier step again: its version
            assert got == digests[back_to]
        digests.append(got)

    changed(lambda: method.encoder.__setitem__(0, torch.nn.Linear(6, 8)))
    changed(lambda: setattr(method.encoder[2], "scale", torch.nn.Parameter(torch.ones(1))))
    changed(lambda: delattr(method.encoder[2], "scale"), back_to=1)
    full = torch.nn.Parameter(torch.full((4,), 3.0))
    changed(lambda: method.encoder[2]._parameters.__setitem__("bias", full))
    changed(lambda: method.encoder[0].register_buffer("count", torch.zeros(2)))
    changed(lambda: setattr(method.encoder[0], "_buffers", {}), back_to=4)  # count gone
    changed(lambda: method.heads.__setitem__(0, torch.nn.Linear(4, 2, bias=False)))
    changed(lambda: method.heads[0].weight.mul_(2.0))  # in place: same plan, new values
    assert model_digest(method, views=views) == digests[-1]  # nothing changed: the same


def test_a_second_set_up_keeps_the_session_s_first_version_and_keeps_both(tmp_path):
    """A set-up again in one session (a retry, or a resume from a checkpoint) does not make its
    version the session's first: the first stays, and a checkpoint keeps the rows of every
    version the session was set up at."""
    path = tmp_path / "p1-families.log"
    whole = [frozenset(PARTIES[:3])]
    guard = _bare_guard()
    guard.attach(path, lambda: b"initial")
    guard.log.append(b"initial", "rep", whole, np.arange(4))
    guard.attach(path, lambda: b"resumed")
    guard.log.append(b"resumed", "rep", whole, np.arange(4))
    assert guard.first_version == b"initial" and guard.set_up_at == [b"initial", b"resumed"]
    guard.after(_Update(), digest=lambda: b"trained")
    guard.checkpointed(0, [0])
    folded = {
        v: [everywhere for *_, everywhere in guard.log.records(v)] for v in (b"initial", b"resumed")
    }
    assert folded == {b"initial": [False], b"resumed": [False]}
    guard.log.close()


def test_a_version_whose_groups_together_isolate_keeps_its_rows(tmp_path):
    """Rows 0-3 summed over {p1,p2,p3} and rows 4-7 over {p1,p2} at one version (LASER-VFL's
    families differ by row): folding them would count both groups for every row, which isolates
    p3 and would refuse everything at that version; so its rows are kept, and a session back at
    it is held to them exactly: rows 0-3 over {p1,p2} refused, new rows over {p1,p2} served."""
    path = tmp_path / "p1-families.log"
    log = FamilyLog(path)
    log.append(b"old", "rep", [frozenset(PARTIES[:3])], np.arange(4))
    log.append(b"old", "rep", [frozenset(PARTIES[:2])], np.arange(4, 8))
    log.append(b"whole", "rep", [frozenset(PARTIES[:3])], np.arange(4))
    log.compact(keep=[], epochs=[], min_group=2)
    assert [e for *_, e in log.records(b"old")] == [False, False]  # kept as written
    assert [e for *_, e in log.records(b"whole")] == [True]  # one group: folded
    guard = FamilyGuard(min_group=2)
    for tensor, groups, ids, _ in log.records(b"old"):
        guard.admit(tensor, ids, groups)
    assert guard.admit("rep", np.arange(4), [frozenset(PARTIES[:2])]) is not None
    assert guard.admit("rep", np.arange(8, 12), [frozenset(PARTIES[:2])]) is None
    log.close()


def test_a_row_is_filed_under_its_id_and_its_values():
    """The same row (id and values, -0.0 as 0.0, any NaN as NaN) has one key in any file; a
    reused id with another value, or another id, has another; no key is the pseudo-row of the
    rows a party lacks."""
    from securevfl.roles.guard import WHOLE_CALL, row_keys

    ids = np.array([7, 7, 7, 8, 7], dtype=np.int64)
    nan_bits = np.array([0x7FF8000000000001], dtype=np.uint64).view(np.float64)[0]
    values = np.array([[1.5, 0.0], [1.5, -0.0], [1.5, 2.0], [1.5, 0.0], [np.nan, 0.0]])
    keys = row_keys(ids, values)
    assert keys[0] == keys[1] and len(set(keys[[0, 2, 3, 4]].tolist())) == 4
    assert row_keys(ids[4:], np.array([[nan_bits, 0.0]]))[0] == keys[4]
    assert np.array_equal(row_keys(ids, values), keys)  # deterministic
    assert WHOLE_CALL[0] not in keys


def test_table_row_keys_are_row_keys_of_the_held_rows_and_follow_a_new_matrix():
    """`TableRowKeys` (the keys of an in-memory table made once) gives, for any call's ids,
    which rows the table holds and exactly `row_keys` of those ids and `table.rows` of them; a
    new encoded matrix (another object) makes its keys again."""
    from securevfl.data.rowstore import MemoryRows
    from securevfl.data.table import PartyTable
    from securevfl.roles.guard import TableRowKeys, row_keys

    ids = np.array([2, 3, 5, 8, 13, 21], dtype=np.int64)
    numbers = np.arange(12, dtype=np.float64).reshape(6, 2)
    table = PartyTable(
        ids=ids,
        columns=("a", "b"),
        rowstore=MemoryRows(numbers, np.zeros((6, 0), np.int32), np.empty(6, object)),
    )
    keyed = TableRowKeys(table)
    asked = np.array([21, 4, 2, 2, 13, 99], dtype=np.int64)
    held, keys = keyed(asked)
    assert held.tolist() == [True, False, True, True, True, False]
    mine = asked[held]
    assert np.array_equal(keys, row_keys(mine, table.rows(mine)))
    table.matrix = table.matrix + 1.0  # re-encoded: other values, other keys
    held2, keys2 = keyed(asked)
    assert np.array_equal(held2, held)
    assert np.array_equal(keys2, row_keys(mine, table.rows(mine)))
    assert not np.any(keys2 == keys)


def test_table_row_keys_of_a_streamed_table_equal_those_of_the_same_file_in_memory(tmp_path):
    """The same rows have the same keys whether the file is read whole or streamed into a row
    cache (whose keys are made from the rows each call names); text columns included."""
    from securevfl.config import parse_config
    from securevfl.data.table import load_party_table
    from securevfl.roles.guard import TableRowKeys

    lines = ["id,job,age,z,y"] + [
        f"{i},{('cook', 'admin', '')[i % 3]},{'' if i % 5 == 0 else 20 + i},{i},{i % 2}"
        for i in range(1, 41)
    ]
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    raw = {
        "data": {"path": "data.csv", "id": "id", "label": "y"},
        "parties": {"p": {"columns": ["job", "age"]}, "q": {"columns": ["z"]}},
    }
    cfg = parse_config(raw, source=tmp_path / "config.toml")
    whole = load_party_table(tmp_path / "data.csv", cfg, "p", stream=False)
    streamed = load_party_table(
        tmp_path / "data.csv", cfg, "p", stream=True, cache_dir=tmp_path / "cache"
    )
    assert streamed.streamed and not whole.streamed
    for t in (whole, streamed):
        t.prepare(np.arange(1, 31))
    asked = np.array([40, 3, 99, 7, 7, 5, 0], dtype=np.int64)  # 5: both cells empty
    held_w, keys_w = TableRowKeys(whole)(asked)
    held_s, keys_s = TableRowKeys(streamed)(asked)
    assert held_w.tolist() == held_s.tolist() == [True, True, False, True, True, False, False]
    assert np.array_equal(keys_w, keys_s) and keys_w[2] == keys_w[3]  # id 7 twice: one key
    assert TableRowKeys(streamed)(np.array([99], dtype=np.int64))[1].size == 0
