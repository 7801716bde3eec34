"""Every role of a federation in one thread, with no transport: the roles' own round stages
(`securevfl.roles.rounds`: `PartyRound`, `AggregatorRound`, `ActiveRound`) move the same
envelopes in memory. DP, the ledger, budgets, checkpoints and the min_group rule are exactly
those of a real run. The fast path of `bench/laser_credit.py --transport direct` and the kit of
the method tests, which read what it records.

Not a deployment: every party's data and keys are in one process (ckks is refused: its secret
key would sit next to every ciphertext).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from crypto import MaskingKeyPair
from securevfl.data.table import (
    load_active_table,
    load_party_table,
    split_federation,
    stratified,
    train_test_split,
)
from securevfl.errors import ConfigError
from securevfl.methods import SumSpec, method_spec
from securevfl.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from securevfl.roles.active_round import ActiveRound
from securevfl.roles.checkpoint import latest_epoch, load_checkpoint
from securevfl.roles.rounds import AggregatorRound, PartyRound, calls_of, first_round
from transport import Envelope


class DirectFederation(ActiveRound):
    """An `ActiveContext` whose calls run every party's and the aggregator's round stage in this
    thread.

    Records what a test may want to check: the plaintext and decoded value of every sum
    (`sums`), the aggregator's view (`seen`), released gradients, calls, logs and epoch stats.
    `drop(party, at_round=r)` makes the party vanish at round r (as the aggregator reports a
    lost party). `record=False` keeps none of that (a long benchmark would hold every sum)."""

    def __init__(
        self,
        cfg: Any,
        *,
        run_dir: Path,
        record: bool = True,
        score: Mapping[str, Path] | None = None,
    ) -> None:
        """Split the config's table into `run_dir` and set the federation up for training; with
        `score` (role -> file of new rows), load the trained model in `run_dir` to score them
        (`securevfl.roles.rounds.score`)."""
        if cfg.aggregation == "ckks":
            raise ConfigError(
                "[run] aggregation",
                "the direct path runs every role in one process, which would put the CKKS secret "
                "key next to every ciphertext; use `securevfl run` with ckks",
            )
        import torch

        run_dir = Path(run_dir)
        if score is None:
            paths = split_federation(cfg, run_dir)
            self.tables = {p: load_party_table(paths[p], cfg, p) for p in cfg.party_names}
            self.active_table = load_active_table(paths[cfg.active_name], cfg)
        else:
            from securevfl.roles.party import saved_encoding

            self.tables = {
                p: load_party_table(score[p], cfg, p, encoding=saved_encoding(run_dir, p))
                for p in cfg.party_names
            }
            active_state = load_checkpoint(run_dir, cfg.active_name, self._last(run_dir, cfg))
            self.active_table = load_active_table(
                score[cfg.active_name], cfg, encoding=active_state.get("encoding"), scoring=True
            )
            self.active_table.use_encoding(active_state.get("encoding"))
        spec = method_spec(cfg.method)
        device = torch.device("cpu")
        self.party_methods = {
            p: spec.party_class()(name=p, table=self.tables[p], config=cfg, device=device)
            for p in cfg.party_names
        }
        if score is None:
            train, _ = train_test_split(
                self.active_table.ids,
                test_fraction=cfg.test_fraction,
                seed=cfg.seed,
                labels=self.active_table.labels,
                stratify=stratified(cfg),
            )
            self.active_table.prepare(train)
        method = spec.active_class()(table=self.active_table, config=cfg, device=device)
        if score is not None:
            method.load_state_dict(active_state["method"])
        session = os.urandom(16)
        roles = (cfg.active_name, *cfg.party_names)
        keys = {r: MaskingKeyPair.generate() for r in roles}
        publics = {r: k.public for r, k in keys.items()}
        ledger = PrivacyLedger(run_dir / LEDGER_FILENAME)
        logger = logging.getLogger("securevfl.direct")
        self.party_rounds = {
            p: PartyRound(
                cfg=cfg,
                name=p,
                method=self.party_methods[p],
                run_dir=run_dir,
                ledger=ledger,
                logger=logger,
                session=session,
                mask_keypair=keys[p],
                mask_publics=publics,
                scoring=score is not None,
            )
            for p in cfg.party_names
        }
        self.aggregator = AggregatorRound(cfg=cfg, session=session)
        super().__init__(
            cfg=cfg,
            exchange=self._exchange,
            session=session,
            method=method,
            run_dir=run_dir,
            logger=logger,
            mask_keypair=keys[cfg.active_name],
            mask_publics=publics,
        )
        self.record = record
        self._drops: dict[str, int] = {}
        self._values: dict[tuple[str, str], np.ndarray] = {}
        self.sums: list[tuple[SumSpec, np.ndarray, np.ndarray]] = []
        self.seen: list[tuple[SumSpec, dict[str, np.ndarray]]] = []
        self.released: list[dict[str, np.ndarray]] = []
        self.logs: list[str] = []
        self.calls: list[tuple[str, tuple[str, ...], tuple[SumSpec, ...], np.ndarray]] = []
        if record:
            for p, r in self.party_rounds.items():
                r.observe = lambda spec, value, p=p: self._values.__setitem__(
                    (spec.key, p), np.asarray(value, dtype=np.float64)
                )
        if score is not None:  # scoring: `securevfl.roles.rounds.score(self)` does the set-up
            self.start_epoch = self._last(run_dir, cfg) + 1
            self.start(train_ids=self.active_table.ids, ledger=ledger)
            return
        self.train_ids, self.test_ids = train_test_split(
            self.active_table.ids,
            test_fraction=cfg.test_fraction,
            seed=cfg.seed,
            labels=self.active_table.labels,
            stratify=stratified(cfg),
        )
        self.start(train_ids=self.train_ids, ledger=ledger)
        if cfg.presence_path is not None:  # aligned by PSI: parties learn only shared ids
            from securevfl.roles.active import load_presence

            self.shared = load_presence(cfg.presence_path, self.active_table, cfg.party_names)
        self.setup(train_ids=self.train_ids)
        if not spec.uses_unheld_rows:
            self.train_ids = self.held_rows(self.train_ids)
            self.test_ids = self.held_rows(self.test_ids)

    @staticmethod
    def _last(run_dir: Path, cfg: Any) -> int:
        from securevfl.errors import CheckpointError

        last = latest_epoch(run_dir, cfg.active_name)
        if last is None:
            raise CheckpointError(f"{run_dir} holds no trained model to score with")
        return last

    def drop(self, party: str, *, at_round: int) -> None:
        self._drops[party] = at_round

    def _exchange(self, env: Envelope) -> Envelope:
        call = self.aggregator.open(env)
        start = first_round(env)
        dying = [p for p in call.to if p in self._drops and start >= self._drops[p]]
        if self.record:  # each call of a fused envelope as its own
            alive = tuple(p for p in call.to if p not in dying)
            for part in calls_of(env):
                self.calls.append((part.op, alive, part.sums, np.array(part.ids)))
        replies = {p: self.party_rounds[p].answer(env) for p in call.to if p not in dying}
        if dying:  # as the aggregator does: the others ran the call, the dead one never answered
            for p in dying:
                self._drops.pop(p)
            return self.aggregator.lost(call, dying[:1], delivered=True)
        accepted: dict[str, dict[str, Any]] = {spec.key: {} for spec in call.sums}
        for p, reply in replies.items():
            for key, value in self.aggregator.accept(call, reply).items():
                accepted[key][p] = value
        if self.record:
            for spec in call.sums:
                self.seen.append(
                    (
                        spec,
                        {
                            p: replies[p].tensors[spec.key]
                            for p in spec.group
                            if spec.key in replies[p].tensors
                        },
                    )
                )
        return self.aggregator.result(call, replies, accepted)

    def call(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any] | None = None,
        inputs: Mapping[str, np.ndarray] | None = None,
        sums: Sequence[SumSpec] = (),
        to: Sequence[str] | None = None,
        collect: Sequence[str] = (),
    ) -> dict[str, np.ndarray]:
        self._values.clear()
        out = super().call(op, ids=ids, args=args, inputs=inputs, sums=sums, to=to, collect=collect)
        if self.record:
            for spec in sums:
                plain = np.sum([self._values[(spec.key, p)] for p in spec.group], axis=0)
                self.sums.append((spec, plain, out[spec.key]))
        return out

    def release_gradients(self, grads, *, epoch, ids=None):
        assert ids is not None and all(len(v) == len(ids) for v in grads.values())
        if self.record:
            self.released.append({k: np.array(v) for k, v in grads.items()})
        return super().release_gradients(grads, epoch=epoch, ids=ids)

    def log(self, message: str) -> None:
        self.logs.append(message)
        super().log(message)

    # helpers
    def fit(self) -> None:
        self.method.fit(self, train_ids=self.train_ids)
        self.flush()  # an update held back for a next call that never came

    def run(self) -> dict[str, Any]:
        self.fit()
        return self.method.evaluate(self, ids=self.test_ids)


class TrainedModel:
    """A trained run, loaded for in-process scoring (notebooks, tests): the same round stages as
    `securevfl predict`, every role in this thread (`securevfl.load(run_dir)`)."""

    def __init__(self, run_dir: Path, *, config: Any = None) -> None:
        from securevfl.launcher import load_run_config

        self.run_dir = Path(run_dir).resolve()
        self.config = config if config is not None else load_run_config(self.run_dir)[0]

    def predict(self, data: Path) -> tuple[np.ndarray, np.ndarray]:
        """(ids as written, outputs) for the rows of table `data` some passive party holds."""
        import tempfile

        from securevfl.data.table import split_rows
        from securevfl.roles.active_round import score

        with tempfile.TemporaryDirectory() as tmp:
            files = split_rows(self.config, Path(data), Path(tmp))
            fed = DirectFederation(self.config, run_dir=self.run_dir, record=False, score=files)
            ids, outputs = score(fed)
            return fed.method.table.texts(ids), outputs


def load(run_dir: Path, *, config: Any = None) -> TrainedModel:
    """A trained run (its last checkpoints), ready to score new rows in this process."""
    return TrainedModel(run_dir, config=config)


__all__ = ["DirectFederation", "TrainedModel", "load"]
