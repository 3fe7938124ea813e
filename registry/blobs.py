"""Blobs uploaded for `/api/create` (Ollama's `/api/blobs/sha256:<hex>`), content-addressed
under `<MLXD_HOME>/blobs/sha256-<hex>`.

An upload is written to a temporary file beside its final name while it is hashed, and renamed
into place only when its digest is the one it was uploaded under: a blob on disk is always
whole and always what its name says.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from mlxd.registry.home import mlxd_home

__all__ = ["BlobError", "DigestMismatch", "blob_path", "blobs_dir", "parse_digest", "store_blob"]

_DIGEST = re.compile(r"^sha256[:-]([0-9a-fA-F]{64})$")


class BlobError(ValueError):
    """A malformed digest or an unusable upload (the API answers 400)."""


class DigestMismatch(BlobError):
    """The uploaded bytes do not hash to the digest they were sent under."""


def parse_digest(digest: str) -> str:
    """The canonical `sha256:<hex>` of a digest written `sha256:` or `sha256-` (as Ollama)."""
    match = _DIGEST.match(digest)
    if match is None:
        raise BlobError("invalid digest format")
    return "sha256:" + match.group(1).lower()


def blobs_dir(env: Mapping[str, str] = os.environ) -> Path:
    return mlxd_home(env) / "blobs"


def blob_path(digest: str, env: Mapping[str, str] = os.environ) -> Path:
    """Where the blob `digest` lives (whether or not it is there)."""
    return blobs_dir(env) / parse_digest(digest).replace(":", "-")


async def store_blob(
    digest: str, chunks: AsyncIterator[bytes], env: Mapping[str, str] = os.environ
) -> bool:
    """Store an upload under `digest`; True when it was new, False when it was there already.
    Raises DigestMismatch (nothing is kept) when the bytes hash to something else."""
    want = parse_digest(digest)
    final = blob_path(want, env)
    if final.is_file():
        async for _ in chunks:  # drain the body: the client is still sending it
            pass
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{id(chunks)}.partial")
    sha = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            async for chunk in chunks:
                sha.update(chunk)
                out.write(chunk)
        got = "sha256:" + sha.hexdigest()
        if got != want:
            raise DigestMismatch(f"digest mismatch, expected {want}, got {got}")
        os.replace(tmp, final)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
