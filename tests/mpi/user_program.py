"""A user's own mpi4py program running a tensor-parallel model through `fuser.ort.session`.

Run under mpiexec by test_user_program.py: every rank builds the session on its own rank,
runs it on its own shard, and checks its output against numpy computing the whole model
(all shards, gathered by hand). Prints one line per rank: "rank R ok <max abs error>".
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from mpi4py import MPI
from onnx import numpy_helper

from fuser import mpi, ort


def main(path: str) -> None:
    world = MPI.COMM_WORLD
    comm = mpi.communicator()  # fuser's own duplicates: the user's traffic stays separate
    model = onnx.load(path)
    sess = ort.session(model, kernel="reference", rank=world.rank, communicator=comm)
    rng = np.random.default_rng([7, world.rank])
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    (y,) = sess.run(None, {"x_shard": x})
    # The user's own collective on COMM_WORLD, interleaved with fuser's: must not mix.
    shards = world.allgather(x)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    w1 = next(v for k, v in weights.items() if "fc1" in k and v.ndim == 2)
    b1 = next(v for k, v in weights.items() if "fc1" in k and v.ndim == 1)
    w2 = next(v for k, v in weights.items() if "fc2" in k)
    full = np.concatenate(shards, axis=2).astype(np.float64)
    expected = np.maximum(full @ w1 + b1, 0) @ w2
    error = float(np.max(np.abs(expected - y)))
    print(f"rank {world.rank} {'ok' if error < 1e-4 else 'WRONG'} {error:.2e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
