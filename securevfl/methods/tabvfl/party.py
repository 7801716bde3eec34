"""The guests' stages of tabvfl and tabvfl-le: a passive party's columns, standardised on its
training rows, through its part of the split TabNet.

A guest keeps the graph of its last training forward until the host's backward for the same
rows arrives, one optimizer per phase (fine-tuning starts with fresh Adam moments, as the
paper's code), and a copy of its best model of the phase (`keep_best` / `restore_best`). It
draws its own masks from its own generator; validation masks come from a generator re-seeded
per call, so early stopping compares epochs on the same masks.

Everything a guest draws (its weights, among them the secret FC layer, its masks, its
validation masks) comes from one seed of 256 bits that it takes from the operating system's
CSPRNG at set-up and keeps to itself (its checkpoint holds the seed and the weights, so a resume
continues with them): the config's seed, which every role holds, plays no part. ``[method]
guest_seed`` (tests only) replaces it with a number in the config, and the guest then records
in the ledger that its model is known to whoever has the config.
"""

from __future__ import annotations

import copy
import logging
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from securevfl.lazy import torch
from securevfl.methods.base import PartyMethod, UnknownOperation
from securevfl.methods.blocks.nets import make_optimizer

logger = logging.getLogger(__name__)

SEED_BITS = 256  # of a guest's own seed, from the OS CSPRNG


def tabnet_config(opts: Any) -> Any:
    """The model's TabNetConfig from `[method]` options (imports the model code)."""
    from securevfl.methods.tabvfl.tabnet import TabNetConfig

    return TabNetConfig(
        n_d=opts.n_d,
        n_a=opts.n_a,
        n_steps=opts.n_steps,
        gamma=opts.gamma,
        virtual_batch_size=opts.virtual_batch_size,
        momentum=opts.momentum,
        mask_type=opts.mask_type,
        pretraining_ratio=opts.pretraining_ratio,
        lambda_sparse=opts.lambda_sparse,
    )


class ColumnScaler:
    """The paper's preprocessing at the party: numeric columns standard-scaled on its training
    rows; binary columns (one-hot levels, booleans: only 0/1 on those rows) kept as 0/1; empty
    cells 0 after scaling (the training mean)."""

    def fit(self, values: np.ndarray) -> ColumnScaler:
        with np.errstate(all="ignore"):
            finite = np.where(np.isnan(values), 0.0, values)
            binary = np.all((finite == 0.0) | (finite == 1.0), axis=0)
            mean = np.nan_to_num(np.nanmean(values, axis=0)) if len(values) else 0.0
            std = np.nan_to_num(np.nanstd(values, axis=0)) if len(values) else 1.0
        d = values.shape[1]
        self.mean = np.where(binary, 0.0, mean * np.ones(d))
        self.std = np.where(binary | (std * np.ones(d) <= 1e-12), 1.0, std * np.ones(d))
        return self

    def fit_table(self, table: Any, ids: np.ndarray) -> ColumnScaler:
        """`fit(table.rows(ids))`; a table streamed from disk is read a block at a time (its
        column summary, and which columns hold only 0/1), equal to rounding (~1e-15)."""
        if not getattr(table, "streamed", False):
            return self.fit(table.rows(ids))
        d = len(table.columns)
        binary = np.ones(d, dtype=bool)
        for block in table.row_blocks(ids):
            finite = np.where(np.isnan(block), 0.0, block)
            binary &= np.all((finite == 0.0) | (finite == 1.0), axis=0)
        summary = table.column_summary(ids)
        mean, std = np.nan_to_num(summary["mean"]), np.nan_to_num(summary["std"])
        self.mean = np.where(binary, 0.0, mean)
        self.std = np.where(binary | (std <= 1e-12), 1.0, std)
        return self

    def transform(self, values: np.ndarray) -> np.ndarray:
        return np.nan_to_num((values - self.mean) / self.std).astype(np.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"mean": torch.as_tensor(self.mean), "std": torch.as_tensor(self.std)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.mean = np.asarray(state["mean"], dtype=np.float64)
        self.std = np.asarray(state["std"], dtype=np.float64)


class _GuestBase(PartyMethod):
    """What both guests share: scaling, the pending forward, optimizers, best copies,
    checkpoints. Subclasses build `self.model` and answer the operations."""

    method_name = "tabvfl"

    def setup(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        from securevfl.methods.tabvfl.tabnet import seeded_generator

        train = np.asarray(inputs["train_ids"])
        self.scaler = ColumnScaler().fit_table(self.table, self.table.held_ids(train))
        self.cfg = tabnet_config(self.config.options)
        self.own_seed = seed = self._own_seed()
        self.model = self._build(
            len(self.table.columns),
            init=seeded_generator(seed, self.method_name, "guest", self.name, "init"),
            masks=seeded_generator(seed, self.method_name, "guest", self.name, "mask"),
        ).to(self.device)
        self.optimizers = {
            "pretrain": make_optimizer(self.model.parameters(), self.config),
            "finetune": make_optimizer(self.model.finetune_parameters(), self.config),
        }
        self.best: dict[str, Any] | None = None
        self.pending: tuple[str, np.ndarray, Any] | None = None  # (op, ids, what it kept)

    def _own_seed(self) -> int:
        """The seed of everything this guest draws: fresh from the OS CSPRNG, so that no other
        role can rebuild its model from the config; `[method] guest_seed` (tests only) instead,
        recorded in the ledger as leaving the model unprotected."""
        fixed = getattr(self.config.options, "guest_seed", None)
        if fixed is None:
            return secrets.randbits(SEED_BITS)
        reason = (
            f"[method] guest_seed = {fixed}: this guest's weights (its secret FC layer among "
            "them) and masks are drawn from a seed in the config, so whoever has the config "
            "rebuilds them and inverts what the guest sends; they protect nothing (for tests "
            "only)"
        )
        self.record_config_seed(what=f"{self.method_name} guest model", reason=reason)
        return int(fixed)

    def _build(self, d_k: int, *, init: Any, masks: Any) -> Any:
        raise NotImplementedError

    def _x(self, ids: np.ndarray) -> Any:
        return torch.from_numpy(self.scaler.transform(self.table.rows(ids))).to(self.device)

    def _valid_masks(self, rows: int, args: Mapping[str, Any]) -> Any:
        from securevfl.methods.tabvfl.tabnet import seeded_generator

        g = seeded_generator(self.own_seed, "valid", self.name, int(args.get("chunk", 0)))
        p = torch.full((rows, self.model_width()), self.cfg.pretraining_ratio)
        return torch.bernoulli(p, generator=g).to(self.device)

    def model_width(self) -> int:
        return len(self.table.columns)

    def _kept(self, op: str, ids: np.ndarray) -> Any:
        if (
            self.pending is None
            or self.pending[0] != op
            or not np.array_equal(self.pending[1], ids)
        ):
            raise RuntimeError(f"no {op!r} of these rows to continue from")
        return self.pending[2]

    def _dp(self, name: str, value: np.ndarray, ids: np.ndarray) -> np.ndarray:
        # clear releases do not pass the runtime's embedding DP (it noises sum contributions):
        # a guest applies it here to what it sends per row, with the same per-row accounting
        privacy = getattr(self, "privacy", None)
        if privacy is None:
            return value
        return privacy.release_contributions({name: value}, ids=ids)[name]

    def _best(self, op: str) -> dict[str, np.ndarray]:
        if op == "keep_best":
            self.best = copy.deepcopy(self.model.state_dict())
        else:
            if self.best is not None:
                self.model.load_state_dict(self.best)
            self.best = None
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
            "scaler": self.scaler.state_dict(),
            "mask_rng": self.model.mask_generator.get_state(),
            "own_seed": self.own_seed,  # its validation masks after a resume
            "best": self.best,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        for k, o in self.optimizers.items():
            o.load_state_dict(state["optimizers"][k])
        self.scaler.load_state_dict(state["scaler"])
        self.model.mask_generator.set_state(state["mask_rng"])
        # a checkpoint from before guests drew their own seeds: its run drew all from [run] seed
        self.own_seed = int(state.get("own_seed", self.config.seed))
        self.best = state["best"]
        self.pending = None


class TabVFLParty(_GuestBase):
    """Guest k of tabvfl: BN_k, the secret FC_k (d_k -> d_k), its decoder slice Rec_k."""

    method_name = "tabvfl"

    def _build(self, d_k: int, *, init: Any, masks: Any) -> Any:
        from securevfl.methods.tabvfl.split import TabVFLGuest
        from securevfl.methods.tabvfl.tabnet import decoder_slices

        m_k = decoder_slices(self.cfg.n_d, len(self.config.party_names))[
            self.config.party_names.index(self.name)
        ]
        return TabVFLGuest(d_k, m_k, self.cfg, init_generator=init, mask_generator=masks)

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        train = bool(args.get("train", False))
        if op in ("pretrain_forward", "forward"):
            x = self._x(ids)
            self.model.train(train)
            with torch.set_grad_enabled(train):
                if op == "forward":
                    obf = None
                elif train:
                    obf = self.model.obfuscation_mask(len(ids)).to(self.device)
                else:
                    obf = self._valid_masks(len(ids), args)
                h = self.model.embed(x, obf)
            self.pending = (op, np.array(ids), (x, obf, h))
            out = {"h": self._dp("h", h.detach().cpu().numpy(), ids)}
            if obf is not None:
                out["prior"] = (1.0 - obf).cpu().numpy().astype(np.float32)
            return out
        if op == "pretrain_reconstruct":
            x, obf, _ = self._kept("pretrain_forward", ids)
            r = torch.tensor(np.asarray(inputs["r"], dtype=np.float32), device=self.device)
            if not train:
                with torch.no_grad():
                    loss = self.model.reconstruction_loss(r, x, obf)
                return {"loss": np.array([float(loss)], dtype=np.float32)}
            r.requires_grad_(True)
            self.optimizers["pretrain"].zero_grad(set_to_none=True)
            loss = self.model.reconstruction_loss(r, x, obf)
            loss.backward()  # into Rec_k and r_k; BN_k and FC_k wait for dL/dh_k
            return {
                "loss": np.array([float(loss.detach())], dtype=np.float32),
                "grad_r": r.grad.cpu().numpy(),
            }
        if op in ("pretrain_backward", "backward"):
            forward = "pretrain_forward" if op == "pretrain_backward" else "forward"
            _, _, h = self._kept(forward, ids)
            grad = torch.tensor(np.asarray(inputs["grad"], dtype=np.float32), device=self.device)
            if grad.shape != h.shape:
                raise ValueError(f"gradient shape {tuple(grad.shape)} != h {tuple(h.shape)}")
            phase = "pretrain" if op == "pretrain_backward" else "finetune"
            if phase == "finetune":
                self.optimizers[phase].zero_grad(set_to_none=True)
            h.backward(grad)
            self.optimizers[phase].step()
            self.pending = None
            return {}
        if op in ("keep_best", "restore_best"):
            return self._best(op)
        raise UnknownOperation("tabvfl", op)


class LEParty(_GuestBase):
    """Guest k of tabvfl-le: a complete TabNet encoder on its columns and its rows of the
    reconstruction layer (from the whole decoder output r)."""

    method_name = "tabvfl-le"

    def _build(self, d_k: int, *, init: Any, masks: Any) -> Any:
        from securevfl.methods.tabvfl.split import LEGuest

        return LEGuest(d_k, self.cfg, init_generator=init, mask_generator=masks)

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        train = bool(args.get("train", False))
        if op == "pretrain_forward":
            x = self._x(ids)
            self.model.train(train)
            obf = (
                self.model.obfuscation_mask(len(ids)).to(self.device)
                if train
                else self._valid_masks(len(ids), args)
            )
            with torch.set_grad_enabled(train):
                steps = self.model.pretrain_steps(x, obf)
            self.pending = (op, np.array(ids), (x, obf, steps))
            return {"steps": steps.detach().cpu().numpy()}
        if op == "pretrain_reconstruct":
            x, obf, _ = self._kept("pretrain_forward", ids)
            r = torch.tensor(np.asarray(inputs["r"], dtype=np.float32), device=self.device)
            if not train:
                with torch.no_grad():
                    rows = self.model.reconstruction_rows(r, x, obf)
                return {"loss_rows": rows.cpu().numpy()}
            r.requires_grad_(True)
            self.optimizers["pretrain"].zero_grad(set_to_none=True)
            rows = self.model.reconstruction_rows(r, x, obf)
            rows.mean().backward()
            # per-sample scale (x B): embedding DP clips rows, and the host divides by B
            grad_r = r.grad.cpu().numpy() * len(ids)
            return {"grad_r": grad_r, "loss_rows": rows.detach().cpu().numpy()}
        if op == "pretrain_backward":
            _, _, steps = self._kept("pretrain_forward", ids)
            grad = torch.tensor(np.asarray(inputs["grad"], dtype=np.float32), device=self.device)
            steps.backward(grad)
            self.optimizers["pretrain"].step()
            self.pending = None
            return {}
        if op == "forward":
            x = self._x(ids)
            self.model.train(train)
            with torch.set_grad_enabled(train):
                z, m_loss = self.model.latent_and_m_loss(x)
            self.pending = (op, np.array(ids), (z, m_loss))
            return {"z": z.detach().cpu().numpy()}
        if op == "backward":
            z, m_loss = self._kept("forward", ids)
            grad = torch.tensor(np.asarray(inputs["grad"], dtype=np.float32), device=self.device)
            self.optimizers["finetune"].zero_grad(set_to_none=True)
            # the host's loss is CE(head(sum_k z_k)); this guest's sparsity term is its own
            torch.autograd.backward([z, -self.cfg.lambda_sparse * m_loss], [grad, None])
            self.optimizers["finetune"].step()
            self.pending = None
            return {}
        if op in ("keep_best", "restore_best"):
            return self._best(op)
        raise UnknownOperation("tabvfl-le", op)
