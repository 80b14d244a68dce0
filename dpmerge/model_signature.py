"""Release directories signed in OpenSSF's model-signing format, key mode
(docs/design.md#security).

Every registered model directory — the MLflow model with its weights, pt2 program, record and
privacy card (``extra_files/``) — carries ``model.sig``: a Sigstore bundle over an in-toto
statement of every file's SHA-256, signed with an **EC P-256** key. So a consumer checks a
downloaded release with a tool that knows nothing of dpmerge::

    python -m model_signing verify key DIR --signature DIR/model.sig --public_key release.pem

beside ``dpmerge verify``, whose Ed25519 manifest (:mod:`dpmerge.manifests`) also covers the
version's tags and ``model.sig`` itself. The P-256 key is derived from the workflow's secret
key, like the Ed25519 one (nothing new to distribute to workers); its public key, a PEM, is
published base64-encoded as ``$DPMERGE_MODEL_SIGNING_PUBLIC_KEY`` in every stack role's
environment (``dpmerge stack env``), and :func:`public_key_pem` gives it from the key.
"""

from __future__ import annotations

import base64
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from dpmerge.keys import WorkflowKey
from dpmerge.manifests import MLFLOW_BOOKKEEPING, ReleaseSignatureError
from dpmerge.vocabulary import KeyPurpose

if TYPE_CHECKING:
    from model_signing.hashing import Config as HashingConfig

SIGNATURE_FILE = "model.sig"
PUBLIC_KEY_ENV = "DPMERGE_MODEL_SIGNING_PUBLIC_KEY"
P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
IGNORED = (SIGNATURE_FILE, *sorted(MLFLOW_BOOKKEEPING))
"""What a signature does not cover: itself, and what MLflow adds to a model it downloads by a
``models:/`` URI."""


def signing_key(key: WorkflowKey) -> ec.EllipticCurvePrivateKey:
    """The workflow's P-256 model-signing key: its scalar from 512 bits of HMAC under the
    release-signing purpose, reduced into [1, n - 1] (a bias below 2^-250)."""
    wide = "".join(
        key.mac(KeyPurpose.RELEASE_SIGNING, f"openssf-model-signing/p256-scalar/{i}")
        for i in (0, 1)
    )
    return ec.derive_private_key(int(wide, 16) % (P256_ORDER - 1) + 1, ec.SECP256R1())


def public_key_pem(key: WorkflowKey) -> bytes:
    """The public half of :func:`signing_key`, as the PEM ``model_signing verify key`` takes."""
    return (
        signing_key(key)
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def published_public_key(key: WorkflowKey) -> str:
    """:func:`public_key_pem` base64-encoded on one line (the value of
    ``$DPMERGE_MODEL_SIGNING_PUBLIC_KEY``; ``base64 -d`` gives the PEM)."""
    return base64.b64encode(public_key_pem(key)).decode()


def _hashing() -> HashingConfig:
    from model_signing import hashing  # imported late (each of its imports is slow)

    return hashing.Config().set_ignored_paths(paths=list(IGNORED), ignore_git_paths=False)


def sign_directory(directory: Path, key: WorkflowKey) -> Path:
    """Sign every file under ``directory`` into ``directory/model.sig``; returns its path. The
    private key is written only to a private temporary file for the library to read."""
    from model_signing import signing

    signature = directory / SIGNATURE_FILE
    with tempfile.TemporaryDirectory(prefix="dpmerge-sign-") as scratch:
        pem = Path(scratch) / "key.pem"
        descriptor = os.open(pem, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(
                signing_key(key).private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        config = signing.Config().use_elliptic_key_signer(private_key=pem)
        config.set_hashing_config(_hashing()).sign(directory, signature)
    return signature


def verify_directory(directory: Path, public_pem: bytes) -> None:
    """``directory``'s files are exactly those ``directory/model.sig`` signs under
    ``public_pem``; :class:`~dpmerge.manifests.ReleaseSignatureError` (naming the changed,
    extra or missing files) otherwise."""
    from model_signing import verifying

    signature = directory / SIGNATURE_FILE
    if not signature.is_file():
        raise ReleaseSignatureError(f"{directory} has no {SIGNATURE_FILE}")
    with tempfile.TemporaryDirectory(prefix="dpmerge-verify-") as scratch:
        pem = Path(scratch) / "public.pem"
        pem.write_bytes(public_pem)
        config = verifying.Config().use_elliptic_key_verifier(public_key=pem)
        try:
            config.set_hashing_config(_hashing()).verify(directory, signature)
        except ValueError as error:
            raise ReleaseSignatureError(
                f"{directory.name} fails its model-signing signature: {str(error)[:500]}"
            ) from None
