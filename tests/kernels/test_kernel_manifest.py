"""The kernel manifest lets a lookup import one kernel module instead of all of them: it must
say what discovery says, and a lookup must leave the other modules unimported."""

from __future__ import annotations

import subprocess
import sys

from fuser.kernels import manifest, registry

REGENERATE = "regenerate it: python -m fuser.kernels.registry --write-manifest"


def test_the_manifest_places_every_kernel_model_and_tiling_where_discovery_finds_them() -> None:
    kernels, models, tilings = registry.discovered_modules()
    assert kernels == manifest.KERNEL_MODULES, REGENERATE
    assert models == manifest.MODEL_MODULES, REGENERATE
    assert tilings == manifest.TILING_FIELDS, REGENERATE


def test_the_manifest_file_is_what_the_generator_writes() -> None:
    assert registry.MANIFEST_PATH.read_text() == registry.render_manifest(), REGENERATE


def test_lookups_return_the_discovered_objects() -> None:
    everything = registry.all_kernels()
    for (domain, op), kernel in everything.items():
        assert registry.get_kernel(domain, op) is kernel
    for (domain, op), model in registry.all_models().items():
        assert registry.get_model(domain, op) is model
    assert registry.get_model("", "Relu") is None  # a kernel without a cost model
    assert registry.get_model("ai.onnx", "MatMul") is registry.get_model("", "MatMul")
    assert registry.tiling_fields("", "NoSuchOp") is None
    assert registry.tiling_fields("ai.onnx", "LayerNormalization") == ("rows", "double_buffer",
                                                                        "cores")  # fmt: skip


PROBE = """
import sys
from fuser.kernels import registry, search
assert registry.get_kernel("", "LayerNormalization") is not None
assert search.model_for("fuser", "LayerNormMatMul") is not None
assert registry.tiling_fields("fuser", "ConvBnRelu")
print("LOADED", *sorted(m for m in sys.modules if m.startswith("fuser.kernels.")))
"""


def test_a_lookup_imports_only_the_module_that_holds_the_kernel() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = set(done.stdout.split("LOADED", 1)[1].split())
    assert {"fuser.kernels.layernorm", "fuser.kernels.layernorm_matmul"} <= loaded
    for other in ("conv_bn_relu", "allgather_matmul", "rmsnorm_matmul", "activation", "topk"):
        assert f"fuser.kernels.{other}" not in loaded, other
