"""A passive party's stage of vfem and the OLS comparators: answers with its block's per-row
terms (to secure sums) and keeps its parameters."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from securevfl.methods.base import PartyMethod, UnknownOperation
from securevfl.methods.vfem.block import BlockState, VfemInputError, row_namer

log = logging.getLogger(__name__)


class BlockRegressionParty(PartyMethod):
    """A passive party's stage of vfem and the OLS comparators: answers with its block's
    per-row terms (to secure sums) and keeps its parameters."""

    method_label = "vfem"

    def setup(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        self.block: BlockState | None = None
        self.prepared_ids: np.ndarray | None = None
        self.design_ids: np.ndarray | None = None
        self._pending_state: Mapping[str, Any] | None = None

    def check_call(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any],
        inputs: Mapping[str, np.ndarray],
        groups: Sequence[tuple[str, ...]],
    ) -> str | None:
        """A model's standardisation is fixed by its first `prepare` (its rows, `intercept`,
        `standardize`), kept in its checkpoint: a later `prepare` of the same model (in this
        session, or after a resume) with other rows or flags is refused. It would change
        what the party releases at the same beta in a way the active party chooses, and
        the difference of two sums of a row over the same parties, one per standardisation,
        would be this party's term alone (beta'((x - c) / s) - beta'x: the other parties'
        cancel)."""
        del inputs, groups
        if op != "prepare":
            return None
        pinned = self._pinned_prepare()
        if pinned is None or _prepare_key(ids, args) == pinned:
            return None
        return (
            "'prepare' with other rows or standardisation than this model's first (kept in "
            "its checkpoint): the same coefficients under another standardisation would "
            "difference to this party's terms alone"
        )

    def _pinned_prepare(self) -> list | None:
        pending = self._pending_state
        if pending is not None and pending.get("prepare") is not None:
            return list(pending["prepare"])
        return getattr(self, "_prepare_pin", None)

    def _values(self, ids: np.ndarray) -> np.ndarray:
        out = np.full((len(ids), len(self.table.columns)), np.nan)
        held = self.table.has(ids)
        if held.any():
            out[held] = self.table.rows(ids[held])
        return out

    def _check_rows(self, ids: np.ndarray) -> BlockState:
        if self.block is None:
            raise RuntimeError(f"party {self.name!r}: operation before 'prepare'")
        if self.design_ids is None or not np.array_equal(ids, self.design_ids):
            raise RuntimeError(f"party {self.name!r}: rows differ from the current design")
        return self.block

    def _sums(self, out: dict[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
        cfg = self.config
        if cfg.aggregation == "mask":
            for value in out.values():
                worst = float(np.max(np.abs(value))) if np.size(value) else 0.0
                if not worst <= cfg.bound:
                    raise VfemInputError(
                        f"party {self.name!r}: {what} reaches {worst:.4g}, beyond [secure] bound "
                        f"= {cfg.bound:g}; raise the bound (keeping log2(bound) + frac_bits "
                        "<= 58), or, if the values grew over the iterations, the iteration "
                        "diverges: lower [method] eta"
                    )
        return out

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if op == "prepare":
            ids = np.asarray(ids)
            if getattr(self.table, "streamed", False):
                log.info(
                    "%s: %s holds this party's block of its %d training rows in memory (%.1f "
                    "MB): every iteration sums per-row terms over all of them; the table "
                    "stays streamed for everything else",
                    self.name,
                    self.method_label,
                    len(ids),
                    len(ids) * max(len(self.table.columns), 1) * 8 / 1e6,
                )
            # a row with some of this party's cells empty is refused, naming the row: the M-step
            # would need 1/tau_i on rows it holds (see BlockState)
            self.block = BlockState(
                owner=f"party {self.name!r}",
                columns=self.table.columns,
                values=self._values(ids),
                intercept=bool(args["intercept"]),
                standardize=bool(args["standardize"]),
                row_name=row_namer(self.table, ids),
            )
            self.prepared_ids = np.asarray(ids)
            self._prepare_pin = _prepare_key(ids, args)  # `check_call` holds later ones to it
            if self._pending_state is not None:
                self.block.load_state_dict(self._pending_state)
                self._pending_state = None
            return {}
        if op == "design":
            if self.block is None or self.prepared_ids is None:
                raise RuntimeError(f"party {self.name!r}: 'design' before 'prepare'")
            pos = np.searchsorted(self.prepared_ids, ids)
            pos = np.minimum(pos, len(self.prepared_ids) - 1)
            if not np.array_equal(self.prepared_ids[pos], ids):
                raise RuntimeError(f"party {self.name!r}: design rows outside the prepared rows")
            self.block.set_design(str(args["kind"]), pos, reset=bool(args["reset"]))
            self.design_ids = np.asarray(ids)
            return {"spectrum": self.block.spectrum()}
        if op == "estep":
            return self._sums(self._check_rows(ids).estep(), "a per-row partial predictor")
        if op == "mstep":
            block = self._check_rows(ids)
            w = inputs.get("w")
            block.mstep(
                e=np.asarray(inputs["e"], dtype=np.float64),
                w=np.zeros(len(ids)) if w is None else np.asarray(w, dtype=np.float64),
                sigma2=float(args["sigma2"]),
                eta=float(args["eta"]),
            )
            return {}
        if op == "revert":
            self._check_rows(ids).revert()
            return {}
        if op == "probe_setup":
            self._check_rows(ids).probe_setup(d=int(args["d"]), h=float(args["h"]))
            return {}
        if op == "probe_estep":
            out = self._check_rows(ids).probe_estep([int(j) for j in args["cols"]])
            return self._sums(out, "a probe's per-row partial predictor")
        if op == "probe_mstep":
            block = self._check_rows(ids)
            e = np.asarray(inputs["e"], dtype=np.float64)
            w = inputs.get("w")
            block.probe_mstep(
                [int(j) for j in args["cols"]],
                e=e,
                w=np.zeros_like(e) if w is None else np.asarray(w, dtype=np.float64),
                sigma2=np.asarray(inputs["sigma2"], dtype=np.float64),
                eta=float(args["eta"]),
            )
            return {}
        if op == "sem_sums":
            out = self._check_rows(ids).sem_sums(intercept=bool(args["intercept"]))
            return self._sums(out, "the SEM Gram matrix")
        if op == "shift":
            block = self._check_rows(ids)
            return self._sums({"shift": np.array([block.shift()])}, "the intercept shift")
        if op == "finish":
            block = self._check_rows(ids)
            ginv = inputs.get("ginv")
            return block.sem_finish(None if ginv is None else np.asarray(ginv, dtype=np.float64))
        if op == "predict":
            if self.block is None:
                raise RuntimeError(f"party {self.name!r}: 'predict' before 'prepare'")
            return self._sums({"m": self.block.predict(self._values(ids))}, "a per-row prediction")
        raise UnknownOperation(self.method_label, op)

    def state_dict(self) -> dict[str, Any]:
        if self.block is None:
            return {}
        return {**self.block.state_dict(), "prepare": getattr(self, "_prepare_pin", None)}

    def version_state(self) -> dict[str, Any]:
        """beta and the standardisation: on the rows this party holds its released terms are
        beta'(x - center) / scale, and `prepare` (the active party's call: its rows, its
        `standardize` and `intercept`) sets center and scale, so the same beta under another
        standardisation is another version (else the two sums of one row would difference to
        this party's term alone). mu and Sigma, which an M-step moves even at step size 0,
        only enter for rows it lacks, so counting them would let a step that leaves beta
        where it is open a new version."""
        if self.block is None:
            return {}
        b = self.block
        return {"beta": b.params.beta, "center": b.center, "scale": b.scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # applied when the active party re-sends 'prepare' after a resume
        self._pending_state = dict(state) if state else None


def _prepare_key(ids: np.ndarray, args: Mapping[str, Any]) -> list:
    """What fixes a block's standardisation: a digest of the rows `prepare` names, and its
    `intercept` and `standardize` flags."""
    rows = hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes()).hexdigest()
    return [rows, bool(args.get("intercept")), bool(args.get("standardize"))]
