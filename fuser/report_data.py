"""What the HTML report shows, as data: the fuse report in the JSON vocabulary, plus for each
fusion the replaced subgraph and the fused node (for drawing), its simulated speedup, and the
original and fused models' simulated timelines.

The subgraph of a fusion is read from the *original* model: its nodes (by the names the fuse
report records), the edges between them, the values it reads from outside (initializers are
only counted, as `weights`) and the values it hands on. Simulated speedups come from two
`profile_model` runs: the replaced nodes' cycles in the original over the fused node's cycles in
the fused model, each node priced by its kernel on the target, as `fuser profile` does.

    >>> data = report_data(original, result, label="model.onnx")     # doctest: +SKIP
    >>> data["fusions"][0]["subgraph"]["nodes"][0]                    # doctest: +SKIP
    {'name': 'conv', 'op': 'Conv'}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import onnx

from .modelio import ModelSource, load_model
from .report import envelope, fusion_dict, near_miss_dict

if TYPE_CHECKING:
    from .api import FusionResult
    from .profile import ModelProfile

#: Timeline entry kinds: an untouched node, one that fusion replaced (original) or made (fused).
PLAIN, REPLACED, FUSED = 0, 1, 2


def report_data(
    original: onnx.ModelProto,
    result: FusionResult,
    *,
    label: str,
    profiles: tuple[ModelProfile, ModelProfile] | None = None,
) -> dict[str, Any]:
    """Everything the HTML report shows, JSON-able; `profiles` = (original, fused) or None."""
    report = result.report
    graph = _Graph(original.graph)
    fused_graph = _Graph(result.model.graph)
    fused_nodes = {n.name: n for n in result.model.graph.node if n.name}
    simulated = _simulated(report.fusions, graph, profiles)
    fusions = []
    for i, f in enumerate(report.fusions):
        entry = fusion_dict(f)
        entry["id"] = i
        entry["subgraph"] = graph.subgraph(f.replaced) if not f.graph else None
        node = fused_nodes.get(f.node) if not f.graph else None
        entry["fused"] = _fused_view(node, fused_graph) if node is not None else None
        entry["simulated"] = simulated[i]
        fusions.append(entry)
    near_misses = [near_miss_dict(r) | {"id": i} for i, r in enumerate(report.rejected)]
    data = envelope("report", label, report.target) | {
        "nodes_before": report.nodes_before,
        "nodes_after": report.nodes_after,
        "summary": _summary(report.summary, fusions, near_misses),
        "fusions": fusions,
        "near_misses": near_misses,
        "timelines": None,
    }
    if profiles is not None:
        replaced = {name for f in report.fusions if not f.graph for name in f.replaced}
        made = {f.node for f in report.fusions}
        before, after = profiles
        data["timelines"] = {
            "clock_hz": before.clock_hz,
            "dims": dict(before.dims),
            "original": _timeline(before, graph.profile_names(replaced), REPLACED),
            "fused": _timeline(after, made, FUSED),
        }
    return data


class _Graph:
    """The original main graph, indexed by the names the fuse report uses for its nodes."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.nodes = list(graph.node)
        # GraphIndex.describe names an unnamed node `Op#i`, profile_model `Op_i` (i = position).
        self.by_name = {n.name or f"{n.op_type}#{i}": i for i, n in enumerate(self.nodes)}
        self.initializers = {t.name for t in graph.initializer}
        self.graph_outputs = {v.name for v in graph.output}
        self.consumers: dict[str, set[int]] = {}
        self.producer: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            for value in node.input:
                self.consumers.setdefault(value, set()).add(i)
            for value in node.output:
                self.producer[value] = i
        self._constant: dict[str, bool] = {}

    def constant(self, value: str) -> bool:
        """An initializer, a Constant's output, or an Identity of one (exporters share weights
        so): drawn as a count of weights, not as an input of its own."""
        known = self._constant.get(value)
        if known is None:
            known = value in self.initializers
            at = self.producer.get(value)
            if not known and at is not None:
                node = self.nodes[at]
                known = node.op_type == "Constant" or (
                    node.op_type == "Identity" and self.constant(node.input[0])
                )
            self._constant[value] = known
        return known

    def profile_names(self, names: Iterable[str]) -> set[str]:
        """The names `profile_model` gives the nodes the fuse report calls `names`."""
        out = set()
        for name in names:
            i = self.by_name.get(name)
            if i is not None:
                node = self.nodes[i]
                out.add(node.name or f"{node.op_type}_{i}")
        return out

    def subgraph(self, names: Sequence[str]) -> dict[str, Any]:
        """The replaced nodes, the edges between them, and the values crossing its border."""
        ids = [self.by_name.get(n) for n in names]
        local = {node_id: k for k, node_id in enumerate(ids) if node_id is not None}
        produced: dict[str, int] = {}
        for i, k in local.items():
            for value in self.nodes[i].output:
                if value:
                    produced[value] = k
        nodes: list[dict[str, str]] = []
        edges: list[list[Any]] = []
        inputs: dict[str, list[int]] = {}
        weights = 0
        for k, (name, at) in enumerate(zip(names, ids, strict=True)):
            if at is None:  # not in the main graph (cannot happen for a main-graph fusion)
                nodes.append({"name": name, "op": ""})
                continue
            node = self.nodes[at]
            nodes.append({"name": name, "op": node.op_type})
            for value in node.input:
                if not value:
                    continue
                if value in produced:
                    edges.append([produced[value], k, value])
                elif self.constant(value):
                    weights += 1
                else:
                    inputs.setdefault(value, []).append(k)
        outputs = [
            {"value": value, "from": k}
            for value, k in produced.items()
            if value in self.graph_outputs or not self.consumers.get(value, set()) <= local.keys()
        ]
        return {
            "nodes": nodes,
            "edges": edges,
            "inputs": [{"value": v, "to": to} for v, to in inputs.items()],
            "outputs": outputs,
            "weights": weights,
        }


def _fused_view(node: onnx.NodeProto, graph: _Graph) -> dict[str, Any]:
    reads = [v for v in node.input if v]
    return {
        "name": node.name,
        "op": node.op_type,
        "inputs": [v for v in reads if not graph.constant(v)],
        "outputs": [v for v in node.output if v],
        "weights": sum(graph.constant(v) for v in reads),
    }


def _simulated(
    fusions: Sequence[Any],
    graph: _Graph,
    profiles: tuple[ModelProfile, ModelProfile] | None,
) -> list[dict[str, float | None] | None]:
    """Per fusion: the replaced nodes' simulated cycles, the fused node's, and their ratio."""
    if profiles is None:
        return [None] * len(fusions)
    before = {n.name: n.cycles for n in profiles[0].nodes}
    after = {n.name: n.cycles for n in profiles[1].nodes}
    out: list[dict[str, float | None] | None] = []
    for f in fusions:
        names = graph.profile_names(f.replaced) if not f.graph else set()
        fused = after.get(f.node)
        if fused is None or not names:
            out.append(None)
            continue
        # Constant nodes are data, not kernels (profile skips them): they cost nothing.
        unfused = sum(before.get(n, 0.0) for n in names)
        speedup = unfused / fused if fused > 0 else None
        out.append({"unfused_cycles": unfused, "fused_cycles": fused, "speedup": speedup})
    return out


def _timeline(profile: ModelProfile, marked: set[str], kind: int) -> dict[str, Any]:
    """The model's nodes end to end (the `kernels` track of `profile --trace`)."""
    return {
        "total_cycles": profile.total_cycles,
        "total_us": profile.total_us,
        "launches": profile.launches,
        "nodes": [
            [n.start_cycles, n.cycles, n.name, n.op, kind if n.name in marked else PLAIN]
            for n in profile.nodes
        ],
    }


def _summary(
    counts: Mapping[str, int], fusions: list[dict[str, Any]], near_misses: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per pattern: fusions, near-misses, predicted speedup range, simulated cycles saved."""
    rows = []
    for pattern, count in counts.items():
        mine = [f for f in fusions if f["pattern"] == pattern]
        predicted = [f["prediction"]["speedup"] for f in mine if f["prediction"]]
        sims = [f["simulated"] for f in mine if f["simulated"]]
        rows.append(
            {
                "pattern": pattern,
                "fusions": count,
                "near_misses": sum(r["pattern"] == pattern for r in near_misses),
                "predicted_speedup": [min(predicted), max(predicted)] if predicted else None,
                "simulated_saved_cycles": (
                    sum(s["unfused_cycles"] - s["fused_cycles"] for s in sims) if sims else None
                ),
            }
        )
    return rows


def collect(
    source: ModelSource,
    result: FusionResult,
    *,
    label: str,
    simulate: bool = True,
    dims: Mapping[str, int] | None = None,
    dim_size: int = 1,
) -> dict[str, Any]:
    """`report_data` for `result`, fused from `source`: the original is read again (fusing
    rewrote the loaded copy), and with `simulate` both models are profiled on the target at
    their searched tilings (`profile --tuned`), so neither side is priced at a rule of thumb.
    Raises `UsageError` for a `dims` name the model does not have."""
    from .profile import profile_model

    original = load_model(source)
    profiles = None
    if simulate:
        target = result.report.target
        profiles = (
            profile_model(original, target, dims=dims, dim_size=dim_size, tuned=True),
            profile_model(result.source, target, dims=dims, dim_size=dim_size, tuned=True),
        )
    return report_data(original.model, result, label=label, profiles=profiles)
