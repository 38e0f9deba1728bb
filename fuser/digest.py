"""SHA-256 hex digests (tuning-cache keys, target fingerprints) without loading OpenSSL.

`hashlib` loads OpenSSL's libcrypto when imported: 3.5 MB of resident memory, measured on a
process that has imported onnx, which is a tenth of what a 10k-node `fuser fuse` holds above a
bare load+save (issue 10). CPython builds its own SHA-256 (`_sha256` on 3.11, `_sha2` from
3.12) and hashlib hands out the same digests from either; hashlib stays the fallback for an
interpreter built without them.

    >>> sha256_hex(b"abc")[:16]
    'ba7816bf8f01cfea'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def _constructor() -> Callable[[bytes], Any]:
    for module, name in (("_sha2", "sha256"), ("_sha256", "sha256")):
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    import hashlib

    return hashlib.sha256


_SHA256 = _constructor()


def sha256_hex(data: bytes) -> str:
    """The SHA-256 digest of `data` as 64 lowercase hex digits (as `hashlib.sha256`)."""
    return str(_SHA256(data).hexdigest())
