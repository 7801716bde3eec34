"""Real tables: any delimiter, quotes, a BOM, Parquet, string identifiers, NA tokens, column types
inferred or declared, categorical columns one-hot encoded by the party that holds them (fitted on
its training rows, unseen values in `other`), text labels; and a raw public table trained with
no manual preprocessing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from securevfl.config import parse_config
from securevfl.data.columns import (
    OTHER,
    ColumnEncoder,
    LabelCodec,
    infer_kind,
    read_table,
    row_ids,
)
from securevfl.data.table import load_active_table, load_party_table, split_federation
from securevfl.errors import DataError
from tests.securevfl.conftest import permissive_policy, securevfl_cli, write_toml

BANK = Path(__file__).resolve().parents[3] / "shared" / "data" / "bank_marketing.csv"


def test_csv_any_delimiter_quotes_and_bom(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes('\ufeffid;city;income\na1;"Saint-Denis; Réunion";12.5\nb2;Paris;?\n'.encode())
    raw = read_table(path, columns=["city", "income"], id_column="id")
    assert list(raw.cells["city"]) == ["Saint-Denis; Réunion", "Paris"]
    assert list(raw.cells["income"]) == ["12.5", None]  # "?" is an NA token by default
    assert len(set(raw.ids.tolist())) == 2


def test_string_ids_hash_identically_everywhere_and_integers_stay_themselves():
    ids = row_ids(["42", "alice@example.org", "0", "007"], where="t")
    assert ids[0] == 42 and ids[2] == 0
    assert ids[1] < 0 and ids[3] < 0  # "007" is a string id, not 7
    assert row_ids(["alice@example.org"], where="u")[0] == ids[1]
    with pytest.raises(DataError, match="repeated"):
        row_ids(["x", "y", "x"], where="t")


def test_parquet_files_read_like_csv(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": ["u1", "u2"], "job": ["admin", None], "age": [31, 45]})
    pq.write_table(table, tmp_path / "t.parquet")
    raw = read_table(tmp_path / "t.parquet", columns=["job", "age"], id_column="id")
    assert list(raw.cells["job"]) == ["admin", None] and list(raw.cells["age"]) == ["31", "45"]


def test_types_are_inferred_and_categories_fitted_on_training_rows_only():
    assert infer_kind(np.array(["1", "2.5", None], dtype=object)) == "numeric"
    assert infer_kind(np.array(["yes", "no", None], dtype=object)) == "boolean"
    assert infer_kind(np.array(["admin", "3"], dtype=object)) == "categorical"
    enc = ColumnEncoder({"job": "categorical", "ok": "boolean", "age": "numeric"})
    train = {
        "job": np.array(["admin", "cook"], dtype=object),
        "ok": np.array(["yes", "no"], dtype=object),
        "age": np.array(["30", "40"], dtype=object),
    }
    enc.fit(train)
    assert enc.out_columns == ("job=admin", "job=cook", f"job={OTHER}", "ok", "age")
    later = {
        "job": np.array(["pilot", None], dtype=object),
        "ok": np.array(["no", "yes"], dtype=object),
        "age": np.array(["50", None], dtype=object),
    }
    x = enc.transform(later, where="t")
    assert x[0].tolist() == [0, 0, 1, 0, 50]  # unseen in training: the other bucket
    assert np.isnan(x[1, :3]).all() and x[1, 3] == 1 and np.isnan(x[1, 4])  # NA cells
    again = ColumnEncoder({})
    again.load_state_dict(enc.state_dict())
    assert again.out_columns == enc.out_columns


def test_text_labels_become_codes_with_the_positive_class_as_one():
    labels = np.array(["no", "yes", None, "no"], dtype=object)
    codes = LabelCodec("binary", positive="yes").encode(labels, column="y", where="t")
    assert codes[:2].tolist() == [0, 1] and np.isnan(codes[2])
    codes = LabelCodec("multiclass").encode(
        np.array(["b", "a", "c"], dtype=object), column="y", where="t"
    )
    assert codes.tolist() == [1, 0, 2]
    assert LabelCodec("binary").encode(
        np.array(["0", "1"], dtype=object), column="y", where="t"
    ).tolist() == [0, 1]
    with pytest.raises(DataError, match="positive"):
        LabelCodec("binary", positive="maybe").encode(labels, column="y", where="t")


def _text_table(path: Path, n: int = 400, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    jobs = np.array(["admin", "cook", "pilot", "nurse"])
    lines = ["customer,job,city,score,member,income,outcome"]
    for i in range(n):
        job = jobs[rng.integers(4)]
        city = rng.choice(["north", "south", "?"])
        score = rng.normal()
        member = rng.choice(["yes", "no"])
        income = rng.normal() + (1.0 if job in ("pilot", "nurse") else -1.0)
        y = "churn" if (score + income + (member == "yes")) > 0.5 else "stay"
        lines.append(f"cust-{i:05d},{job},{city},{score:.4f},{member},{income:.4f},{y}")
    path.write_text("\n".join(lines) + "\n")


def text_config(tmp_path: Path, **run) -> object:
    _text_table(tmp_path / "data.csv")
    raw = {
        "run": {"method": "splitnn", "aggregation": "mask", "seed": 0, **run},
        "data": {"path": "data.csv", "id": "customer", "label": "outcome", "positive": "churn"},
        "parties": {
            "crm": {"columns": ["job", "city"]},
            "bank": {"columns": ["score", "member", "income"], "types": {"score": "numeric"}},
        },
        "train": {"epochs": 6, "batch_size": 64, "lr": 0.01},
        "model": {"hidden": [16], "width": 4},
    }
    return parse_config(permissive_policy(raw), source=tmp_path / "config.toml")


def test_a_table_with_text_columns_string_ids_and_text_labels_trains(tmp_path):
    from securevfl.direct import DirectFederation

    cfg = text_config(tmp_path)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    crm = fed.party_methods["crm"].table
    assert crm.columns == (
        "job=admin",
        "job=cook",
        "job=nurse",
        "job=pilot",
        f"job={OTHER}",
        "city=north",
        "city=south",
        f"city={OTHER}",
    )
    assert fed.party_methods["bank"].table.columns == ("score", "member", "income")
    metrics = fed.run()
    assert metrics["accuracy"] > 0.75, metrics
    # the encoding is the party's own and travels with its checkpoint
    import torch

    state = torch.load(
        tmp_path / "run" / "checkpoints" / "crm" / "epoch_0005.pt", weights_only=True
    )
    assert state["encoding"]["categories"]["job"] == ["admin", "cook", "nurse", "pilot"]


def test_a_value_that_is_not_a_number_in_a_declared_numeric_column_is_named(tmp_path):
    cfg = text_config(tmp_path)
    lines = (tmp_path / "data.csv").read_text().splitlines()
    cells = lines[1].split(",")
    cells[3] = "zero"  # the score column, declared numeric
    lines[1] = ",".join(cells)
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    paths = split_federation(cfg, tmp_path / "run")
    with pytest.raises(DataError, match=r"column 'score'.*not a number.*categorical"):
        load_party_table(paths["bank"], cfg, "bank")
    active = load_active_table(paths["active"], cfg)
    assert set(np.unique(active.labels)) == {0.0, 1.0}


@pytest.mark.multiprocess
@pytest.mark.skipif(not BANK.exists(), reason="needs ../shared/data/bank_marketing.csv")
def test_bank_marketing_raw_trains_with_mask_within_a_point_of_centralised_logistic_regression(
    tmp_path,
):
    """The raw UCI table (categorical text columns, `unknown` cells, a yes/no label, no id
    column) split across 3 parties by columns, through `securevfl run` with mask aggregation and
    no manual preprocessing, against a centralised logistic regression on the same columns."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    from securevfl.data.table import stratified, train_test_split

    raw = {
        "run": {"method": "splitnn", "aggregation": "mask", "seed": 0},
        "data": {
            "path": str(BANK),
            "id": "@row",
            "label": "y",
            "positive": "yes",
            "test_fraction": 0.2,
        },
        "parties": {
            "client": {"columns": ["age", "job", "marital", "education", "default", "balance"]},
            "loans": {"columns": ["housing", "loan", "contact", "day", "month"]},
            "campaign": {"columns": ["duration", "campaign", "pdays", "previous", "poutcome"]},
        },
        "train": {"epochs": 4, "batch_size": 256, "lr": 0.003},
        "model": {"hidden": [32], "width": 8},
        "network": {"peer_timeout": 30.0},
    }
    config = write_toml(raw, tmp_path / "config.toml")
    done = securevfl_cli("run", str(config), "--out", str(tmp_path / "run"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    fed = json.loads((tmp_path / "run" / "metrics.json").read_text())["test"]

    cfg = parse_config(permissive_policy(raw), source=config)
    table = read_table(
        BANK, columns=[c for p in cfg.parties for c in p.columns], id_column="@row", label="y"
    )
    y = (table.label == "yes").astype(int)
    train, test = train_test_split(
        table.ids, test_fraction=0.2, seed=0, labels=y.astype(float), stratify=stratified(cfg)
    )
    columns = [c for p in cfg.parties for c in p.columns]
    kinds = {c: infer_kind(table.cells[c]) for c in columns}
    cat = [c for c in columns if kinds[c] != "numeric"]
    num = [c for c in columns if kinds[c] == "numeric"]
    xn = np.stack([table.cells[c].astype(float) for c in num], axis=1)
    xc = np.stack([table.cells[c].astype(str) for c in cat], axis=1)
    tr, te = np.isin(table.ids, train), np.isin(table.ids, test)
    onehot = OneHotEncoder(handle_unknown="ignore").fit(xc[tr])
    scale = StandardScaler().fit(xn[tr])
    x = np.hstack([scale.transform(xn), onehot.transform(xc).toarray()])
    central = LogisticRegression(max_iter=2000).fit(x[tr], y[tr]).score(x[te], y[te])
    assert fed["accuracy"] >= central - 0.01, (fed, central)


def test_the_na_tokens_are_the_configs(tmp_path):
    """[data] na replaces the default tokens: listed cells are missing, others are values."""
    (tmp_path / "data.csv").write_text(
        "id,job,age,z,y\n1,cook,30,1,1\n2,-,missing,2,0\n3,?,41,3,1\n4,admin,-,4,0\n"
    )

    def table(na):
        raw = {
            "data": {"path": "data.csv", "id": "id", "label": "y", **na},
            "parties": {"p": {"columns": ["job", "age"]}, "q": {"columns": ["z"]}},
        }
        cfg = parse_config(raw, source=tmp_path / "config.toml")
        t = load_party_table(tmp_path / "data.csv", cfg, "p")
        t.prepare(t.ids)
        return cfg, t

    cfg, t = table({"na": ["-", "missing"]})
    assert cfg.na_tokens == ("-", "missing")
    assert set(t.columns) == {"job=cook", "job=?", "job=admin", f"job={OTHER}", "age"}
    col = {c: j for j, c in enumerate(t.columns)}
    # both cells of id 2 are tokens: a row the party lacks
    assert t.has(np.array([1, 2, 3, 4])).tolist() == [True, False, True, True]
    rows = t.rows(np.array([3, 4]))
    assert rows[0, col["job=?"]] == 1 and rows[0, col["age"]] == 41  # "?" is a value here
    assert np.isnan(rows[1, col["age"]]) and rows[1, col["job=admin"]] == 1
    _, default = table({})  # the defaults do not include "-": age becomes categorical
    assert "age=-" in default.columns and "job=?" not in default.columns
    with pytest.raises(Exception, match=r"\[data\] na"):
        table({"na": "-"})
