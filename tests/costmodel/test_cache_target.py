"""The tuning-cache target key (`search.cache_target`) is made once per machine object, and is
still the key of that machine's own numbers: another machine, even one equal to it, gets its
own digest."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from fuser.kernels import search as ks
from fuser.kernels.npu.machine import load_target


def test_the_key_names_the_machine_its_digest_and_the_model_revision() -> None:
    machine = load_target("ascend910b")
    key = ks.cache_target(machine)
    assert key == f"ascend910b@{machine.fingerprint}/r{ks.MODEL_REVISION}"
    assert ks.cache_target(machine) is key  # made once


def test_machines_that_differ_get_their_own_key() -> None:
    machine = load_target("ascend910b")
    faster = dataclasses.replace(machine, clock_hz=machine.clock_hz * 1.5)
    assert ks.cache_target(faster) != ks.cache_target(machine)
    # `vector_ops` takes no part in equality, so the two compare equal; their digests differ.
    ops = dict(machine.vector_ops)
    ops["Add"] = MappingProxyType({"float16": (0.5, 99.0)})
    cheaper_add = dataclasses.replace(machine, vector_ops=MappingProxyType(ops))
    assert cheaper_add == machine
    assert ks.cache_target(machine) != ks.cache_target(cheaper_add)
    assert (
        ks.cache_target(cheaper_add) == f"ascend910b@{cheaper_add.fingerprint}/r{ks.MODEL_REVISION}"
    )
    assert ks.cache_target(load_target("ascend910b")) == ks.cache_target(machine)
