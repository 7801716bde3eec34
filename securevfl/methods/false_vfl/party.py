"""FALSE-VFL's passive party: its encoder q(h | x^k), decoder p(x^k | h) and (variant mnar) mask
model, trained in stage 1 from the gradients of the sums it contributed to.

Operations (declared in `securevfl.methods.false_vfl.OPERATIONS`):

* ``encode`` (args: train): this party's expert of the posterior;
* ``decode`` (args: train; input h [n, S, d_h]): its log-likelihood per row and sample, and in
  training its gradient in h;
* ``backward`` (inputs ``d_<sum>``: d loss / d each sum it contributed to, on the rows of one
  training step, which may span several encode/decode batches): one Adam step.

Two kinds of call (the active party's `batching`):

* **mixed** (input ``present`` [n, K], uint8, columns `config.party_names`: which party holds
  which row): the sums are over every passive party and this party contributes exact zeros on
  the rows it lacks (mnar: the mask log-likelihood of a decoder sample there, which reads none of
  its data). `check_call` refuses such a call unless every sum is over every passive party, this
  party's column of ``present`` is exactly the rows it holds, and (secure modes) every row has at
  least the policy's `min_group` present parties. Every party checks its own column of the same
  authenticated call, so each row's sum holds the data of at least `min_group` parties, and the
  same row is always summed over the same contributors (no differencing).
* **pattern** (no ``present``): encode refuses rows this party does not hold (every member of the
  group contributes data to every row); decode's arg ``observed`` says whether this party is
  among the rows' present parties (mar asks only parties that are; mnar also the others, which
  contribute the mask log-likelihood of a decoder sample).

A training step is one or several batches and one backward over all their rows: the party keeps
each batch's graph until that backward, which covers them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from securevfl.lazy import torch
from securevfl.methods.base import PartyMethod, UnknownOperation
from securevfl.methods.blocks.nets import Standardizer, derived_seed, float_tensors, scaled_rows

METHOD = "false-vfl"


class FalseVFLPartyMethod(PartyMethod):
    """One passive party of FALSE-VFL (see the module docstring)."""

    def setup(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        from securevfl.methods.false_vfl.model import FalseVFLParty, config_from_options

        opts = self.config.options
        train = np.asarray(inputs["train_ids"])
        # z-scores from the training rows this party holds (the paper z-scores every block)
        # a table streamed from disk: fitted from a column summary, scaled batch by batch
        self.scaler = Standardizer().fit_table(self.table, self.table.held_ids(train))
        self.model_cfg = config_from_options(opts)
        self.model = FalseVFLParty(
            len(self.table.columns),
            self.model_cfg,
            seed=derived_seed(self.init_seed(), METHOD),
            name=self.name,
        ).to(self.device)
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=opts.stage1_lr, weight_decay=opts.weight_decay
        )
        self.first = "prec_mu" if self.model_cfg.aggregation == "poe" else "mu"
        self._pending: list[dict[str, Any]] = []  # the graphs of the current training step

    # --- operations

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        train = bool(args.get("train", False))
        mine = self._own_presence(ids, inputs)
        if op == "encode":
            return self._encode(ids, train=train, mine=mine)
        if op == "decode":
            if "h" not in inputs:
                raise ValueError("decode needs the input h")
            if mine is None:  # pattern batches: every row or none
                observed = self.name in args.get("observed", ())
                mine = np.full(len(ids), observed)
                if not self.model_cfg.mnar and not observed:
                    raise ValueError(
                        "variant mar asks a party to decode only rows it holds (observed)"
                    )
            return self._decode(ids, inputs["h"], train=train, mine=mine)
        if op == "backward":
            return self._backward(ids, inputs)
        raise UnknownOperation(METHOD, op)

    def check_call(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any],
        inputs: Mapping[str, np.ndarray],
        groups: Sequence[tuple[str, ...]],
    ) -> str | None:
        """A mixed call (input ``present``) is refused unless this party's own config says
        `batching = "mixed"`; it must sum over every passive party, mark this party
        present on exactly the rows it holds and, in secure modes, give every row at least the
        policy's `min_group` present parties (see the module docstring)."""
        if op not in ("encode", "decode") or "present" not in inputs:
            return None
        if self.config.options.batching != "mixed":
            return (
                f"{op}: a mixed call (with per-row presence) while this party's own config says "
                f"[method] batching = {self.config.options.batching!r}: it agreed to sums over "
                "the parties present on every row of a batch only"
            )
        names = list(self.config.party_names)
        present = np.asarray(inputs["present"])
        ids = np.asarray(ids, dtype=np.int64)
        if present.shape != (len(ids), len(names)) or not np.isin(present, (0, 1)).all():
            return (
                f"{op}: present must be 0/1 of shape [{len(ids)}, {len(names)}] (rows x "
                f"{names}), got {present.dtype} {present.shape}"
            )
        for group in groups:
            if set(group) != set(names):
                return (
                    f"{op}: a sum with per-row presence is over {sorted(group)}, not every "
                    f"passive party {sorted(names)}: a row could keep fewer contributors than "
                    "`present` says"
                )
        held = self.table.has(ids)
        wrong = np.flatnonzero(present[:, names.index(self.name)].astype(bool) != held)
        if len(wrong):
            row = int(ids[wrong[0]])
            return (
                f"{op}: `present` marks party {self.name!r} "
                f"{'absent' if held[wrong[0]] else 'present'} on row {row}, which it "
                f"{'holds' if held[wrong[0]] else 'does not hold'} ({len(wrong)} such rows)"
            )
        min_group = self.config.party(self.name).policy.min_group
        if self.config.aggregation != "plain" and len(ids):
            count = present.sum(1)
            low = int(np.argmin(count))
            if count[low] < min_group:
                return (
                    f"{op}: row {int(ids[low])} has {int(count[low])} present parties; this "
                    f"party's policy needs at least {min_group} data contributors to every row "
                    "of a sum"
                )
        return None

    def _own_presence(self, ids: np.ndarray, inputs: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """This party's column of the input ``present`` (bool [n]), or None (pattern calls)."""
        if "present" not in inputs:
            return None
        present = np.asarray(inputs["present"])
        names = list(self.config.party_names)
        if present.shape != (len(ids), len(names)):
            raise ValueError(f"present must be [{len(ids)}, {len(names)}], got {present.shape}")
        mine = present[:, names.index(self.name)].astype(bool)
        if not self.table.has(ids[mine]).all():
            raise ValueError(f"present marks party {self.name!r} on rows it does not hold")
        return mine

    def _held_inputs(self, ids: np.ndarray, op: str) -> Any:
        """This party's z-scored block of `ids`; refuses rows it does not hold, so that every
        member of a sum's group really contributes its data to every row."""
        held = self.table.has(ids)
        if not held.all():
            raise ValueError(
                f"{op} of {int((~held).sum())} rows party {self.name!r} does not hold: a FALSE-VFL "
                "sum is over the parties holding its rows"
            )
        return torch.from_numpy(scaled_rows(self, ids)).to(self.device)

    def _inputs(self, ids: np.ndarray, mine: np.ndarray, op: str) -> tuple[Any, Any]:
        """(x [n, d_k], present [n]): this party's z-scored rows where `mine`, zeros elsewhere
        (never read: the model masks them)."""
        x = torch.zeros(len(ids), self.model.d_in, device=self.device)
        if mine.any():
            x[torch.as_tensor(mine, device=self.device)] = self._held_inputs(ids[mine], op)
        return x, torch.as_tensor(mine, device=self.device)

    def _encode(self, ids: np.ndarray, *, train: bool, mine: np.ndarray | None) -> dict:
        if mine is None:  # pattern batches: rows it must all hold
            x = self._held_inputs(ids, "encode")
            present = torch.ones(len(ids), dtype=torch.bool, device=self.device)
        else:
            x, present = self._inputs(ids, mine, "encode")
        self.model.train(train)
        with torch.set_grad_enabled(train):
            contrib = self.model.posterior_contributions(x, present)
        out = {k: contrib[k] for k in (self.first, "prec")}
        if train:  # its graph waits for the decode and the step's backward
            self._pending.append({"ids": ids.copy(), "posterior": out})
        return {k: v.detach().cpu().numpy() for k, v in out.items()}

    def _decode(
        self, ids: np.ndarray, h: np.ndarray, *, train: bool, mine: np.ndarray
    ) -> dict[str, np.ndarray]:
        cfg = self.model_cfg
        h_t = torch.tensor(np.asarray(h, dtype=np.float32), device=self.device)
        if h_t.dim() != 3 or h_t.shape[0] != len(ids) or h_t.shape[2] != cfg.d_h:
            raise ValueError(f"h must be [{len(ids)}, S, {cfg.d_h}], got {tuple(h_t.shape)}")
        x, present = self._inputs(ids, mine, "decode")
        if not train:
            with torch.no_grad():
                c = self.model.loglik(x, present, h_t)
            return {"loglik": c.cpu().numpy()}
        last = self._pending[-1] if self._pending else None
        if last is not None and "loglik" not in last and np.array_equal(last["ids"], ids):
            pending = last  # the decode of the last encode
        elif mine.any():
            raise RuntimeError("a training decode of rows that were not the last encode")
        else:  # mnar, pattern batches: the mask terms of rows this party lacks, no encode
            pending = {"ids": ids.copy()}
            self._pending.append(pending)
        self.model.train()
        h_leaf = h_t.requires_grad_(True)
        c = self.model.loglik(x, present, h_leaf)
        # c of row i, sample j depends on h[i, j] only: this gradient is the whole Jacobian
        (dc_dh,) = torch.autograd.grad(c.sum(), h_leaf, retain_graph=True, allow_unused=True)
        dc_dh = torch.zeros_like(h_leaf) if dc_dh is None else dc_dh
        pending["loglik"] = c
        return {"loglik": c.detach().cpu().numpy(), "dloglik_dh": dc_dh.detach().cpu().numpy()}

    def _backward(self, ids: np.ndarray, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Apply d loss / d each sum to the graphs of the step's batches (rows `ids` cover them;
        rows of batches this party was not in carry no gradient for it) and step once."""
        pending, self._pending = self._pending, []
        if not pending or any("loglik" not in entry for entry in pending):
            raise RuntimeError("backward without a complete training encode/decode")
        wanted = {"d_loglik"} | (
            {f"d_{self.first}", "d_prec"} if any("posterior" in e for e in pending) else set()
        )
        if set(inputs) != wanted:
            raise ValueError(
                f"backward carries {sorted(inputs)}; this party needs {sorted(wanted)}"
            )
        order = {int(r): i for i, r in enumerate(ids.tolist())}
        grads = float_tensors(inputs, self.device)
        tensors, outs = [], []
        for entry in pending:
            try:
                rows = torch.as_tensor(
                    [order[int(r)] for r in entry["ids"]], dtype=torch.long, device=self.device
                )
            except KeyError:
                raise ValueError("backward rows do not cover the step's batches") from None
            for key, out in {"loglik": entry["loglik"], **entry.get("posterior", {})}.items():
                g = grads[f"d_{key}"][rows].to(self.device)
                if g.shape != out.shape:
                    raise ValueError(f"d_{key} has shape {tuple(g.shape)}, not {tuple(out.shape)}")
                tensors.append(out)
                outs.append(g)
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(tensors, outs)
        self.optimizer.step()
        return {}

    # --- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "generator": self.model.generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])  # `scaled_rows` sees the new statistics
        self.model.generator.set_state(state["generator"])
        self._pending = []
