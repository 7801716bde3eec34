"""Federation key material: one CurveZMQ key pair (transport) and one X25519 key pair (masking)
per role, and the public file every role pins.

Layout of a keys directory::

    public.json            every role's public keys (give it to every host)
    secret/<role>.json     one role's secret keys (give it only to that role's host; mode 0600)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from crypto import MaskingKeyPair
from securevfl.errors import KeyMaterialError
from transport import CurveKeyPair

FORMAT = "securevfl-keys/1"
AGGREGATOR = "aggregator"


@dataclass(frozen=True)
class RoleSecrets:
    name: str
    curve: CurveKeyPair
    mask: MaskingKeyPair


@dataclass(frozen=True)
class FederationPublicKeys:
    curve: dict[str, bytes]  # role -> z85 CURVE public key
    mask: dict[str, bytes]  # role -> raw X25519 public key

    def curve_public(self, role: str) -> bytes:
        try:
            return self.curve[role]
        except KeyError:
            raise KeyMaterialError(
                f"public.json has no CURVE key for role {role!r}; regenerate keys with "
                "`securevfl keys --config CONFIG --out DIR` so every role in the config has one"
            ) from None


def generate_keys(roles: Sequence[str], out: Path, *, overwrite: bool = False) -> Path:
    """Create key pairs for the aggregator and every role in `roles`; returns public.json's path."""
    out = Path(out)
    public_path = out / "public.json"
    if public_path.exists() and not overwrite:
        raise KeyMaterialError(
            f"{public_path} exists; pass --force to replace the federation's keys"
        )
    (out / "secret").mkdir(parents=True, exist_ok=True)
    os.chmod(out / "secret", 0o700)
    public: dict[str, dict[str, str]] = {}
    for role in [AGGREGATOR, *roles]:
        curve = CurveKeyPair.generate()
        mask = MaskingKeyPair.generate()
        secret_path = out / "secret" / f"{role}.json"
        fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a file being replaced keeps its old mode otherwise
        with os.fdopen(fd, "w") as fh:
            json.dump(
                {"format": FORMAT, "role": role, "curve": curve.to_json(), "mask": mask.to_json()},
                fh,
                indent=2,
            )
        public[role] = {"curve": curve.public.decode("ascii"), "mask": mask.public.hex()}
    public_path.write_text(json.dumps({"format": FORMAT, "roles": public}, indent=2) + "\n")
    return public_path


def load_public(keys_dir: Path) -> FederationPublicKeys:
    path = Path(keys_dir) / "public.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise KeyMaterialError(
            f"{path} does not exist; create the federation's keys with "
            '`securevfl keys --config CONFIG --out DIR` and set [network] keys = "DIR"'
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise KeyMaterialError(f"{path} is not valid JSON ({exc}); regenerate it") from None
    except OSError as exc:
        raise KeyMaterialError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise KeyMaterialError(f"{path}: unknown format {found!r}, expected {FORMAT!r}")
    curve, mask = {}, {}
    try:
        for role, entry in data["roles"].items():
            curve[role] = entry["curve"].encode("ascii")
            mask[role] = bytes.fromhex(entry["mask"])
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise KeyMaterialError(
            f"{path} is damaged ({type(exc).__name__}: {exc}); regenerate the federation's keys "
            "with `securevfl keys --config CONFIG --out DIR --force`"
        ) from None
    return FederationPublicKeys(curve=curve, mask=mask)


def secret_file(keys_dir: Path, role: str) -> Path:
    return Path(keys_dir) / "secret" / f"{role}.json"


def check_private(path: Path) -> None:
    """Refuse a secret key file that other users can read (group or world bits set)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # reading it says what is wrong
    if mode & 0o077:
        raise KeyMaterialError(
            f"{path} is readable by other users (mode {mode & 0o777:o}); it holds secret "
            f"keys: run `chmod 600 {path}`"
        )


def load_secrets(keys_dir: Path, role: str) -> RoleSecrets:
    """One role's secret keys. Refuses (`KeyMaterialError`, naming the file and the fix) a
    missing, unreadable, damaged or group/world-readable file, or one of another role."""
    path = secret_file(keys_dir, role)
    check_private(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise KeyMaterialError(
            f"no secret keys for role {role!r} at {path}; copy that role's secret file from "
            "where `securevfl keys` wrote it"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise KeyMaterialError(
            f"{path} is not valid JSON ({exc}); copy the file `securevfl keys` wrote again"
        ) from None
    except OSError as exc:
        raise KeyMaterialError(
            f"cannot read {path}: {exc.strerror}; it must be readable by the user running "
            f"role {role!r} (and by no one else: `chmod 600 {path}`)"
        ) from None
    if not isinstance(data, dict) or data.get("role") != role:
        found = data.get("role") if isinstance(data, dict) else None
        raise KeyMaterialError(f"{path} holds keys of role {found!r}, not {role!r}")
    try:
        return RoleSecrets(
            name=role,
            curve=CurveKeyPair.from_json(data["curve"]),
            mask=MaskingKeyPair.from_json(data["mask"]),
        )
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise KeyMaterialError(
            f"{path} is damaged ({type(exc).__name__}: {exc}); copy the file `securevfl keys` "
            "wrote again"
        ) from None


def check_pair(public: FederationPublicKeys, secrets: RoleSecrets, keys_dir: Path) -> None:
    """A role's secret keys must be the ones public.json pins for it (same `securevfl keys`
    run); else every peer would refuse it."""
    role = secrets.name
    if public.curve.get(role) != secrets.curve.public or public.mask.get(role) != (
        secrets.mask.public
    ):
        raise KeyMaterialError(
            f"{secret_file(keys_dir, role)} does not match {Path(keys_dir) / 'public.json'} "
            f"(keys of role {role!r} from another `securevfl keys` run?); use the secret file "
            "and public.json of the same run"
        )


def check_roles(public: FederationPublicKeys, roles: Sequence[str], keys_dir: Path) -> None:
    """Every role of the config must have pinned keys."""
    missing = [r for r in [AGGREGATOR, *roles] if r not in public.curve or r not in public.mask]
    if missing:
        raise KeyMaterialError(
            f"{Path(keys_dir) / 'public.json'} has no keys for {missing}; regenerate with "
            "`securevfl keys --config CONFIG --out DIR --force`"
        )
