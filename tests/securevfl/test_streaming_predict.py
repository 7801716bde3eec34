"""A trained block method scores a table streamed from disk ([data] stream = true) a chunk at a
time: `securevfl.load(run_dir).predict` gives the classes it gives on the same table held in
memory, row for row, while a spy on the streamed tables' reads (rows, labels, `values`) and on
the presence look-ups sees nothing wider than an evaluation chunk. vanilla-vfl's fit picks its
labeled training rows a block at a time (a labeled budget leaves some rows without a label)."""

from __future__ import annotations

import io
import mmap
from pathlib import Path

import numpy as np
import pytest

import securevfl
from securevfl import inproc
from tests.securevfl.test_streaming_methods import (
    BATCH,
    BLOCK,
    CHUNK,
    _active_block,
    _config,
    reads,  # noqa: F401 (a fixture)
)


@pytest.fixture
def seen(reads):  # noqa: F811
    """The streamed tables' widest reads (`test_streaming_methods.reads`)."""
    return reads


def _missing_blocks(raw: dict) -> None:
    """Test rows with missing blocks (each pattern's rows predicted apart), two epochs."""
    raw["train"]["epochs"] = 2
    raw["missing"] = {"train": {"kind": "mcar", "p": 0.3}, "test": {"kind": "mcar", "p": 0.3}}


def _laser(raw: dict) -> None:
    _active_block(raw)
    _missing_blocks(raw)


def _trained(tmp_path: Path, name: str, edit) -> tuple[Path, Path]:
    """(run dir, data file) of method `name`'s example trained in memory."""
    cfg = _config(tmp_path / "train", name, stream=False, edit=edit)
    code, _ = inproc.run_federation(cfg, out=tmp_path / "run", stdout=io.StringIO())
    assert code == 0, (tmp_path / "run" / "logs" / "active.log").read_text()[-3000:]
    return tmp_path / "run", _with_missing_blocks(Path(cfg.data_path), tmp_path / "new.csv")


def _with_missing_blocks(source: Path, out: Path) -> Path:
    """`source`'s rows as new rows (new ids) with party p0's cells empty in every third row and
    p1's in every fourth: the scored rows fall into several presence patterns. (The training
    rows themselves with a block blanked would be refused: at the trained weights, their sum
    over fewer parties differences with training's sums to the blanked party's value.)"""
    lines = source.read_text().splitlines()
    header = lines[0].split(",")
    p0 = [header.index(c) for c in ("X1", "X2")]
    p1 = [header.index(c) for c in ("X3", "X4")]
    at = header.index("ID")
    rows = [lines[0]]
    for i, line in enumerate(lines[1:]):
        cells = line.split(",")
        cells[at] = str(100_000 + i)
        for j in (p0 if i % 3 == 1 else []) + (p1 if i % 4 == 2 else []):
            cells[j] = ""
        rows.append(",".join(cells))
    out.write_text("\n".join(rows) + "\n")
    return out


@pytest.mark.parametrize(
    ("name", "edit"),
    [("laser", _laser), ("plugvfl", _missing_blocks), ("vanilla-vfl", _missing_blocks)],
)
def test_scoring_a_streamed_table_gives_the_classes_in_memory_a_chunk_at_a_time(
    tmp_path, seen, name, edit
):
    run, data = _trained(tmp_path, name, edit)
    out = {}
    for stream in (False, True):
        cfg = _config(tmp_path / f"score-{stream}", name, stream=stream, edit=edit)
        for key in ("rows", "labels", "presence"):
            seen[key].clear()
        seen["values"] = 0
        ids, classes = securevfl.load(run, config=cfg).predict(data)
        out[stream] = (np.asarray(ids), np.array(classes))
    (ids_mem, mem), (ids_str, streamed) = out[False], out[True]
    assert np.array_equal(ids_mem, ids_str)
    assert np.array_equal(mem, streamed)
    assert len(mem) > 4 * CHUNK and set(np.unique(mem)) <= {0, 1}
    assert (mem >= 0).any()
    assert seen["values"] == 0
    assert seen["rows"], "the streamed scoring read no rows"
    for key in ("rows", "labels", "presence"):
        assert max(seen[key], default=0) <= max(BATCH, CHUNK, BLOCK), (key, seen[key][-5:])


def test_a_streamed_prediction_is_written_a_chunk_at_a_time_into_a_file(tmp_path, seen):
    """The classes go to a file of the row cache as each chunk is predicted: no per-row array of
    the scored rows is built in memory (the in-memory path's `np.full` is never called for
    them)."""
    run, data = _trained(tmp_path, "plugvfl", _missing_blocks)
    cfg = _config(tmp_path / "score", "plugvfl", stream=True, edit=_missing_blocks)
    ids, classes = securevfl.load(run, config=cfg).predict(data)
    assert len(classes) == len(ids) > 4 * CHUNK
    base = classes
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    assert isinstance(base, mmap.mmap), "the classes are an array in memory"


def test_a_party_with_no_predictor_leaves_its_rows_unscored_streamed_as_in_memory(
    tmp_path, seen, monkeypatch
):
    """`predict_rows` giving None (a pattern the method leaves out) leaves -1, in both paths."""
    run, data = _trained(tmp_path, "plugvfl", _missing_blocks)
    from securevfl.methods.plugvfl import PlugVFLActive

    original = PlugVFLActive.predict_rows

    def partial(self, ctx, ids, present):
        return None if len(present) < len(self.blocks) else original(self, ctx, ids, present)

    monkeypatch.setattr(PlugVFLActive, "predict_rows", partial)
    got = {}
    for stream in (False, True):
        cfg = _config(tmp_path / f"score-{stream}", "plugvfl", stream=stream, edit=_missing_blocks)
        got[stream] = np.array(securevfl.load(run, config=cfg).predict(data)[1])
    assert np.array_equal(got[False], got[True])
    assert (got[True] == -1).any() and (got[True] >= 0).any()


def test_vanilla_vfl_picks_its_labeled_rows_a_block_at_a_time(tmp_path, seen):
    """With a labeled budget, the streamed fit trains on the labeled rows of the in-memory fit
    (the same metrics), reading no label wider than a block."""
    from tests.securevfl.test_streaming_methods import assert_same

    def edit(raw):
        _missing_blocks(raw)
        raw["missing"]["labeled"] = 120

    out = {}
    for stream in (False, True):
        cfg = _config(tmp_path / f"v-{stream}", "vanilla-vfl", stream=stream, edit=edit)
        for key in ("rows", "labels", "presence"):
            seen[key].clear()
        code, metrics = inproc.run_federation(
            cfg, out=tmp_path / f"v-{stream}" / "run", stdout=io.StringIO()
        )
        assert code == 0
        out[stream] = metrics
    assert_same(out[False], out[True])
    assert max(seen["labels"]) <= max(BATCH, CHUNK, BLOCK) < out[True]["n_train"], seen["labels"]


@pytest.mark.parametrize("own", [False, True])
def test_extra_test_presence_drawn_by_chunk_is_the_presence_drawn_at_once(monkeypatch, own):
    """`eval_test_missing`'s MCAR rows, drawn a chunk at a time from one generator, are what
    `missing.presence` draws for every test row at once (the active block always present)."""
    from types import SimpleNamespace

    from securevfl.config import MissingSpec
    from securevfl.data.missing import presence
    from securevfl.methods.blocks import batches
    from securevfl.methods.blocks.evaluation import BlockEvaluation

    monkeypatch.setattr(batches, "EVAL_BATCH", 7)
    parties = ("a", "b", "c")
    owner = SimpleNamespace(
        config=SimpleNamespace(seed=11, party_names=parties), own_name="act" if own else None
    )
    ids = np.arange(100, 150)
    got = np.concatenate(list(BlockEvaluation.extra_test_presence(owner, 0.4, ids)))
    want = presence(
        MissingSpec(kind="mcar", params=(("p", 0.4),)),
        parties=parties,
        n_rows=len(ids),
        seed=11,
        split="test",
    )
    if own:
        want = np.concatenate([want, np.ones((len(ids), 1), dtype=bool)], axis=1)
    assert got.shape == want.shape and np.array_equal(got, want)
    assert not want.all() and want.any()


def test_eval_test_missing_streams_to_the_metrics_in_memory(tmp_path, seen):
    """The extra MCAR test rates of `[method] eval_test_missing` (plain aggregation) are
    evaluated a chunk at a time on a streamed table, to the metrics in memory."""
    from tests.securevfl.test_streaming_methods import assert_bounded, assert_same, run_both

    def edit(raw):
        _laser(raw)
        raw["run"]["aggregation"] = "plain"
        raw["method"] = {"eval_test_missing": [0.0, 0.5]}

    memory, streamed = run_both(tmp_path, "laser", seen, edit)
    assert_same(memory, streamed)
    assert_bounded(seen, streamed, widest=max(BATCH, CHUNK, BLOCK))
    extra_m, extra_s = memory["extra_tests"], streamed["extra_tests"]
    assert set(extra_m) == set(extra_s) == {"p_test=0", "p_test=0.5"}
    for rate, metrics in extra_m.items():
        for key, value in metrics.items():
            assert extra_s[rate][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (rate, key)
    assert extra_m["p_test=0.5"] != extra_m["p_test=0"]  # the extra rate changed the metrics


@pytest.mark.slow  # 80-100 s; test_predict.py runs `securevfl predict` over processes in CI
@pytest.mark.multiprocess
def test_securevfl_predict_on_a_streamed_table_equals_in_memory_scoring(tmp_path):
    """`securevfl predict` with [data] stream = true (each role's rows from its row cache, the
    block method predicting a chunk at a time) writes the classes that in-process scoring of the
    same model on the table held in memory gives."""
    import csv

    from tests.securevfl.conftest import make_config, securevfl_cli, write_toml
    from tests.securevfl.test_predict import text_raw
    from tests.securevfl.test_real_tables import _text_table

    _text_table(tmp_path / "data.csv", n=300)
    _text_table(tmp_path / "new.csv", n=120, seed=5)
    # new rows, new ids: a training id with the same cells at "crm" is the same row to it, and
    # summing it again without "extra" would isolate extra's training contribution (refused)
    lines = (tmp_path / "new.csv").read_text().replace("cust-", "new-").splitlines()
    blank = (
        [lines[0]]
        + [  # half the new rows lack party "extra"'s cell
            ",".join(c if j != 3 else "" for j, c in enumerate(line.split(","))) if i % 2 else line
            for i, line in enumerate(lines[1:])
        ]
    )
    (tmp_path / "new.csv").write_text("\n".join(blank) + "\n")
    raw = text_raw(method="laser", aggregation="mask")
    raw["parties"]["extra"] = {"columns": ["score"]}
    raw["parties"]["bank"]["columns"] = ["member", "income"]
    raw["missing"] = {"train": {"kind": "mcar", "p": 0.2}}
    raw["data"]["stream"] = True
    raw["train"]["epochs"] = 1  # the scoring path is under test, not the fit
    config = write_toml(raw, tmp_path / "config.toml")
    done = securevfl_cli("run", str(config), "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-2000:]
    done = securevfl_cli("predict", str(tmp_path / "run"), "--data", str(tmp_path / "new.csv"))
    assert done.returncode == 0, done.stderr[-2000:]
    with (tmp_path / "run" / "predict" / "predictions.csv").open() as fh:
        by_id = {r["id"]: float(r["output"]) for r in csv.DictReader(fh)}
    raw["data"]["stream"] = False
    raw["run"]["transport"] = "inproc"
    memory = make_config(raw, tmp_path)
    ids, classes = securevfl.load(tmp_path / "run", config=memory).predict(tmp_path / "new.csv")
    assert sorted(by_id) == sorted(ids.tolist()) and len(ids) == 120
    assert [by_id[i] for i in ids] == [float(c) for c in classes]
    assert set(np.unique(classes)) <= {0, 1}


class _Rows:
    """A table as `write_predictions` / `scored_metrics` see it, recording each read's width."""

    def __init__(self, labels):
        self.labels, self.widths = np.asarray(labels, dtype=float), []

    def texts(self, ids):
        self.widths.append(len(ids))
        return [f"r{i}" for i in ids]

    def label_rows(self, ids):
        self.widths.append(len(ids))
        return self.labels[ids]


def test_predictions_and_class_accuracy_are_written_a_chunk_of_ids_at_a_time(tmp_path, monkeypatch):
    from securevfl.roles import active

    monkeypatch.setattr(active, "SCORE_CHUNK", 4)
    ids = np.arange(10)
    table = _Rows([0, 1, 1, 0, 1, 0, 0, 1, 1, 1])
    classes = np.array([0, 1, 0, 0, 1, 0, 1, 1, 1, 0])
    path = active.write_predictions(tmp_path / "p.csv", table, ids, classes)
    lines = path.read_text().splitlines()
    assert lines[0] == "id,output" and lines[1:] == [
        f"r{i},{float(c)!r}" for i, c in enumerate(classes)
    ]
    assert active.scored_metrics("binary", table, ids, classes) == {"accuracy": 0.7}
    assert max(table.widths) <= 4
    table.labels[7] = np.nan  # a row without its label: no metrics
    assert active.scored_metrics("binary", table, ids, classes) is None
