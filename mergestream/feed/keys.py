"""Feed signing keys: Ed25519 key pairs per TUF role, on disk, never logged.

A keys folder holds, for each top-level role (``root``, ``targets``, ``snapshot``, ``timestamp``):

* ``<role>.pem``: the private key, PKCS#8 PEM, file mode 0600; encrypted with the passphrase in
  the environment variable :data:`PASSPHRASE_ENV` when it is set (never read from the command
  line, never logged);
* ``<role>.pub.json``: the public key as securesystemslib's ``SSlibKey`` dict (what root lists).

Keys are generated and signed with securesystemslib's ``CryptoSigner`` (pyca/cryptography);
loading a private key checks it matches its public key. Rotation (:func:`rotate_key`) replaces one
role's pair and keeps the old one as ``<role>.<keyid[:8]>.old.pem`` until root has been re-signed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    BestAvailableEncryption,
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)
from securesystemslib.signer import CryptoSigner, SSlibKey

from ..errors import MergestreamError
from ..io.st import load_json

ROLES = ("root", "targets", "snapshot", "timestamp")
PASSPHRASE_ENV = "MERGESTREAM_FEED_KEY_PASSPHRASE"


class FeedKeyError(MergestreamError):
    """A key file is missing, unreadable, encrypted without a passphrase, or does not match."""


def _passphrase() -> bytes | None:
    p = os.environ.get(PASSPHRASE_ENV)
    return p.encode("utf-8") if p else None


def _write_private(path: Path, key: Ed25519PrivateKey) -> None:
    pw = _passphrase()
    enc = BestAvailableEncryption(pw) if pw else NoEncryption()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, enc)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
        fh.flush()
        os.fsync(fh.fileno())


def _write_public(path: Path, key: SSlibKey) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"keyid": key.keyid, **key.to_dict()}, indent=2) + "\n")
    os.replace(tmp, path)


def generate(keys_dir: str | os.PathLike, roles: tuple[str, ...] = ROLES) -> dict[str, str]:
    """Create a fresh Ed25519 key pair for each role in ``keys_dir`` (created, mode 0700).

    Returns:
        ``{role: keyid}`` (public information only).

    Raises:
        FeedKeyError: a key file for one of the roles already exists (nothing is overwritten).
    """
    root = Path(keys_dir)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    taken = [r for r in roles if (root / f"{r}.pem").exists()]
    if taken:
        raise FeedKeyError(f"{root}: keys already exist for {', '.join(taken)}; refusing to overwrite them "
                           "(use `mergestream feed rotate-key` to replace one)")
    out = {}
    for role in roles:
        key = Ed25519PrivateKey.generate()
        pub = CryptoSigner(key).public_key
        _write_private(root / f"{role}.pem", key)
        _write_public(root / f"{role}.pub.json", pub)
        out[role] = pub.keyid
    return out


def public_key(keys_dir: str | os.PathLike, role: str) -> SSlibKey:
    """The public key of ``role`` from ``<keys_dir>/<role>.pub.json``.

    Raises:
        FeedKeyError: missing or malformed.
    """
    path = Path(keys_dir) / f"{role}.pub.json"
    try:
        d = load_json(path.read_bytes(), str(path), error=ValueError)
        keyid = d.pop("keyid")
        return SSlibKey.from_dict(keyid, d)
    except FileNotFoundError:
        raise FeedKeyError(f"{path}: no public key for role {role} (run `mergestream feed keygen`)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise FeedKeyError(f"{path}: malformed public key ({type(exc).__name__})") from None


def signer(keys_dir: str | os.PathLike, role: str, pem_name: str | None = None) -> CryptoSigner:
    """The signer of ``role`` (private key ``<role>.pem``, or ``pem_name``), checked against its public key.

    Raises:
        FeedKeyError: the private key is missing, unreadable, encrypted and no passphrase is set
        (or a wrong one), or does not match ``<role>.pub.json``. Messages never contain key bytes.
    """
    root = Path(keys_dir)
    path = root / (pem_name or f"{role}.pem")
    pub = public_key(root, role) if pem_name is None else None
    try:
        pem = path.read_bytes()
    except FileNotFoundError:
        raise FeedKeyError(f"{path}: no private key for role {role} (run `mergestream feed keygen`)") from None
    try:
        priv = load_pem_private_key(pem, _passphrase())
    except TypeError:
        raise FeedKeyError(f"{path}: the key is encrypted: set {PASSPHRASE_ENV}") from None
    except ValueError:
        raise FeedKeyError(f"{path}: cannot decrypt or parse the private key (wrong {PASSPHRASE_ENV}?)") from None
    try:
        return CryptoSigner(priv, pub)
    except Exception:  # KeyMismatchError, ValueError: the message names no key material
        raise FeedKeyError(f"{path}: the private key is not an Ed25519 key matching {role}.pub.json") from None


def rotate_key(keys_dir: str | os.PathLike, role: str) -> tuple[str, str]:
    """Replace ``role``'s key pair; the old private key is kept as ``<role>.<old keyid[:8]>.old.pem``.

    The caller must then publish a new root listing the new key (:func:`mergestream.feed.build.rotate`),
    signed by the old root key(s) as well when ``role`` is root.

    Returns:
        ``(old keyid, new keyid)``.

    Raises:
        FeedKeyError: ``role`` is unknown or has no current key.
    """
    if role not in ROLES:
        raise FeedKeyError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    root = Path(keys_dir)
    old = public_key(root, role)
    signer(root, role)  # the old private key must be loadable before it is moved aside
    os.replace(root / f"{role}.pem", root / f"{role}.{old.keyid[:8]}.old.pem")
    os.replace(root / f"{role}.pub.json", root / f"{role}.{old.keyid[:8]}.old.pub.json")
    new = generate(root, (role,))[role]
    return old.keyid, new
