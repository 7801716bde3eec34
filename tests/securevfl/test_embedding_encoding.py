"""Categorical columns as learned embeddings (`[data]` / `[parties.NAME]` / `[active]`
``categorical = "embedding"``): the party codes each column over its training categories
(`other` for unseen values, a missing code for NA), embeds the codes in front of its own model,
trains the embeddings with its optimizer (DP-SGD included), saves them and the code mapping in
its checkpoint, and sends exactly what the method sends with one-hot columns. Methods whose model
needs one input column per category refuse it at config load."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from securevfl.config import categorical_encoding, parse_config
from securevfl.data.columns import CODE_SUFFIX, OTHER, ColumnEncoder
from securevfl.errors import ConfigError
from tests.securevfl.conftest import permissive_policy

BANK = Path(__file__).resolve().parents[3] / "shared" / "data" / "bank_marketing.csv"

JOBS = [f"job{k:02d}" for k in range(12)]
MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
OUTCOMES = ["success", "failure", "other", "unknown"]


def bank_like_table(path: Path, *, n: int = 1500, seed: int = 0, start: int = 0) -> None:
    """A Bank-Marketing-like table: numeric, yes/no and categorical columns (12 jobs, 12
    months, 4 outcomes, some `?` cells), a yes/no label driven by per-category effects."""
    rng = np.random.default_rng(seed)
    effects = np.random.default_rng(1234)  # the same effects for every file of the task
    job_effect = effects.normal(0, 1.2, len(JOBS))
    month_effect = effects.normal(0, 1.2, len(MONTHS))
    outcome_effect = np.array([2.0, -0.5, 0.0, -0.2])
    lines = ["customer,age,job,marital,balance,housing,month,duration,poutcome,y"]
    for i in range(n):
        job, month, out = rng.integers(len(JOBS)), rng.integers(12), rng.integers(4)
        age = rng.normal(40, 10)
        balance = rng.normal()
        duration = rng.exponential(1.0)
        housing = rng.random() < 0.5
        marital = rng.choice(["married", "single", "divorced"])
        logit = (
            job_effect[job]
            + month_effect[month]
            + outcome_effect[out]
            + 0.8 * (duration - 1.0)
            + 0.5 * balance
            - 0.4 * housing
        )
        y = "yes" if rng.random() < 1 / (1 + np.exp(-2 * logit)) else "no"
        job_text = "?" if rng.random() < 0.03 else JOBS[job]
        lines.append(
            f"cust-{start + i:05d},{age:.1f},{job_text},{marital},{balance:.4f},"
            f"{'yes' if housing else 'no'},{MONTHS[month]},{duration:.3f},{OUTCOMES[out]},{y}"
        )
    path.write_text("\n".join(lines) + "\n")


BANK_LIKE_RAW = {
    "run": {"method": "splitnn", "aggregation": "mask", "seed": 0},
    "data": {"path": "data.csv", "id": "customer", "label": "y", "positive": "yes"},
    "parties": {
        "client": {"columns": ["age", "job", "marital"]},
        "loans": {"columns": ["balance", "housing", "month"]},
        "campaign": {"columns": ["duration", "poutcome"]},
    },
    "train": {"epochs": 5, "batch_size": 64, "lr": 0.01},
    "model": {"hidden": [16], "width": 4},
}


def bank_like_config(tmp_path: Path, *, n: int = 1500, categorical: str = "embedding", **edit):
    if not (tmp_path / "data.csv").exists():
        bank_like_table(tmp_path / "data.csv", n=n)
    raw = copy.deepcopy(BANK_LIKE_RAW)
    raw["data"]["categorical"] = categorical
    for section, values in edit.items():
        raw.setdefault(section, {}).update(values)
    return parse_config(permissive_policy(raw), source=tmp_path / "config.toml")


# ------------------------------------------------------------------------------- the encoding


def test_codes_are_training_categories_then_other_and_missing_cells_stay_missing():
    kinds = {"job": "categorical", "age": "numeric", "member": "boolean"}
    enc = ColumnEncoder(kinds, categorical="embedding").fit(
        {
            "job": np.array(["pilot", "cook", None, "admin", "cook"], dtype=object),
            "age": np.array(["30", "41", "52", "25", "33"], dtype=object),
            "member": np.array(["yes", "no", "no", "yes", None], dtype=object),
        }
    )
    assert enc.categories["job"] == ["admin", "cook", "pilot"]  # sorted, NA not a category
    assert enc.out_columns == (f"job{CODE_SUFFIX}", "age", "member")
    assert enc.code_columns() == ((0, "job", 5),)  # missing, 3 categories, other
    got = enc.transform(
        {
            "job": np.array(["cook", "admin", "nurse", None, "pilot"], dtype=object),
            "age": np.array(["1", "2", "3", "4", "5"], dtype=object),
            "member": np.array(["yes", None, "no", "yes", "no"], dtype=object),
        },
        where="t",
    )
    # admin 1, cook 2, pilot 3, unseen "nurse" -> other 4, NA -> NaN (read as code 0)
    assert got[[0, 1, 2, 4], 0].tolist() == [2.0, 1.0, 4.0, 3.0] and np.isnan(got[3, 0])
    assert got[:, 1].tolist() == [1, 2, 3, 4, 5]
    assert np.isnan(got[1, 2]) and got[[0, 2], 2].tolist() == [1.0, 0.0]


def test_the_code_mapping_round_trips_and_a_one_hot_state_is_unchanged():
    cells = {"job": np.array(["b", "a", "c"], dtype=object)}
    enc = ColumnEncoder({"job": "categorical"}, categorical="embedding").fit(cells)
    state = enc.state_dict()
    assert state == {
        "kinds": {"job": "categorical"},
        "categories": {"job": ["a", "b", "c"]},
        "categorical": "embedding",
    }
    restored = ColumnEncoder({"job": "categorical"})  # one-hot until the state says otherwise
    restored.load_state_dict(state)
    new = {"job": np.array(["c", "zzz", None], dtype=object)}
    assert np.array_equal(
        restored.transform(new, where="t"), enc.transform(new, where="t"), equal_nan=True
    )
    onehot = ColumnEncoder({"job": "categorical"}).fit(cells)
    assert "categorical" not in onehot.state_dict()  # checkpoints written before read the same
    assert onehot.out_columns[-1] == f"job={OTHER}" and onehot.code_columns() == ()
    with pytest.raises(ValueError, match="categorical encoding"):
        ColumnEncoder({"job": "categorical"}, categorical="hashing")


def test_the_embedding_front_embeds_codes_and_a_missing_cell_is_zero_without_gradient():
    import torch

    from securevfl.methods.blocks.embedding import EmbeddingInput, embedding_dim, keep_codes
    from securevfl.methods.blocks.nets import Standardizer

    # columns: numeric, code (missing, 3 categories, other), numeric
    rows = np.array([[1.0, 2.0, 10.0], [3.0, np.nan, 20.0], [5.0, 4.0, 30.0]])
    enc = ColumnEncoder(
        {"a": "numeric", "job": "categorical", "b": "numeric"}, categorical="embedding"
    )
    enc.categories = {"job": ["x", "y", "z"]}
    table = type("T", (), {"encoder": enc, "columns": enc.out_columns})()
    scaler = keep_codes(Standardizer().fit(rows), table)
    x = scaler.transform(rows)
    assert x[:, 1].tolist() == [2.0, 0.0, 4.0]  # codes as they are; missing -> 0
    assert np.allclose(x[:, 0], (rows[:, 0] - 3.0) / np.std(rows[:, 0]))  # the others scaled
    front = EmbeddingInput(width=3, columns=((1, "job", 5),), dims=[3], seed=7)
    xt = torch.from_numpy(x)
    out = front(xt)
    weight = front.tables[0].weight
    assert out.shape == (3, 2 + 3) and front.out_dim == 5
    assert torch.equal(out[:, :2], xt[:, [0, 2]])
    assert torch.equal(out[0, 2:], weight[2])
    assert torch.equal(out[1, 2:], torch.zeros(3)) and torch.equal(out[2, 2:], torch.zeros(3))
    out.sum().backward()
    # missing (code 0) and `other` (code 4) are the zero vector, never trained
    assert torch.equal(weight.grad[0], torch.zeros(3))
    assert torch.equal(weight.grad[4], torch.zeros(3))
    assert weight.grad[2].abs().sum() > 0
    # the stated rule: min(16, round(1.6 n^0.56)) of the n codes; [model] embedding_dim fixes it
    assert [embedding_dim(n) for n in (2, 5, 14, 100, 10_000)] == [2, 4, 7, 16, 16]
    assert embedding_dim(100, fixed=3) == 3


# -------------------------------------------------------------------------------- the config


def test_auto_takes_the_method_default_and_a_role_key_overrides_data(tmp_path):
    cfg = bank_like_config(tmp_path, categorical="auto")
    assert categorical_encoding(cfg, "client") == "onehot"  # splitnn's default: one-hot
    cfg = bank_like_config(tmp_path, categorical="auto", model={"embedding_dim": 3}, parties={})
    assert cfg.embedding_dim == 3
    raw = copy.deepcopy(BANK_LIKE_RAW)
    raw["data"]["categorical"] = "embedding"
    raw["parties"]["loans"]["categorical"] = "onehot"
    cfg = parse_config(permissive_policy(raw), source=tmp_path / "config.toml")
    assert [categorical_encoding(cfg, p) for p in cfg.party_names] == [
        "embedding",
        "onehot",
        "embedding",
    ]
    raw["parties"]["loans"]["categorical"] = "hashed"
    with pytest.raises(ConfigError, match=r"\[parties.loans\] categorical.*'hashed'.*embedding"):
        parse_config(permissive_policy(raw), source=tmp_path / "config.toml")


def _one_hot_only_raw(method: str) -> dict:
    from securevfl.methods import method_spec

    spec = method_spec(method)
    task = spec.tasks[0]
    raw = {
        "run": {
            "method": method,
            "aggregation": "mask" if spec.runs_on_sums else "plain",
            "seed": 0,
        },
        "data": {"path": "data.csv", "id": "customer", "label": "y", "task": task},
        "parties": {
            "client": {"columns": ["age", "job"], "types": {"job": "categorical"}},
            "loans": {"columns": ["balance", "month"]},
        },
    }
    return raw


@pytest.mark.parametrize("method", ["vfem", "ridge", "cc-ols", "tabvfl", "tabvfl-le", "false-vfl"])
def test_a_one_hot_only_method_refuses_embedding_naming_method_column_and_fix(tmp_path, method):
    from securevfl.methods import method_spec

    assert method_spec(method).encodings == ("onehot",)
    raw = _one_hot_only_raw(method)
    raw["parties"]["client"]["categorical"] = "embedding"
    with pytest.raises(ConfigError) as err:
        parse_config(permissive_policy(raw), source=tmp_path / "config.toml")
    text = str(err.value)
    assert "[parties.client] categorical" in text
    assert f"method {method!r}" in text and "'job'" in text
    assert 'categorical = "onehot"' in text and "one input column per category" in text
    # [data] categorical says which key to fix; undeclared columns are named among the role's
    raw = _one_hot_only_raw(method)
    raw["data"]["categorical"] = "embedding"
    del raw["parties"]["client"]["types"]
    with pytest.raises(ConfigError, match=r"\[data\] categorical.*among 'age', 'job'"):
        parse_config(permissive_policy(raw), source=tmp_path / "config.toml")
    raw["data"]["categorical"] = "auto"  # the method's own default: accepted
    cfg = parse_config(permissive_policy(raw), source=tmp_path / "config.toml")
    assert categorical_encoding(cfg, "client") == "onehot"


# ---------------------------------------------------------------------------- in a federation


def _embeddings(fed, party: str) -> dict:
    from securevfl.methods.blocks.embedding import embedding_weights

    method = fed.party_methods[party]
    model = getattr(method, "encoder", None) or method.models
    return embedding_weights(model)


def test_the_embedding_is_trained_and_the_party_sends_what_it_sends_with_one_hot(tmp_path):
    from securevfl.direct import DirectFederation

    seen = {}
    for categorical in ("onehot", "embedding"):
        d = tmp_path / categorical
        d.mkdir()
        cfg = bank_like_config(d, n=300, categorical=categorical, train={"epochs": 1})
        fed = DirectFederation(cfg, run_dir=d / "run")
        if categorical == "embedding":
            client = fed.party_methods["client"].table
            assert client.columns == ("age", f"job{CODE_SUFFIX}", f"marital{CODE_SUFFIX}")
            before = _embeddings(fed, "client")
            assert set(before) == {"job", "marital"}
            assert before["job"].shape == (len(JOBS) + 2, 7)  # 14 codes: round(1.6 * 14^0.56)
        fed.run()
        seen[categorical] = fed
    after = _embeddings(seen["embedding"], "client")
    for column in ("job", "marital"):
        moved = (after[column] - before[column]).abs().sum(dim=1)
        assert (moved[1:-1] > 0).all(), column  # every training category's embedding trained
        # a missing cell and `other` (no training row has it) read as the zero vector
        assert moved[0] == 0 and moved[-1] == 0
    # the same calls, sums and contributions (kind, shape) with either encoding
    one, emb = seen["onehot"], seen["embedding"]
    assert [(op, group, sums) for op, group, sums, _ in one.calls] == [
        (op, group, sums) for op, group, sums, _ in emb.calls
    ]
    assert len(one.seen) == len(emb.seen) > 0
    for (spec_a, by_party_a), (spec_b, by_party_b) in zip(one.seen, emb.seen, strict=True):
        assert spec_a == spec_b and sorted(by_party_a) == sorted(by_party_b)
        for p in by_party_a:
            a, b = np.asarray(by_party_a[p]), np.asarray(by_party_b[p])
            assert a.shape == b.shape and a.dtype == b.dtype
    # the checkpoint holds the embeddings and the code mapping
    import torch

    state = torch.load(
        tmp_path / "embedding" / "run" / "checkpoints" / "client" / "epoch_0000.pt",
        weights_only=True,
    )
    assert state["encoding"]["categorical"] == "embedding"
    assert torch.equal(state["method"]["encoder"]["0.tables.0.weight"], after["job"])


@pytest.mark.parametrize("method", ["splitnn", "laser", "vanilla-vfl"])
def test_a_trained_model_scores_new_rows_as_it_scored_them_in_process(tmp_path, method):
    """The embeddings and the code mapping travel with the checkpoint: `securevfl.load` (the
    round stages of `securevfl predict`) scores rows as the trained federation does, to 1e-6,
    at passive parties and (splitnn, LASER) at the active one; an unseen category is `other`."""
    import securevfl
    from securevfl.data.columns import row_ids
    from securevfl.direct import DirectFederation

    bank_like_table(tmp_path / "data.csv", n=500)
    own = method != "vanilla-vfl"  # vanilla-vfl refuses active columns
    cfg = bank_like_config(
        tmp_path,
        run={"method": method},
        train={"epochs": 2},
        active={"columns": ["poutcome"], "categorical": "embedding"} if own else {},
        parties={"campaign": {"columns": ["duration"]}} if own else {},
    )
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    fed.run()
    if own:
        assert fed.method.table.columns == (f"poutcome{CODE_SUFFIX}",)
    # new rows: the test rows again, as written
    lines = (tmp_path / "data.csv").read_text().splitlines()
    ids = row_ids([line.split(",", 1)[0] for line in lines[1:]], where="t")
    test = set(fed.test_ids.tolist())
    kept = [line for line, i in zip(lines[1:], ids, strict=True) if int(i) in test]
    (tmp_path / "new.csv").write_text("\n".join([lines[0], *kept]) + "\n")
    texts, outputs = securevfl.load(tmp_path / "run", config=cfg).predict(tmp_path / "new.csv")
    assert len(texts) == len(kept)
    trained = fed.method.predict(fed, ids=row_ids(list(texts), where="t"))
    np.testing.assert_allclose(outputs, trained, atol=1e-6, rtol=0)
    # values never seen in training are `other`, which reads as a missing cell does
    for name, word in (("a.csv", "astronaut"), ("b.csv", "?")):
        (tmp_path / name).write_text(
            "\n".join([lines[0], *(line.replace(",job03,", f",{word},") for line in kept)]) + "\n"
        )
    _, a = securevfl.load(tmp_path / "run", config=cfg).predict(tmp_path / "a.csv")
    _, b = securevfl.load(tmp_path / "run", config=cfg).predict(tmp_path / "b.csv")
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("method", ["splitnn", "laser"])
def test_dp_sgd_trains_the_embeddings_with_the_rest_of_the_party_model(tmp_path, method):
    """The embeddings are parameters of the party's model: under [parties.NAME] dp_sgd they
    are in the DP-SGD optimizer (clipped and noised per sample by Opacus) and every step is
    charged to the ledger."""
    from securevfl.direct import DirectFederation
    from securevfl.methods.blocks.embedding import EmbeddingInput
    from securevfl.privacy.ledger import LEDGER_FILENAME, LedgerEvent, PrivacyLedger

    cfg = bank_like_config(
        tmp_path,
        n=300,
        run={"method": method},
        train={"epochs": 1},
        privacy={"delta": 1e-4},
        parties={
            "client": {
                "columns": ["age", "job", "marital"],
                "dp_sgd": {"noise_multiplier": 1.0, "clip": 1.0},
            }
        },
    )
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    party = fed.party_methods["client"]
    before = _embeddings(fed, "client")
    fed.run()
    after = _embeddings(fed, "client")
    assert not torch_equal(before["job"][1:-1], after["job"][1:-1])
    fronts = [m for m in _model_of(party).modules() if isinstance(m, EmbeddingInput)]
    weights = {id(t.weight) for front in fronts for t in front.tables}
    optimizers = [party.optimizer] if method == "splitnn" else party._optimizers()
    optimized = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    assert fronts and weights <= optimized
    events = [
        e
        for e in PrivacyLedger.read(tmp_path / "run" / LEDGER_FILENAME)
        if isinstance(e, LedgerEvent) and e.mechanism == "dp_sgd"
    ]
    assert events and {e.role for e in events} == {"client"}


def _model_of(party):
    return getattr(party, "encoder", None) or party.models


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_a_bank_like_table_reaches_the_one_hot_accuracy(tmp_path):
    """splitnn, same seed (plain sums, for speed: the slow Bank Marketing test uses mask):
    embeddings learn the per-category effects as well as one-hot columns do (a centralised
    logistic regression on one-hot columns gives the scale of what is learnable)."""
    from sklearn.linear_model import LogisticRegression

    from securevfl.direct import DirectFederation

    bank_like_table(tmp_path / "data.csv", n=2000)
    accuracy = {}
    for categorical in ("onehot", "embedding"):
        cfg = bank_like_config(
            tmp_path, categorical=categorical, train={"epochs": 5}, run={"aggregation": "plain"}
        )
        fed = DirectFederation(cfg, run_dir=tmp_path / f"run-{categorical}", record=False)
        accuracy[categorical] = fed.run()["accuracy"]
    lines = (tmp_path / "data.csv").read_text().splitlines()[1:]
    cells = [line.split(",") for line in lines]
    design, y = _one_hot_design(cells)
    n_train = int(0.8 * len(y))
    reference = LogisticRegression(max_iter=2000).fit(design[:n_train], y[:n_train])
    central = reference.score(design[n_train:], y[n_train:])
    assert accuracy["onehot"] > central - 0.06, (accuracy, central)
    print(f"bank-like: {accuracy}, centralised logistic regression {central:.4f}")
    assert accuracy["embedding"] > accuracy["onehot"] - 0.03, (accuracy, central)


def _one_hot_design(cells: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
    columns = list(zip(*cells, strict=True))
    parts = []
    for j in (1, 4, 7):  # age, balance, duration
        v = np.array(columns[j], dtype=float)
        parts.append(((v - v.mean()) / v.std())[:, None])
    for j in (2, 3, 5, 6, 8):  # job, marital, housing, month, poutcome
        levels = sorted(set(columns[j]))
        parts.append(np.array([[c == lv for lv in levels] for c in columns[j]], dtype=float))
    return np.concatenate(parts, axis=1), np.array([c == "yes" for c in columns[9]], dtype=int)


@pytest.mark.slow
@pytest.mark.skipif(not BANK.exists(), reason="needs ../shared/data/bank_marketing.csv")
def test_bank_marketing_splitnn_embedding_against_one_hot(tmp_path):
    """Measurement (run with -m slow -s): the raw UCI Bank Marketing table split across 3
    parties, splitnn with mask aggregation and the same seed, categorical columns one-hot vs
    embedded; a centralised logistic regression on one-hot columns gives the reference."""
    import time

    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    from securevfl.data.columns import infer_kind, read_table
    from securevfl.direct import DirectFederation

    raw = {
        "run": {"method": "splitnn", "aggregation": "mask", "seed": 0},
        "data": {"path": str(BANK), "id": "@row", "label": "y", "positive": "yes"},
        "parties": {
            "client": {"columns": ["age", "job", "marital", "education", "default", "balance"]},
            "loans": {"columns": ["housing", "loan", "contact", "day", "month"]},
            "campaign": {"columns": ["duration", "campaign", "pdays", "previous", "poutcome"]},
        },
        "train": {"epochs": 4, "batch_size": 256, "lr": 0.003},
        "model": {"hidden": [32], "width": 8},
    }
    results = {}
    for categorical in ("onehot", "embedding"):
        raw["data"]["categorical"] = categorical
        cfg = parse_config(permissive_policy(copy.deepcopy(raw)), source=tmp_path / "c.toml")
        started = time.perf_counter()
        fed = DirectFederation(cfg, run_dir=tmp_path / categorical, record=False)
        metrics = fed.run()
        width = sum(len(fed.party_methods[p].table.columns) for p in cfg.party_names)
        results[categorical] = (metrics, width, time.perf_counter() - started)
    columns = [c for p in cfg.parties for c in p.columns]
    table = read_table(BANK, columns=columns, id_column="@row", label="y")
    y = (table.label == "yes").astype(int)
    kinds = {c: infer_kind(table.cells[c]) for c in columns}
    cat = [c for c in columns if kinds[c] != "numeric"]
    num = [c for c in columns if kinds[c] == "numeric"]
    xn = np.stack([table.cells[c].astype(float) for c in num], axis=1)
    xc = np.stack([table.cells[c].astype(str) for c in cat], axis=1)
    tr, te = np.isin(table.ids, fed.train_ids), np.isin(table.ids, fed.test_ids)
    onehot = OneHotEncoder(handle_unknown="ignore").fit(xc[tr])
    x = np.hstack([StandardScaler().fit(xn[tr]).transform(xn), onehot.transform(xc).toarray()])
    central = LogisticRegression(max_iter=2000).fit(x[tr], y[tr]).score(x[te], y[te])
    for categorical, (metrics, width, seconds) in results.items():
        print(
            f"bank marketing splitnn mask {categorical}: accuracy {metrics['accuracy']:.4f} "
            f"roc_auc {metrics['roc_auc']:.4f} f1 {metrics['f1']:.4f}, {width} input columns "
            f"at the parties, {seconds:.0f} s"
        )
    print(f"bank marketing centralised logistic regression (one-hot): accuracy {central:.4f}")
    assert results["embedding"][0]["accuracy"] >= central - 0.01, (results, central)
    assert results["embedding"][0]["accuracy"] >= results["onehot"][0]["accuracy"] - 0.01


def test_a_streamed_table_gives_the_codes_a_table_in_memory_gives(tmp_path):
    from securevfl.data.table import load_party_table, split_federation

    cfg = bank_like_config(tmp_path, n=300)
    paths = split_federation(cfg, tmp_path / "run")
    tables = [
        load_party_table(paths["client"], cfg, "client", stream=s, cache_dir=tmp_path)
        for s in (False, True)
    ]
    for t in tables:
        t.prepare(t.ids[: len(t.ids) // 2])
    memory, streamed = tables
    assert streamed.streamed and not memory.streamed
    assert (
        memory.columns == streamed.columns == ("age", f"job{CODE_SUFFIX}", f"marital{CODE_SUFFIX}")
    )
    assert np.array_equal(memory.rows(memory.ids), streamed.rows(memory.ids), equal_nan=True)
    assert memory.encoding_state() == streamed.encoding_state()


@pytest.mark.slow  # real processes, ~1-2 min on a shared machine; `securevfl.load` above runs the
@pytest.mark.multiprocess  # same round stages in-process in CI
def test_securevfl_predict_with_embeddings_equals_in_process_scoring(tmp_path):
    """`securevfl predict` (one process per role, each loading its own checkpoint: embeddings
    and code mapping) writes what `securevfl.load` computes, to 1e-6."""
    import csv

    import securevfl
    from tests.securevfl.conftest import securevfl_cli, write_toml
    from tests.securevfl.test_predict import text_raw
    from tests.securevfl.test_real_tables import _text_table

    _text_table(tmp_path / "data.csv", n=300)
    _text_table(tmp_path / "new.csv", n=60, seed=5)
    raw = text_raw()
    raw["data"]["categorical"] = "embedding"
    config = write_toml(raw, tmp_path / "config.toml")
    done = securevfl_cli("run", str(config), "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-2000:]
    done = securevfl_cli("predict", str(tmp_path / "run"), "--data", str(tmp_path / "new.csv"))
    assert done.returncode == 0, done.stderr[-2000:]
    with (tmp_path / "run" / "predict" / "predictions.csv").open() as fh:
        by_id = {r["id"]: float(r["output"]) for r in csv.DictReader(fh)}
    model = securevfl.load(tmp_path / "run")
    assert categorical_encoding(model.config, "crm") == "embedding"
    ids, outputs = model.predict(tmp_path / "new.csv")
    assert sorted(by_id) == sorted(ids.tolist()) and len(ids) == 60
    assert np.allclose([by_id[i] for i in ids], outputs.reshape(-1), atol=1e-6, rtol=0)
