"""Every role of a federation in one thread: the method stages and the real secure-sum stages
of the config's aggregation (plain, mask), with no transport. The fast path of
`bench/laser_credit.py --transport direct` (the same numbers as `transport = "inproc"`, bit
for bit, in about half the time) and the kit of the LASER-VFL tests, which read what it
records.
Not a deployment: every party's data and keys are in one process."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crypto import MaskingKeyPair
from securevfl.data.table import (
    load_active_table,
    load_party_table,
    split_federation,
    train_test_split,
)
from securevfl.methods import PartyDropped, SumSpec, call_recipients, method_spec
from securevfl.secure_sum import SumSession, backend


class DirectFederation:
    """An `ActiveContext` running every party's method stage in this thread, with the real
    secure-sum stages of the config's aggregation (plain or mask) and no transport.

    Records what a test may want to check: the plaintext and decoded value of every sum
    (`sums`), the aggregator's view (`seen`), released gradients, logs and epoch stats.
    `drop(party, at_round=r)` makes the party vanish at round r (PartyDropped, as the roles
    raise it). `record=False` keeps none of that (a long benchmark run would hold every sum
    of every epoch in memory)."""

    def __init__(self, cfg, *, run_dir: Path, record: bool = True) -> None:
        self.config = cfg
        self.record = record
        self.start_epoch = 0
        paths = split_federation(cfg, run_dir)
        self.tables = {p: load_party_table(paths[p], cfg, p) for p in cfg.party_names}
        self.active_table = load_active_table(paths[cfg.active_name], cfg)
        spec = method_spec(cfg.method)
        device = torch.device("cpu")
        self.party_methods = {
            p: spec.party(name=p, table=self.tables[p], config=cfg, device=device)
            for p in cfg.party_names
        }
        self.method = spec.active(table=self.active_table, config=cfg, device=device)
        session = os.urandom(16)
        keys = {p: MaskingKeyPair.generate() for p in cfg.party_names}
        publics = {p: k.public for p, k in keys.items()}

        def sum_session(name: str, keypair=None) -> SumSession:
            return SumSession(
                name=name,
                session=session,
                min_group=cfg.min_group,
                frac_bits=cfg.frac_bits,
                bound=cfg.bound,
                mask_keypair=keypair,
                mask_publics=publics,
            )

        b = backend(cfg.aggregation)
        self.party_stages = {p: b.party(sum_session(p, keys[p])) for p in cfg.party_names}
        self.aggregator = b.aggregator(sum_session("aggregator"))
        self.active_stage = b.active(sum_session(cfg.active_name))
        self.round = 0
        self._parties = list(cfg.party_names)
        self._drops: dict[str, int] = {}
        self.sums: list[tuple[SumSpec, np.ndarray, np.ndarray]] = []
        self.seen: list[tuple[SumSpec, dict[str, np.ndarray]]] = []
        self.released: list[dict[str, np.ndarray]] = []
        self.logs: list[str] = []
        self.history: list[dict[str, float]] = []
        self.calls: list[tuple[str, tuple[str, ...], tuple[SumSpec, ...], np.ndarray]] = []
        self.train_ids, self.test_ids = train_test_split(
            self.active_table.ids,
            test_fraction=cfg.test_fraction,
            seed=cfg.seed,
            labels=self.active_table.labels,
            stratify=True,
        )
        for m in self.party_methods.values():
            m.setup(args={}, inputs={"train_ids": self.train_ids, "all_ids": self.active_table.ids})
        held = self.presence(self.active_table.ids).any(axis=1)
        self.train_ids = self.train_ids[held[self.active_table.positions(self.train_ids)]]
        self.test_ids = self.test_ids[held[self.active_table.positions(self.test_ids)]]

    # ActiveContext
    @property
    def parties(self) -> tuple[str, ...]:
        return tuple(self._parties)

    def drop(self, party: str, *, at_round: int) -> None:
        self._drops[party] = at_round

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
        to = call_recipients(self.config, op, sums, to, self._parties)
        self.round += 1
        for p in to:
            assert p in self._parties, f"{op} sent to lost party {p}"
        dying = [p for p in to if p in self._drops and self.round >= self._drops[p]]
        if self.record:
            self.calls.append(
                (op, tuple(p for p in to if p not in dying), tuple(sums), np.array(ids))
            )
        outs = {
            p: self.party_methods[p].handle(
                op, ids=np.asarray(ids), args=dict(args or {}), inputs=dict(inputs or {})
            )
            for p in to
            if p not in dying
        }
        if dying:  # as the roles do: the others ran the call, the dead one never answered
            self._parties.remove(dying[0])
            raise PartyDropped(dying[0], delivered=True)
        result = {}
        for spec in sums:
            values = {p: np.asarray(outs[p][spec.tensor], dtype=np.float64) for p in spec.group}
            protected = {
                p: self.party_stages[p].protect(v, round=self.round, group=spec.group, key=spec.key)
                for p, v in values.items()
            }
            if self.record:
                self.seen.append((spec, {p: a[spec.key] for p, a in protected.items()}))
            combined = self.aggregator.combine(protected, group=spec.group, key=spec.key)
            shape = next(iter(values.values())).shape
            result[spec.key] = self.active_stage.reveal(
                combined, group=spec.group, key=spec.key, shape=shape
            )
            if self.record:
                self.sums.append((spec, np.sum(list(values.values()), axis=0), result[spec.key]))
        return result

    def presence(self, ids: np.ndarray) -> np.ndarray:
        return np.stack([self.tables[p].has(ids) for p in self.config.party_names], axis=1)

    def release_gradients(self, grads, *, epoch, ids=None):
        assert ids is not None and all(len(v) == len(ids) for v in grads.values())
        if self.record:
            self.released.append({k: np.array(v) for k, v in grads.items()})
        return {k: np.asarray(v, dtype=np.float32) for k, v in grads.items()}

    def epoch_done(self, epoch, *, stats):
        self.history.append({"epoch": epoch, **dict(stats)})

    def log(self, message: str) -> None:
        self.logs.append(message)

    # helpers
    def fit(self) -> None:
        self.method.fit(self, train_ids=self.train_ids)

    def run(self) -> dict[str, Any]:
        self.fit()
        return self.method.evaluate(self, ids=self.test_ids)
