"""The `fuser tune` command (registered on the main app by `register`).

    fuser tune FUSED_MODEL [--node NAME] [--target T] [--simulate] [--top N] [--json]
    fuser tune LayerNormMatMul --input 512x768:float16 --input 768 --input 768 \\
        --input 768x3072 --attr has_bias=[0] --attr flatten=[0] --simulate

The first argument is a fused model (path or `example:NAME`, fused first) or, for the direct
form, a fused op type with `--input SHAPE[:DTYPE]` per input (`-` for an absent one; DTYPE
defaults to the first input's, float16 if none) and `--attr NAME=VALUE` (ints, floats, lists
as `1,2` or `[0]`, strings).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .cli_common import (
    DimOption,
    DimSizeOption,
    command_json,
    err,
    out,
    parse_dims,
    print_json,
    print_table,
    resolve_input,
    table,
)
from .errors import FuserError, UsageError


def register(app: typer.Typer) -> None:
    """Add the `tune` command to `app`."""
    app.command("tune")(tune)


def tune(
    model: Annotated[str, typer.Argument(help="fused model (path or example:NAME) or op type")],
    node: Annotated[str | None, typer.Option(help="only this fused node")] = None,
    target: Annotated[str, typer.Option(help="NPU target name or target JSON file")] = (
        "ascend910b"
    ),
    simulate: Annotated[
        bool, typer.Option("--simulate", help="run the top candidates on the simulator")
    ] = False,
    top: Annotated[int, typer.Option(help="candidates to show / simulate (0: all)")] = 10,
    input_: Annotated[
        list[str] | None,
        typer.Option("--input", help="direct form: SHAPE[:DTYPE] per input, e.g. 512x768:float16"),
    ] = None,
    attr: Annotated[
        list[str] | None, typer.Option("--attr", help="direct form: NAME=VALUE")
    ] = None,
    cache: Annotated[
        Path | None, typer.Option("--cache", help="tuning cache file (default: user cache)")
    ] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="do not use the cache")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    dim: DimOption = None,
    dim_size: DimSizeOption = 256,  # what fuse prices a symbolic dim at when none is given
) -> None:
    """Rank each fused node's tilings by the cost model; with --simulate, check them."""
    # rich.progress here, not at the top: every command imports this module to register it
    # (fuser/cli.py), and rich.progress is 1.1 MB and 5 ms that only `tune` needs.
    from rich import progress as bars

    from .kernels.api import KernelError
    from .kernels.npu.errors import TargetError
    from .kernels.npu.machine import load_target
    from .tune import tune_model, tune_op
    from .tuning_cache import TuningCache

    try:
        machine = load_target(target)
    except TargetError as e:
        err.print(f"error: {e}")
        raise typer.Exit(2) from None
    store = None if no_cache else TuningCache(cache)
    bar = bars.Progress(
        bars.TextColumn("{task.description}"), bars.BarColumn(), bars.MofNCompleteColumn(),
        bars.TimeElapsedColumn(),
        console=err, transient=True, disable=not simulate,
    )  # fmt: skip
    task = bar.add_task("simulating", total=None)

    def progress(done: int, total: int, label: str) -> None:
        bar.update(task, completed=done, total=total, description=f"simulating {label}")

    try:
        with bar:
            if input_:
                metas, attrs = _direct(input_, attr or [])
                results = [
                    tune_op(model, metas, attrs, machine, simulate=simulate, top=top,
                            cache=store, progress=progress)
                ]  # fmt: skip
            else:
                fused = _fused_model(model, target)
                results = tune_model(
                    fused, machine, node=node, simulate=simulate, top=top, cache=store,
                    progress=progress, symbolic_size=dim_size, dims=parse_dims(dim or []),
                )  # fmt: skip
    except (FuserError, KernelError, ValueError, KeyError) as e:
        err.print(f"error: {e}")
        raise typer.Exit(2) from None
    if as_json:
        shown = []
        for r in results:
            d = r.to_dict()
            if top > 0:
                d["candidates"] = d["candidates"][:top]
            shown.append(d)
        print_json(command_json("tune", model, target, {"nodes": shown}))
        return
    for r in results:
        _print(r, top)


def _fused_model(spec: str, target: str) -> Any:
    """The model as given if it already holds fused nodes, else fused first."""
    import onnx

    from .api import fuse
    from .tune import fused_nodes

    source, _ = resolve_input(spec)
    if isinstance(source, str):
        path = Path(source)
        if not path.is_file():
            raise UsageError(f"{spec}: no such file, and not a fused op type with --input")
        source = onnx.load(str(path), load_external_data=False)
    if not fused_nodes(source):
        source = fuse(source, target=target).model
    return source


def _direct(inputs: list[str], attrs: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """Metas and attributes of the direct form."""
    import numpy as np

    from .kernels.api import TensorMeta

    metas: list[Any] = []
    first: str | None = None
    parsed: list[tuple[tuple[int, ...], str | None] | None] = []
    for spec in inputs:
        if spec.strip() == "-":
            parsed.append(None)
            continue
        shape_s, _, dtype = spec.partition(":")
        try:
            shape = tuple(int(d) for d in shape_s.lower().split("x") if d)
        except ValueError:
            raise UsageError(f"--input {spec}: shape must be like 512x768") from None
        parsed.append((shape, dtype or None))
        first = first or dtype or None
    for p in parsed:
        if p is None:
            metas.append(None)
            continue
        try:
            metas.append(TensorMeta(p[0], np.dtype(p[1] or first or "float16")))
        except TypeError:
            raise UsageError(f"--input: unknown dtype {p[1]!r}") from None
    out: dict[str, Any] = {}
    for a in attrs:
        name, sep, value = a.partition("=")
        if not sep:
            raise UsageError(f"--attr {a}: expected NAME=VALUE")
        out[name.strip()] = _value(value.strip())
    return metas, out


def _value(text: str) -> Any:
    if text.startswith("[") and text.endswith("]"):
        return [_value(t.strip()) for t in text[1:-1].split(",") if t.strip()]
    if "," in text:
        return [_value(t) for t in text.split(",") if t]
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _print(r: Any, top: int) -> None:
    space = f"{r.space_size} tilings" + ("" if r.exhaustive else ", pruned search")
    candidates = table(
        "#", "tiling", "predicted", "simulated", numeric=("#", "predicted", "simulated")
    )
    shown = r.candidates if top <= 0 else r.candidates[:top]
    for i, c in enumerate(shown, 1):
        tiling = " ".join(f"{k}={v}" for k, v in c.tiling.items())
        sim = "" if c.simulated_cycles is None else f"{c.simulated_cycles:,.0f}"
        candidates.add_row(str(i), tiling, f"{c.predicted_cycles:,.0f}", sim)
    if r.default is not None:
        tiling = " ".join(f"{k}={v}" for k, v in r.default.tiling.items())
        sim = f"{r.default.simulated_cycles:,.0f}" if r.default.simulated_cycles else ""
        candidates.add_row("dflt", tiling, f"{r.default.predicted_cycles:,.0f}", sim)
    print_table(
        f"{r.name} ({r.op}, inputs {list(r.shapes)}): {space}", candidates, empty="no tilings"
    )
    chosen = " ".join(f"{k}={v}" for k, v in r.chosen.items())
    out.print(f"chosen: {chosen}")
    if r.spearman is not None or r.regret is not None:
        sp = "n/a" if r.spearman is None else f"{r.spearman:.3f}"
        rg = "n/a" if r.regret is None else f"{100 * r.regret:.1f}%"
        out.print(f"spearman {sp}, regret of the model's pick {rg}")
