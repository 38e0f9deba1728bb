"""fuser's SHA-256 (without OpenSSL) gives hashlib's digests: tuning-cache keys and target
fingerprints written by earlier versions stay valid."""

from __future__ import annotations

import dataclasses
import hashlib
from types import MappingProxyType

import numpy as np
from fuser.kernels.npu.machine import load_target

from fuser.digest import sha256_hex


def test_sha256_hex_equals_hashlib_on_random_inputs_of_awkward_sizes() -> None:
    rng = np.random.default_rng(10)
    for size in (0, 1, 55, 56, 63, 64, 65, 1000, 4097):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert sha256_hex(data) == hashlib.sha256(data).hexdigest(), size


def test_target_fingerprints_are_what_hashlib_made_of_them() -> None:
    # The fingerprint keys the tuning cache: a changed digest would orphan every stored entry.
    seen = set()
    for name in ("ascend910b", "ascend910", "ascend310p"):
        machine = load_target(name)
        numbers = dataclasses.replace(machine, sources=MappingProxyType({}))
        assert machine.fingerprint == hashlib.sha256(repr(numbers).encode()).hexdigest()[:12]
        seen.add(machine.fingerprint)
    assert len(seen) == 3
