"""Where a bundle comes from: who may have written the file, and which builder signed it.

A bundle's entries hold shared objects that every agent of the importing host
loads, so `bundle import` takes them only from a file no other user could have
written, and only from a builder it was told to trust:

- The file (and each trusted key file) must be a regular file owned by the
  importing user or root, writable by neither group nor others. This is checked
  on the descriptor the bytes are then read from, so nothing can be swapped in
  between the check and the read.
- A bundle is signed with Ed25519 over its index, bundle.json, which lists every
  file's size and sha256 and the toolchain; every other member is named by its
  sha256 and checked against it. So the signature covers every byte an import
  publishes. The signature travels as the member bundle.sig (SIGNATURE below).
- The exporter signs with the key under its cache root (SIGNING_KEY, made
  owner-only on first use) or one given by path; `kernel-service bundle key`
  prints the public half, which importers list as trusted keys.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from proto.jsondepth import load_json
from proto.trust import NotRegularFile, UntrustedPath, not_yours, open_private_file, open_regular

SIGNING_KEY = "bundle-signing-key"  # under the cache root: PEM (PKCS#8) Ed25519 private key, 0600
TRUSTED_KEYS_ENV = "KERNEL_SERVICE_TRUSTED_KEYS"  # ':'-separated public key files, when no --trusted-key is given
SIGNATURE = "bundle.sig"  # the tar member: {"algorithm": "ed25519", "public_key": b64, "signature": b64}
MAX_KEY_FILE = 16 << 10  # bytes of a key file or of bundle.sig
_CONTEXT = b"kernel-service bundle signature v1\0"  # signed before the index: a signature is good for nothing else


class ProvenanceError(Exception):
    """A bundle or key file that cannot be trusted; the message says why and what to do."""


# ----- files only we (or root) can have written


def open_trusted(path: Path | str, what: str) -> int:
    """A read descriptor on `path`, once fstat on it shows a regular file (proto.trust.open_regular)
    owned by this user or root that neither group nor others may write; raises ProvenanceError
    (OSError when it cannot be opened at all)."""
    try:
        fd = open_regular(path, what)
    except NotRegularFile as exc:
        raise ProvenanceError(str(exc)) from None
    why = not_yours(os.fstat(fd), os.geteuid())
    if why:
        os.close(fd)
        raise ProvenanceError(
            f"{what} {path} {why}: whoever may write it chose its bytes; refusing it (copy it to a file of yours with `install -m 0644` after checking where it came from)"
        )
    return fd


def _read_trusted(path: Path | str, what: str) -> bytes:
    fd = open_trusted(path, what)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_KEY_FILE + 1)
    if len(data) > MAX_KEY_FILE:
        raise ProvenanceError(f"{what} {path} holds more than {MAX_KEY_FILE} bytes; not a key file")
    return data


# ----- keys


def is_trusted(public_key, trusted) -> bool:
    """Whether `public_key` is one of `trusted`, compared whole (a key id is only a name)."""
    return any(_raw(t) == _raw(public_key) for t in trusted)


def key_id(public_key) -> str:
    """How messages name a key: "ed25519:" and the first 16 hex digits of the sha256 of its raw bytes."""
    return "ed25519:" + hashlib.sha256(_raw(public_key)).hexdigest()[:16]


def public_pem(private_key) -> str:
    """The public half of `private_key`, as the PEM file importers pass to --trusted-key."""
    from cryptography.hazmat.primitives import serialization

    return private_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def cache_signing_key(cache_root: Path):
    """The cache's own signing key, <cache root>/SIGNING_KEY, made (owner only) on first use."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(cache_root) / SIGNING_KEY
    if not os.path.lexists(path):
        pem = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        tmp = path.with_name(f".{SIGNING_KEY}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # never replaces a key another export made meanwhile
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    try:
        fd = open_private_file(path, os.O_RDONLY)  # ours, one name, no link; mode forced to 0600
    except UntrustedPath as exc:
        raise ProvenanceError(f"the cache's signing key: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        return _private_key(f.read(MAX_KEY_FILE + 1), path)


def load_signing_key(path: Path | str):
    """A private key given by path: a regular file of this user that no one else may read."""
    try:
        fd = open_regular(path, "signing key", os.O_NOFOLLOW)
    except NotRegularFile as exc:
        raise ProvenanceError(str(exc)) from None
    except OSError as exc:
        raise ProvenanceError(f"signing key {path}: {exc.strerror} (links are refused)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ProvenanceError(
                f"signing key {path} must be a regular file of yours that no one else may read or write "
                f"(it is mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}); chmod 0600 it"
            )
        return _private_key(f.read(MAX_KEY_FILE + 1), path)


def _private_key(pem: bytes, path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ProvenanceError(f"signing key {path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ProvenanceError(f"signing key {path}: not an Ed25519 key (make one with `openssl genpkey -algorithm ed25519`)")
    return key


def trusted_key_paths(given: Sequence[str], env: Mapping[str, str] = os.environ) -> list[str]:
    """The trusted key files: every --trusted-key, else those $KERNEL_SERVICE_TRUSTED_KEYS lists."""
    if given:
        return list(given)
    return [p for p in env.get(TRUSTED_KEYS_ENV, "").split(":") if p]


def load_trusted_keys(paths: Sequence[str]) -> tuple:
    """The public keys in `paths` (PEM), each file checked as open_trusted checks a bundle."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    keys = []
    for path in paths:
        try:
            pem = _read_trusted(path, "trusted key")
        except OSError as exc:
            raise ProvenanceError(f"trusted key {path}: {exc.strerror or exc}") from None
        try:
            key = serialization.load_pem_public_key(pem)
        except (ValueError, TypeError) as exc:
            raise ProvenanceError(f"trusted key {path}: not a PEM public key ({exc}); `kernel-service bundle key` prints one") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ProvenanceError(f"trusted key {path}: not an Ed25519 public key")
        keys.append(key)
    return tuple(keys)


# ----- signatures


def sign(private_key, index: bytes) -> bytes:
    """bundle.sig's bytes for a bundle whose bundle.json is `index`."""
    import json

    document = {
        "algorithm": "ed25519",
        "public_key": base64.b64encode(_raw(private_key.public_key())).decode(),
        "signature": base64.b64encode(private_key.sign(_CONTEXT + index)).decode(),
    }
    return json.dumps(document, indent=1, sort_keys=True).encode()


def signer(signature: bytes, index: bytes):
    """The public key that made `signature` (bundle.sig's bytes) over `index`; raises
    ProvenanceError when it is garbled or does not verify (the index was changed after signing)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        document = load_json(signature, max_depth=2)
        if not isinstance(document, dict) or document.get("algorithm") != "ed25519":
            raise ValueError("not an ed25519 signature record")
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(document["public_key"], validate=True))
        raw = base64.b64decode(document["signature"], validate=True)
    except (ValueError, TypeError, KeyError) as exc:
        raise ProvenanceError(f"{SIGNATURE} is not a signature this host reads ({exc})") from None
    try:
        key.verify(raw, _CONTEXT + index)
    except InvalidSignature:
        raise ProvenanceError(
            f"{SIGNATURE} does not match bundle.json (signed by {key_id(key)}): the bundle was changed after it was signed; refusing the whole bundle"
        ) from None
    return key


def _raw(public_key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
