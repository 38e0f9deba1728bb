"""The onnxruntime plugin's contract: failures inside ops are exceptions, never a dead process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import pytest

from fuser.ort import NodeFailedError, RunContext, register_handler, session


def _explode(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], ctx: RunContext
) -> Sequence[np.ndarray]:
    x = inputs[0]
    assert x is not None
    if float(x.sum()) > 0:
        raise ValueError(f"refusing a positive sum ({float(x.sum()):g})")
    return (x * 2,)


register_handler("fuser.test", "Explode", _explode)

MODEL = onnx.parser.parse_model("""
<ir_version: 8, opset_import: ["" : 17, "fuser.test" : 1]>
g (float[3] x) => (float[3] y) <float[3] t> {
    t = fuser.test.Explode(x)
    y = Neg(t)
}
""")


def test_a_failing_op_raises_in_run_and_the_session_stays_usable() -> None:
    sess = session(MODEL)
    with pytest.raises(NodeFailedError, match=r"\(Explode\) failed: refusing a positive sum \(3\)"):
        sess.run(None, {"x": np.ones(3, np.float32)})
    # the same session still works for good input afterwards
    (y,) = sess.run(None, {"x": -np.ones(3, np.float32)})
    np.testing.assert_array_equal(y, np.full(3, 2, np.float32))


def test_a_rank_that_fails_releases_the_others() -> None:
    import threading

    from fuser.collective import Communicator

    text = """
    <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1, "fuser.test" : 1]>
    g (float[2] x) => (float[4] y) <float[2] t> {
        t = fuser.test.Explode(x)
        y = com.microsoft.AllGather <group_size = 2, axis = 0> (t)
    }
    """
    model = onnx.parser.parse_model(text)
    comm = Communicator(2)
    sessions = [session(model, rank=r, communicator=comm) for r in range(2)]
    errors: list[BaseException] = []

    def work(rank: int, x: np.ndarray) -> None:
        try:
            sessions[rank].run(None, {"x": x})
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(0, -np.ones(2, np.float32))),
        threading.Thread(target=work, args=(1, np.ones(2, np.float32))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung after another failed"
    assert len(errors) == 2  # rank 1's op failed; rank 0's gather was released with an error
    assert any("refusing a positive sum" in str(e) for e in errors)


def test_a_session_survives_later_sessions_of_other_models() -> None:
    """onnxruntime-extensions keeps pointers into its op list: an op registered after a session
    exists used to leave that session dangling (segfault on its next run)."""
    first = session(MODEL)
    wide = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
    g (int64[2] a) => (int64[2] y) {
        y = com.microsoft.AllGather <group_size = 1, axis = 0> (a)
    }
    """)
    second = session(wide)
    for _ in range(3):
        (y,) = first.run(None, {"x": -np.ones(3, np.float32)})
        np.testing.assert_array_equal(y, np.full(3, 2, np.float32))
        (z,) = second.run(None, {"a": np.array([2**40, -3], np.int64)})
        np.testing.assert_array_equal(z, np.array([2**40, -3], np.int64))  # int64 exact on the wire


def test_constant_inputs_stay_exact_and_run_node_agrees_with_the_session() -> None:
    """Weights are held on the Python side in their own dtype: an int64 beyond 2**53 (which a
    float64 wire would round) arrives exactly; the node run alone agrees."""
    from onnx import numpy_helper

    from fuser.ort import run_node

    big = np.array([2**60 + 1, 2**60 + 5], np.int64)
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17, "fuser.test" : 1]>
    g (float[3] x) => (float[3] y, int64[2] z) <float[3] t> {
        t = fuser.test.Explode(x)
        y = Neg(t)
        z = fuser.test.Echo(x, big)
    }
    """)
    model.graph.initializer.append(numpy_helper.from_array(big, "big"))
    sess = session(model)
    y, z = sess.run(None, {"x": -np.ones(3, np.float32)})
    np.testing.assert_array_equal(z, [1, 5])  # 2**60 + 1 survived, minus 2**60
    np.testing.assert_array_equal(y, np.full(3, 2, np.float32))
    echo = next(n for n in model.graph.node if n.op_type == "Echo")
    (alone,) = run_node(echo, [-np.ones(3, np.float32), big])
    np.testing.assert_array_equal(alone, [1, 5])


def _echo(
    inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any], ctx: RunContext
) -> Sequence[np.ndarray]:
    assert inputs[1] is not None
    return (inputs[1] - np.int64(2**60),)


register_handler("fuser.test", "Echo", _echo)
