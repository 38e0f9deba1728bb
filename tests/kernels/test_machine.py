"""Target files: shipped targets load with sourced numbers; bad files name file and key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from fuser.kernels.npu.errors import TargetError
from fuser.kernels.npu.machine import SHIPPED_TARGETS, Machine, load_target

TAGS = ("[P]", "[S]", "[D]", "[G]")


def _raw(name: str = "ascend910b") -> dict[str, Any]:
    from importlib import resources

    text = resources.files("fuser.kernels.targets").joinpath(f"{name}.json").read_text()
    return json.loads(text)


@pytest.mark.parametrize("name", SHIPPED_TARGETS)
def test_shipped_target_loads_and_every_number_has_a_source_tag(name: str) -> None:
    m = load_target(name)
    assert m.name == name
    for f in dataclasses.fields(Machine):
        if f.name in ("name", "sources"):
            continue
        src = m.sources.get(f.name, "")
        assert src.startswith(TAGS), f"{name}: '{f.name}' has no [P]/[S]/[D]/[G] source: {src!r}"
    for op in m.vector_ops:
        src = m.sources.get(f"vector_ops.{op}", "")
        assert src.startswith(TAGS), f"{name}: vector op '{op}' has no source tag: {src!r}"


def test_910b_numbers_match_the_npu_model() -> None:
    m = load_target("ascend910b")
    assert (m.cube_cores, m.vector_cores, m.clock_hz) == (24, 48, 1.8e9)
    assert (m.ub_bytes, m.l1_bytes, m.l0a_bytes, m.l0b_bytes, m.l0c_bytes) == (
        196352, 524288, 65536, 65536, 131072,
    )  # fmt: skip
    assert m.vector_cost("Add", "float16") == (0.0103, 22.0)
    assert m.vector_to_cube_via_gm
    # fp32 has half the lanes of fp16: k doubles (derived, as the docstring says).
    assert m.vector_cost("Add", "float32") == pytest.approx((0.0206, 22.0))
    assert m.cube_k_block("float16") == 16
    assert m.cube_k_block("float32") == 8
    assert m.cube_k_block("int8") == 32


def test_user_file_by_path(tmp_path: Path) -> None:
    raw = _raw()
    raw["name"] = "mine"
    raw["cube_cores"] = 3
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(raw))
    m = load_target(str(p))
    assert (m.name, m.cube_cores) == ("mine", 3)


def _bad(tmp_path: Path, raw: dict[str, Any]) -> str:
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(raw))
    with pytest.raises(TargetError) as e:
        load_target(p)
    msg = str(e.value)
    assert "bad.json" in msg
    assert "\n" not in msg
    return msg


def test_missing_key_is_named(tmp_path: Path) -> None:
    raw = _raw()
    del raw["l0c_bytes"]
    assert "missing key 'l0c_bytes'" in _bad(tmp_path, raw)


def test_wrong_type_is_named(tmp_path: Path) -> None:
    raw = _raw()
    raw["ub_bytes"] = "192K"
    assert "'ub_bytes'" in _bad(tmp_path, raw)
    raw = _raw()
    raw["cube_cores"] = 2.5
    assert "'cube_cores' must be an integer" in _bad(tmp_path, raw)
    raw = _raw()
    raw["vector_to_cube_via_gm"] = 1
    assert "'vector_to_cube_via_gm'" in _bad(tmp_path, raw)


def test_negative_value_is_named(tmp_path: Path) -> None:
    raw = _raw()
    raw["hbm_bytes_per_s"] = -1.0
    assert "'hbm_bytes_per_s'" in _bad(tmp_path, raw)
    raw = _raw()
    raw["vector_ops"]["Add"]["float16"] = [0.01, -3]
    assert "'vector_ops.Add.float16'" in _bad(tmp_path, raw)


def test_unknown_key_is_named(tmp_path: Path) -> None:
    raw = _raw()
    raw["l3_bytes"] = 1
    assert "unknown key 'l3_bytes'" in _bad(tmp_path, raw)


def test_not_json_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.json"
    p.write_text("{ not json")
    with pytest.raises(TargetError, match=r"bad\.json: not valid JSON"):
        load_target(p)
    with pytest.raises(TargetError, match="no such target file"):
        load_target(tmp_path / "absent.json")


def test_machine_is_frozen() -> None:
    m = load_target("ascend910b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.cube_cores = 1  # type: ignore[misc]
