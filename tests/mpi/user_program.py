"""A user's own mpi4py program running a tensor-parallel model through `fuser.ort.session`.

    mpiexec -n P python user_program.py MODEL_{rank}.onnx [run|die|sleep]

Each rank loads its own shard (the column-parallel fc1 and row-parallel fc2 of a `tp_mlp`,
followed by com.microsoft AllReduce of the partial sums), runs it on its own input shard, and
checks the result against numpy computing the whole layer from every rank's weights and
inputs (collected with the user's own COMM_WORLD calls, interleaved with fuser's). Prints one
line per rank on rank 0: "rank R ok|WRONG <max abs error> <dtype>".

`die`: rank 1 exits abruptly (a crash) before running; `sleep`: rank 1 arrives 6 s late, so the
others' collectives time out (FUSER_COLLECTIVE_TIMEOUT); each rank prints "rank R raised: why".
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import onnx
from mpi4py import MPI
from onnx import numpy_helper

from fuser import mpi, ort


def main(template: str, mode: str) -> None:
    world = MPI.COMM_WORLD
    comm = mpi.communicator()  # collective: every rank calls it
    model = onnx.load(template.replace("{rank}", str(world.rank)))
    dtype = onnx.helper.tensor_dtype_to_np_dtype(model.graph.input[0].type.tensor_type.elem_type)
    sess = ort.session(model, kernel="reference", rank=world.rank, communicator=comm)
    shard = model.graph.input[0].type.tensor_type.shape.dim[-1].dim_value
    rng = np.random.default_rng([7, world.rank])
    x = rng.standard_normal((2, 3, shard)).astype(dtype)
    if world.rank == 1 and mode == "die":
        os._exit(9)
    if world.rank == 1 and mode == "sleep":
        time.sleep(6)
    try:
        (y,) = sess.run(None, {"x_shard": x})
    except Exception as exc:
        lines = world.gather(f"rank {world.rank} raised: {exc}")
        if world.rank == 0:
            print("\n".join(lines), flush=True)
        sys.exit(3)
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    mine = (weights["/fc1/weight"], weights["/fc1/bias"], weights["/fc2/weight"])
    everyone = world.allgather((x, mine))  # the user's own traffic, between fuser's collectives
    full = np.concatenate([xs for xs, _ in everyone], axis=2).astype(np.float64)
    expected = sum(np.maximum(full @ w1 + b1, 0) @ w2 for _, (w1, b1, w2) in everyone)
    error = float(np.max(np.abs(expected - y.astype(np.float64))))
    bar = 1e-4 if dtype == np.float32 else 3e-2 * max(1.0, float(np.abs(expected).max()))
    verdict = "ok" if error <= bar and y.dtype == dtype else "WRONG"
    lines = world.gather(f"rank {world.rank} {verdict} {error:.2e} {y.dtype}")
    if world.rank == 0:  # one writer: ranks' lines would interleave on the shared stdout
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "run")
