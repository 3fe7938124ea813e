"""Blobs uploaded for `/api/create` (Ollama's `/api/blobs/sha256:<hex>`), content-addressed
under `<MLXD_HOME>/blobs/sha256-<hex>`.

An upload is written to a temporary file beside its final name while it is hashed, and renamed
into place only when its digest is the one it was uploaded under: a blob written is always
whole and what its name says. A blob damaged on disk later is told apart by hashing it again
(cached while its size and mtime stay): it counts as absent, so the client uploads it anew.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from mlxd.registry.home import mlxd_home
from mlxd.registry.store import ModelFilesError, file_hashes

__all__ = [
    "BlobError",
    "DigestMismatch",
    "blob_intact",
    "blob_path",
    "blobs_dir",
    "holds",
    "parse_digest",
    "store_blob",
]

_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")


class BlobError(ValueError):
    """A malformed digest or an unusable upload (the API answers 400)."""


class DigestMismatch(BlobError):
    """The uploaded bytes do not hash to the digest they were sent under."""


def parse_digest(digest: str) -> str:
    """The canonical `sha256:<hex>` of a digest written `sha256:` or `sha256-` (as Ollama)."""
    match = _DIGEST.fullmatch(digest)  # `$` would take a final newline
    if match is None:
        raise BlobError("invalid digest format")
    return "sha256:" + match.group(1).lower()


def blobs_dir(env: Mapping[str, str] = os.environ) -> Path:
    return mlxd_home(env) / "blobs"


def blob_path(digest: str, env: Mapping[str, str] = os.environ) -> Path:
    """Where the blob `digest` lives (whether or not it is there)."""
    return blobs_dir(env) / parse_digest(digest).replace(":", "-")


def holds(path: Path, digest: str) -> bool:
    """Whether the file at `path` is there and hashes to `digest` (`sha256:<hex>`)."""
    if not path.is_file():
        return False
    try:
        ((_, sha256),) = file_hashes([path])
    except (OSError, ModelFilesError):
        return False
    return "sha256:" + sha256 == parse_digest(digest)


def blob_intact(digest: str, env: Mapping[str, str] = os.environ) -> bool:
    """Whether the blob `digest` is stored and still what its name says."""
    return holds(blob_path(digest, env), digest)


async def store_blob(
    digest: str, chunks: AsyncIterator[bytes], env: Mapping[str, str] = os.environ
) -> bool:
    """Store an upload under `digest`; True when it was new (or replaced a damaged copy),
    False when it was there already. Raises DigestMismatch (nothing is kept) when the bytes
    hash to something else."""
    want = parse_digest(digest)
    final = blob_path(want, env)
    if holds(final, want):
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
