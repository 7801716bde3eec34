"""Set-up of a streamed active table a part at a time (`securevfl.roles.setup_rows`), and the
DP per-row use counts kept compact (`securevfl.privacy.runtime.RowReleases`): no message and no
array at either end holds a row's id list whole, the parties see what a table read whole would
tell them, and a part that is missing, out of order, malformed or not what set-up announces is
refused by name."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest

from securevfl.direct import DirectFederation
from securevfl.errors import PolicyRefusal, RunAborted
from securevfl.privacy.ledger import LEDGER_FILENAME, LedgerEvent, PrivacyLedger
from securevfl.privacy.runtime import RolePrivacy, plan_role, sorted_unique
from securevfl.roles import protocol as P
from securevfl.roles import setup_rows
from securevfl.roles.guard import run_terms
from securevfl.roles.rounds import PartyRound
from securevfl.roles.setup_rows import ReceivedRows, RowsRefused, training_bits
from tests.securevfl.conftest import BASE_RAW, make_config, synthetic_csv

PART = 50  # ids per part in these tests (300 rows: 6 parts)


def config(tmp_path, *, stream: bool, **privacy):
    raw = copy.deepcopy(BASE_RAW)
    raw["data"]["stream"] = stream
    raw["train"]["epochs"] = 1
    for key, value in privacy.items():
        raw.setdefault("privacy", {})[key] = value
    if not (tmp_path / "data.csv").exists():
        synthetic_csv(tmp_path / "data.csv", n=300)
    return make_config(raw, tmp_path)


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(setup_rows, "ROWS_PER_PART", PART)


@pytest.fixture
def envelopes(monkeypatch):
    """Every call envelope a party answers: (op, its tensors' lengths, its args)."""
    seen: list[tuple[str, dict[str, int], dict]] = []
    answer = PartyRound.answer

    def spying(self, env):
        seen.append((env.meta["op"], {k: len(v) for k, v in env.tensors.items()}, env.meta["args"]))
        return answer(self, env)

    monkeypatch.setattr(PartyRound, "answer", spying)
    return seen


# ------------------------------------------------------------------------------- a federation


def test_a_streamed_set_up_sends_its_rows_in_parts_and_tells_what_one_message_would(
    tmp_path, small_parts, envelopes, monkeypatch
):
    told = {}  # what each party's method is set up with, per run
    from securevfl.methods.splitnn import SplitNNParty

    original = SplitNNParty.setup

    def recording(self, *, args, inputs):
        told[(self.table.streamed, self.name)] = {k: inputs[k] for k in ("train_ids", "all_ids")}
        return original(self, args=args, inputs=inputs)

    monkeypatch.setattr(SplitNNParty, "setup", recording)
    memory = DirectFederation(config(tmp_path, stream=False), run_dir=tmp_path / "memory")
    in_one = [e for e in envelopes if e[0] in P.SETUP_OPS]
    envelopes.clear()
    streamed = DirectFederation(config(tmp_path, stream=True), run_dir=tmp_path / "stream")
    assert streamed.method.table.streamed and not memory.method.table.streamed
    # a table read whole: one set-up call with both id lists (300 and 225 ids), as before
    assert [(op, sizes) for op, sizes, _ in in_one] == [
        ("setup", {"ids": 0, "train_ids": 225, "all_ids": 300})
    ] * 3
    # streamed: 6 parts of at most 50 ids (and 50 bits), set-up with none, 6 presence parts
    ops = [(op, sizes, args) for op, sizes, args in envelopes if op in P.SETUP_OPS]
    assert [op for op, _, _ in ops] == ["setup.rows"] * 18 + ["setup"] * 3 + ["setup.present"] * 18
    for op, sizes, _ in ops:
        assert max(sizes.values()) <= PART, (op, sizes)
        assert "train_ids" not in sizes and "all_ids" not in sizes or op == "setup.rows"
    announced = [args["rows"] for op, _, args in ops if op == "setup"][0]
    assert announced["parts"] == 6 and announced["ids"] == 300 and announced["train"] == 225
    # every party is told exactly what the message of a table read whole told it, from files
    for p in streamed.parties:
        got, want = told[(True, p)], told[(False, p)]
        for k in ("train_ids", "all_ids"):
            assert isinstance(got[k], np.memmap), k  # a map of the party's file, not in memory
            assert np.array_equal(np.asarray(got[k]), want[k]), k
        assert streamed.party_rounds[p].privacy._rows is got["all_ids"]  # not copied
    assert streamed.privacy._rows is streamed.method.table.ids  # the active's: its id index
    assert memory.privacy._rows is not memory.method.table.ids  # np.unique, as before
    # and the active party knows who holds what, and trains on the same rows
    ids = memory.method.table.ids
    assert np.array_equal(streamed.presence(ids), memory.presence(ids))
    assert np.array_equal(np.asarray(streamed.train_ids), memory.train_ids)


def test_a_training_id_not_among_the_tables_ids_stops_set_up_before_it_is_announced(
    tmp_path, small_parts, envelopes
):
    fed = DirectFederation(config(tmp_path, stream=True), run_dir=tmp_path / "run")
    envelopes.clear()
    train = np.append(np.asarray(fed.train_ids), 10**12)
    with pytest.raises(RunAborted, match="1 training ids are not among the table's ids"):
        fed.setup(train_ids=train)
    assert {op for op, _, _ in envelopes} == {"setup.rows"}


# ------------------------------------------------------------------------------- the party's side


@pytest.fixture
def fed(tmp_path, small_parts):
    return DirectFederation(config(tmp_path, stream=True), run_dir=tmp_path / "run")


def send_part(fed, part, ids, bits=None, **extra):
    bits = np.packbits(np.ones(len(ids), bool), bitorder="little") if bits is None else bits
    return fed.call(
        P.OP_SETUP_ROWS,
        ids=np.empty(0, np.int64),
        args={"run": run_terms(fed.config), "part": part, **extra},
        inputs={"all_ids": ids, "train_bits": bits},
        to=fed.parties,
    )


def refused(rule, match):
    return pytest.raises(PolicyRefusal, match=match)


@pytest.mark.parametrize(
    "sent, match",
    [
        ([(1, np.arange(10))], "setup.rows part 1 where part 0 was due"),  # the first dropped
        ([(0, np.arange(10)), (2, np.arange(20, 30))], "part 2 where part 1 was due"),  # dropped
        ([(0, np.arange(10)), (1, np.arange(5, 15))], "not sorted and unique"),  # overlapping
        ([(0, np.array([3, 2, 5]))], "not sorted and unique"),
        ([(0, np.arange(10.0))], "ids must be 1 to 50 int64, got float64"),
        ([(0, np.arange(51))], r"ids must be 1 to 50 int64, got int64 of shape \(51,\)"),
        ([(0, np.empty(0, np.int64))], "ids must be 1 to 50"),
    ],
)
def test_a_part_out_of_order_or_malformed_is_refused_by_name(fed, sent, match):
    for r in fed.party_rounds.values():
        r.told_rows = None  # parties that were told nothing yet
    with pytest.raises(PolicyRefusal, match=match) as caught:
        for part, ids in sent:
            send_part(fed, part, ids)
    assert caught.value.rule == "setup rows"


def test_training_bits_of_the_wrong_shape_are_refused(fed):
    with pytest.raises(PolicyRefusal, match=r"training bits must be uint8 of shape \(2,\)"):
        send_part(fed, 0, np.arange(10), bits=np.zeros(3, np.uint8))


def test_a_set_up_that_announces_other_rows_than_were_sent_is_refused(fed):
    send_part(fed, 0, np.arange(10))
    send_part(fed, 1, np.arange(10, 20))
    args = {"resume_epoch": -1, "run": run_terms(fed.config)}
    good = setup_rows.rows_digest()
    for ids in (np.arange(10), np.arange(10, 20)):
        setup_rows.add_part(good, ids, np.packbits(np.ones(10, bool), bitorder="little"))
    for rows, match in [
        ({"parts": 3, "ids": 30, "train": 30, "sha256": good.hexdigest()}, "3 parts of 30"),
        ({"parts": 2, "ids": 20, "train": 20, "sha256": "00" * 32}, "digest"),
        ({"parts": 2, "ids": 20}, "announces its rows as"),
    ]:
        with pytest.raises(PolicyRefusal, match=match) as caught:
            fed.call(P.OP_SETUP, ids=np.empty(0, np.int64), args={**args, "rows": rows})
        assert caught.value.rule == "setup rows"
    # ids sent in the set-up call as well as announced parts: which would it be?
    with pytest.raises(PolicyRefusal, match="sends its ids and announces parts too"):
        fed.call(
            P.OP_SETUP,
            ids=np.empty(0, np.int64),
            args={**args, "rows": {"parts": 2, "ids": 20, "train": 20, "sha256": good.hexdigest()}},
            inputs={"train_ids": np.arange(20), "all_ids": np.arange(20)},
        )


def test_presence_is_answered_only_after_set_up_and_only_as_the_policy_allows(fed):
    fresh = fed.party_rounds[fed.parties[0]]
    fresh.told_rows = None
    with pytest.raises(PolicyRefusal, match="setup.present before any setup.rows part"):
        fed.call(
            P.OP_SETUP_PRESENT,
            ids=np.empty(0, np.int64),
            args={"run": run_terms(fed.config), "part": 0},
            to=fed.parties[:1],
            collect=["present"],
        )
    send_part(fed, 0, np.arange(10))  # a new set-up begins: no presence before it is announced
    with pytest.raises(PolicyRefusal, match="setup.present before the set-up that announced"):
        fed.call(
            P.OP_SETUP_PRESENT,
            ids=np.empty(0, np.int64),
            args={"run": run_terms(fed.config), "part": 0},
            collect=["present"],
        )
    from dataclasses import replace

    for r in fed.party_rounds.values():
        r.guard.policy = replace(r.guard.policy, share_presence=False)
    with pytest.raises(PolicyRefusal, match="its policy says no") as caught:
        fed.call(
            P.OP_SETUP_PRESENT,
            ids=np.empty(0, np.int64),
            args={"run": run_terms(fed.config), "part": 0},
            collect=["present"],
        )
    assert caught.value.rule == "share_presence"


def test_a_part_from_another_run_config_or_with_undeclared_tensors_is_refused(fed):
    with pytest.raises(PolicyRefusal) as caught:
        fed.call(
            P.OP_SETUP_ROWS,
            ids=np.empty(0, np.int64),
            args={"run": {**run_terms(fed.config), "min_group": 1}, "part": 0},
            inputs={"all_ids": np.arange(5), "train_bits": np.zeros(1, np.uint8)},
        )
    assert caught.value.rule == "run"
    with pytest.raises(PolicyRefusal) as caught:
        fed.call(
            P.OP_SETUP_ROWS,
            ids=np.empty(0, np.int64),
            args={"run": run_terms(fed.config), "part": 0},
            inputs={"all_ids": np.arange(5), "labels": np.zeros(5)},
        )
    assert caught.value.rule == "role operation"


def test_received_rows_are_the_sent_ids_in_files_of_the_party(tmp_path):
    from securevfl.data.rowarrays import RowArrays

    ids = np.sort(np.random.default_rng(0).choice(10**9, size=1000, replace=False))
    train = ids[np.random.default_rng(1).random(1000) < 0.7]
    got = ReceivedRows(RowArrays(tmp_path))
    digest = setup_rows.rows_digest()
    blocks = [ids[i : i + 128] for i in range(0, 1000, 128)]
    for k, block in enumerate(blocks):
        bits, _ = training_bits(block, train)
        got.add(k, block, bits)
        setup_rows.add_part(digest, block, bits)
    announced = setup_rows.announcement(parts=8, ids=1000, train=len(train), digest=digest)
    got_train, got_all = got.finish(announced)
    assert np.array_equal(got_all, ids) and np.array_equal(got_train, train)
    assert np.array_equal(got.part(7), ids[896:])
    with pytest.raises(RowsRefused, match="after the set-up"):
        got.add(8, ids[:1] + 10**10, np.ones(1, np.uint8))


# ------------------------------------------------------------------------------- DP use counts


class OldCounts:
    """The per-row counts as they were (int64 per row, copied per release): the reference."""

    def __init__(self, universe, base):
        self.ids = np.unique(universe)
        self.counts = np.full(len(self.ids), base, dtype=np.int64)
        self.base = base
        self.recorded = base

    def release(self, ids):
        counts = self.counts.copy()
        np.add.at(counts, np.searchsorted(self.ids, ids), 1)
        new_max = int(counts.max(initial=self.base))
        steps = new_max - self.recorded if new_max > self.recorded else 0
        self.recorded = max(self.recorded, new_max)
        self.counts = counts
        return steps


@pytest.mark.parametrize("mapped", [False, True])
def test_dp_use_counts_and_charges_equal_the_int64_counts_past_255_uses(tmp_path, mapped):
    cfg = config(tmp_path, stream=False, label_dp={"noise_multiplier": 1.0, "clip": 1.0})
    ledger = PrivacyLedger(tmp_path / LEDGER_FILENAME)
    privacy = RolePrivacy(plan=plan_role(cfg, role="active", n_train=200), ledger=ledger)
    universe = np.arange(0, 400, 2, dtype=np.int64)
    if mapped:  # a streamed table's ids: a file, kept as is
        universe.tofile(tmp_path / "ids")
        universe = np.memmap(tmp_path / "ids", dtype=np.int64, mode="r")
    privacy.set_rows(universe)
    assert (privacy._rows is universe) == mapped
    ref = OldCounts(np.asarray(universe), base=0)
    rng = np.random.default_rng(0)
    g = {"g": np.ones((1, 2), dtype=np.float32)}
    charged = []
    for i in range(700):  # row 0 in every release: 700 uses, past uint8 and into uint16
        ids = np.concatenate([[0], rng.choice(np.asarray(universe), size=rng.integers(0, 6))])
        g = {"g": np.ones((len(ids), 2), dtype=np.float32)}
        privacy.release_gradients(g, ids=ids, epoch=i // 100)
        charged.append(ref.release(ids))
    rows = privacy._releases["label_dp"]
    assert rows.uses.dtype == np.uint16  # widened once row 0 passed 255
    assert np.array_equal(rows.counts, ref.counts)
    events = [e for e in ledger.events if isinstance(e, LedgerEvent)]
    assert sum(e.steps for e in events) == sum(charged) == ref.counts.max() >= 700
    assert [e.steps for e in events] == [s for s in charged if s]


def test_a_resumed_role_counts_every_row_from_the_ledgers_steps(tmp_path):
    cfg = config(tmp_path, stream=False, label_dp={"noise_multiplier": 1.0, "clip": 1.0})
    ledger = PrivacyLedger(tmp_path / LEDGER_FILENAME)
    first = RolePrivacy(plan=plan_role(cfg, role="active", n_train=10), ledger=ledger)
    first.set_rows(np.arange(10))
    for epoch in range(3):
        first.release_gradients({"g": np.ones((10, 1), np.float32)}, ids=np.arange(10), epoch=epoch)
    again = RolePrivacy(plan=plan_role(cfg, role="active", n_train=10), ledger=ledger)
    again.set_rows(np.arange(10))
    again.release_gradients({"g": np.ones((2, 1), np.float32)}, ids=np.arange(2), epoch=3)
    rows = again._releases["label_dp"]
    assert rows.counts.tolist() == [4, 4] + [3] * 8
    assert again.steps_spent("label_dp") == 4


def test_sorted_unique_copies_an_unsorted_or_repeated_map_and_keeps_a_sorted_one(tmp_path):
    for values, kept in [([1, 5, 9], True), ([1, 5, 5], False), ([5, 1, 9], False)]:
        np.array(values, dtype=np.int64).tofile(tmp_path / "ids")
        m = np.memmap(tmp_path / "ids", dtype=np.int64, mode="r")
        for given in (m, np.asarray(m), m[:]):  # a map, or a plain view of one
            out = sorted_unique(given)
            assert (out is given) == kept
            assert out.tolist() == sorted(set(values))
    assert sorted_unique([3, 1, 3]).tolist() == [1, 3]
    assert math.isclose(len(sorted_unique(np.empty(0))), 0)


# ------------------------------------------------------------------------------- aligned by PSI


def aligned(tmp_path, *, stream: bool):
    """A LASER federation with `[data] presence` (what `securevfl align` writes)."""
    from securevfl.config import parse_config
    from securevfl.data.table import load_party_table, split_federation
    from securevfl.methods.examples import classification
    from tests.securevfl.conftest import permissive_policy

    raw = classification(tmp_path, method="laser", blocks=3, p_missing=0.3, n=240)
    raw["run"]["seed"] = 1
    raw["train"]["epochs"] = 1
    raw["data"]["stream"] = stream
    cfg0 = parse_config(permissive_policy(copy.deepcopy(raw)), source=tmp_path / "config.toml")
    files = split_federation(cfg0, tmp_path / "split")
    held = {p: set(load_party_table(files[p], cfg0, p).ids.tolist()) for p in cfg0.party_names}
    lines = ["id," + ",".join(cfg0.party_names)] + [
        f"{i}," + ",".join("1" if i in held[p] else "0" for p in cfg0.party_names)
        for i in range(1, 241)
    ]
    (tmp_path / "presence.csv").write_text("\n".join(lines) + "\n")
    raw["data"]["presence"] = "presence.csv"
    return parse_config(permissive_policy(raw), source=tmp_path / "config.toml"), held


def test_an_aligned_streamed_set_up_tells_each_party_only_its_shared_rows_in_parts(
    tmp_path, small_parts, envelopes
):
    feds = {}
    for stream in (False, True):
        cfg, held = aligned(tmp_path / str(stream), stream=stream)
        envelopes.clear()
        feds[stream] = DirectFederation(cfg, run_dir=tmp_path / str(stream) / "run")
    memory, streamed = feds[False], feds[True]
    assert streamed.method.table.streamed and all(
        isinstance(streamed.shared[p], np.memmap) for p in cfg.party_names
    )
    for op, sizes, _ in envelopes:
        if op in P.SETUP_OPS:
            assert max(sizes.values()) <= PART, (op, sizes)
    for p in cfg.party_names:
        told = streamed.party_rounds[p].privacy._rows
        assert np.array_equal(np.asarray(told), memory.party_rounds[p].privacy._rows)
        assert set(np.asarray(told).tolist()) == held[p] & set(range(1, 241))
        assert np.array_equal(np.asarray(streamed.shared[p]), memory.shared[p])
    ids = memory.method.table.ids
    assert np.array_equal(streamed.presence(ids), memory.presence(ids))
    streamed.run()
    assert streamed.history


def test_a_streamed_tables_alignment_file_is_read_in_parts_with_the_same_refusals(
    tmp_path, small_parts
):
    from securevfl.data.table import load_active_table, split_federation
    from securevfl.errors import DataError
    from securevfl.roles.active import load_presence

    cfg, _ = aligned(tmp_path, stream=True)
    table = load_active_table(split_federation(cfg, tmp_path / "again")[cfg.active_name], cfg)
    assert table.streamed
    text = (tmp_path / "presence.csv").read_text()
    lines = text.splitlines()
    (tmp_path / "twice.csv").write_text("\n".join(lines + [lines[3]]) + "\n")  # part 5 repeats
    with pytest.raises(DataError, match="appears more than once"):
        load_presence(tmp_path / "twice.csv", table, cfg.party_names)
    (tmp_path / "none.csv").write_text(lines[0] + "\n")
    with pytest.raises(DataError, match="no alignment for parties"):
        load_presence(tmp_path / "none.csv", table, cfg.party_names)
    with pytest.raises(DataError, match=r"no alignment for parties \['x'\]"):
        load_presence(tmp_path / "presence.csv", table, ["x"])


def _rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_reading_a_mapped_id_file_part_by_part_leaves_its_pages_out_of_memory(tmp_path):
    """`rowarrays.copied` (how set-up reads its id files part by part): the file's pages go
    back after each part, so a whole pass does not leave the file resident (the 5 GB
    federation's parties held the received id file whole before)."""
    from securevfl.data.rowarrays import RowArrays, copied

    arrays = RowArrays(tmp_path)
    spool = arrays.spool("ids", np.int64)
    n, part = 4 << 20, 1 << 17  # 32 MiB of ids, 1 MiB parts
    for start in range(0, n, part):
        spool.write(np.arange(start, start + part, dtype=np.int64))
    ids = spool.array()

    def growth(read) -> int:
        before = _rss_file_kb()
        total = 0
        for start in range(0, n, part):
            total += int(read(start, start + part)[-1])
        assert total == sum(range(part - 1, n, part))
        return _rss_file_kb() - before

    assert growth(lambda a, b: copied(ids, a, b)) < 4 << 10  # KiB: a few parts at most
    # the same pass through the map without handing pages back keeps the file resident
    assert growth(lambda a, b: np.array(ids[a:b])) > 24 << 10
    arrays.close()
