"""The simulated NPU, modeled on an Ascend AI core (numbers in `shared/docs/npu-model.md`).

- `machine`: `Machine`, the frozen target config, and `load_target(name_or_path)`.
- `pipes`: the pipes of a core (MTE2, MTE1, CUBE, FIXP, VECTOR, MTE3, SCALAR) and memory levels.
- `memory`: per-core buffers with capacities, the queues (depth 2 = double buffering) and tiles.
- `core`: one core's instructions (copy in/out, L1->L0 loads, mmad, vector, scalar) and their
  event-level schedule: an instruction starts when its pipe is free and its operands are ready.
- `launch`: SPMD over cores with balanced splits; a kernel's time is launch + slowest core.
- `stats`: `RunStats`; `timeline`: busy intervals and the Chrome trace export.
- `errors`: `TargetError`, `CapacityError`.
- `clock`: `ARITHMETIC`, the seconds functional runs spend on tile arithmetic (benchmarks).
"""
