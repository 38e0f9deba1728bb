"""Noise-aware comparison of one value computed by two models.

The error allowed at each element is the dtype's tolerance relative to the value's scale
(max(1, max|expected|)), plus NOISE_FACTOR times the original's own rounding noise at that
element: how far the original moves when its float inputs move by one unit in the last place.
A well-conditioned value has noise far below the tolerance, so nothing changes there; where the
original is ill-conditioned (a LayerNorm over a constant row: `x - mean` is rounding noise
amplified by 1/sqrt(eps)), a fusion exact in real arithmetic is not failed for rounding
differently. A fusion that changes the maths (a dropped epsilon gives NaN or a jump far beyond
the spread) still fails: NaN positions must agree and the noise is measured, not assumed.

Integer and boolean values must match exactly. TopK outputs compare as (value, index) pairs per
row: with `sorted=0` ONNX leaves their order unspecified, so rows are put in value order first;
among values equal within tolerance either index is right (ties are judged by value).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Max error relative to output scale, per dtype: fp32 1e-4 (the product's bar). fp16 keeps ~3
# decimal digits (unit roundoff 4.9e-4) and a fused chain rounds at other points than the
# original: correct fusions of the fixtures differ by up to 1.3e-3 of scale, so 3e-3, which
# still catches a weight changed by 2% (1e-2 did not); where the original's own rounding is
# larger than that, the noise allowance covers it.
DEFAULT_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 3e-3, "bfloat16": 3e-2}
# The original's spread under a last-bit perturbation of its inputs is one sample of its
# rounding noise; allow a few times it.
NOISE_FACTOR = 4.0


@dataclass(frozen=True)
class Comparison:
    """One value compared on one run: the error, the allowance, and the worst element."""

    dtype: str
    max_abs: float
    max_rel: float
    tolerance: float
    ok: bool
    detail: str = ""
    worst_index: tuple[int, ...] = ()
    expected: float = 0.0
    actual: float = 0.0


def tolerance_for(dtype: str, precision: str | None) -> float:
    """The default relative tolerance of a value of `dtype` computed from `precision` values."""
    return max(DEFAULT_TOLERANCE.get(dtype, 1e-4), DEFAULT_TOLERANCE.get(precision or dtype, 1e-4))


def compare_values(
    expected: np.ndarray,
    actual: np.ndarray,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    precision: str | None = None,
    noise: np.ndarray | None = None,
    truth: np.ndarray | None = None,
) -> Comparison:
    """Compare `actual` with `expected`; `rtol`/`atol` (numpy allclose) override the default.

    `noise`: the original's spread under last-bit input perturbations, per element. `truth`:
    the original evaluated in float64; an element also passes when `actual` is within the
    tolerance plus NOISE_FACTOR times (spread + the original's own error |expected - truth|)
    of the truth, so a fusion exact in real arithmetic passes where the original rounds badly.
    """
    expected, actual = np.asarray(expected), np.asarray(actual)
    dtype = expected.dtype.name
    if expected.shape != actual.shape:
        return _broken(dtype, f"shape {list(actual.shape)} != {list(expected.shape)}")
    if actual.dtype != expected.dtype:
        return _broken(dtype, f"dtype {actual.dtype.name} != {dtype}")
    if not np.issubdtype(expected.dtype, np.floating):
        return _exact(expected, actual)
    e, a = expected.astype(np.float64), actual.astype(np.float64)
    nan_e, nan_a = np.isnan(e), np.isnan(a)
    finite = ~nan_e & ~nan_a
    with np.errstate(invalid="ignore"):
        err = np.where(finite, np.abs(e - a), 0.0)
        err = np.where(np.isinf(e) & (e == a), 0.0, err)
    err = np.where(np.isnan(err), np.inf, err)  # inf - inf: one side overflowed differently
    nan_err = np.where(nan_e != nan_a, np.inf, 0.0)
    finite_e = np.abs(e[np.isfinite(e)])
    scale = max(1.0, float(finite_e.max()) if finite_e.size else 1.0)
    if rtol is not None or atol is not None:
        r, t = rtol or 0.0, atol or 0.0
        allowed: np.ndarray = t + r * np.abs(np.where(finite, e, 0.0))
        tolerance = r
    else:
        tolerance = tolerance_for(dtype, precision)
        allowed = np.full(e.shape, tolerance * scale)
    spread: np.ndarray = np.zeros(e.shape)
    if noise is not None and noise.shape == e.shape:
        spread = np.where(np.isfinite(noise), noise, np.inf)
    excess = np.maximum(err, nan_err) - (allowed + NOISE_FACTOR * spread)
    if truth is not None and truth.shape == e.shape and excess.size and excess.max() > 0:
        exact = truth.astype(np.float64)
        with np.errstate(invalid="ignore"):
            own = np.abs(e - exact)  # the original's own rounding error on this input
            off = np.where(finite & np.isfinite(exact), np.abs(a - exact), np.inf)
            by_truth = off - (allowed + NOISE_FACTOR * (spread + np.nan_to_num(own, nan=np.inf)))
        excess = np.minimum(excess, np.maximum(by_truth, nan_err))
    max_abs = float(err.max()) if err.size else 0.0
    ok = not excess.size or bool(excess.max() <= 0)
    detail = "" if (nan_e == nan_a).all() else "NaN positions differ"
    if not e.size:
        return Comparison(dtype, 0.0, 0.0, tolerance, True)
    worst = np.unravel_index(int(np.argmax(excess if not ok else err)), e.shape)
    index = tuple(int(i) for i in worst)
    return Comparison(
        dtype,
        max_abs,
        max_abs / scale,
        tolerance,
        ok,
        detail,
        index,
        float(e[index]) if e.ndim else float(e),
        float(a[index]) if a.ndim else float(a),
    )


def _broken(dtype: str, detail: str) -> Comparison:
    return Comparison(dtype, float("inf"), float("inf"), 0.0, False, detail)


def _exact(expected: np.ndarray, actual: np.ndarray) -> Comparison:
    dtype = expected.dtype.name
    differ = expected != actual
    mismatches = int(np.count_nonzero(differ))
    if not mismatches:
        return Comparison(dtype, 0.0, 0.0, 0.0, True)
    if expected.dtype.kind not in "biu":  # strings: no distance, only where they differ
        first = tuple(int(i) for i in np.argwhere(differ)[0]) if differ.ndim else ()
        return Comparison(
            dtype, float("inf"), float("inf"), 0.0, False, f"{mismatches} elements differ", first
        )
    e, a = expected.astype(np.int64), actual.astype(np.int64)
    diff = np.abs(e - a)
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape))
    worst = float(diff[index]) if diff.ndim else float(diff)
    return Comparison(
        dtype,
        worst,
        worst,
        0.0,
        False,
        f"{mismatches} elements differ",
        index,
        float(e[index]) if e.ndim else float(e),
        float(a[index]) if a.ndim else float(a),
    )


def compare_topk(
    values: tuple[np.ndarray, np.ndarray],
    indices: tuple[np.ndarray, np.ndarray],
    *,
    axis: int,
    is_sorted: bool,
    rtol: float | None = None,
    atol: float | None = None,
    precision: str | None = None,
    noise: np.ndarray | None = None,
    perturbed_indices: np.ndarray | None = None,
) -> tuple[Comparison, Comparison]:
    """Compare TopK outputs (expected, actual) pairwise; returns (values, indices) comparisons.

    Unsorted rows are put in (value descending, index ascending) order on both sides first.
    Indices are compared as sets within each group of values equal within tolerance. The last
    group of a row is where the cut at k may fall among equal values the outputs do not show:
    it is let go only on rows where the original itself picked other indices when its inputs
    moved by a last bit (`perturbed_indices`, the original's indices on perturbed inputs).
    """
    (ve, va), (ie, ia) = values, indices
    if ve.shape != va.shape or ie.shape != ia.shape or ve.shape != ie.shape or ve.ndim == 0:
        return (
            compare_values(ve, va, rtol=rtol, atol=atol, precision=precision, noise=noise),
            compare_values(ie, ia),
        )
    ve, va, ie, ia = (np.moveaxis(x, axis, -1) for x in (ve, va, ie, ia))
    moved_noise = np.moveaxis(noise, axis, -1) if noise is not None else None
    if not is_sorted:
        order_e = _pair_order(ve, ie)
        order_a = _pair_order(va, ia)
        ve, ie = np.take_along_axis(ve, order_e, -1), np.take_along_axis(ie, order_e, -1)
        va, ia = np.take_along_axis(va, order_a, -1), np.take_along_axis(ia, order_a, -1)
        if moved_noise is not None:
            moved_noise = np.take_along_axis(moved_noise, order_e, -1)
    value_result = compare_values(
        ve, va, rtol=rtol, atol=atol, precision=precision, noise=moved_noise
    )
    if np.array_equal(ie, ia):
        return value_result, Comparison(ie.dtype.name, 0.0, 0.0, 0.0, True)
    tie = tolerance_for(ve.dtype.name, precision) * max(
        1.0, float(np.max(np.abs(ve[np.isfinite(ve)]), initial=0.0))
    )
    rows_e, rows_i, rows_a = (x.reshape(-1, x.shape[-1]) for x in (ve, ie, ia))
    unstable = np.zeros(rows_i.shape[0], bool)
    if perturbed_indices is not None and perturbed_indices.shape == indices[0].shape:
        moved = np.moveaxis(perturbed_indices, axis, -1).reshape(rows_i.shape)
        unstable = (np.sort(moved, -1) != np.sort(rows_i, -1)).any(axis=1)
    bad = 0
    for row in np.flatnonzero((rows_i != rows_a).any(axis=1)):
        bad += _row_mismatches(rows_e[row], rows_i[row], rows_a[row], tie, bool(unstable[row]))
    if not bad:
        return value_result, Comparison(ie.dtype.name, 0.0, 0.0, 0.0, True, "ties differ")
    exact = _exact(np.moveaxis(ie, -1, axis), np.moveaxis(ia, -1, axis))
    return value_result, Comparison(
        exact.dtype,
        exact.max_abs,
        exact.max_rel,
        0.0,
        False,
        f"{bad} indices differ beyond ties",
        exact.worst_index,
        exact.expected,
        exact.actual,
    )


def _pair_order(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    # lexsort sorts by the last key first: value descending, then index ascending
    keys = np.stack([indices.astype(np.int64), -values.astype(np.float64)])
    flat = keys.reshape(2, -1, values.shape[-1])
    order = np.stack([np.lexsort(flat[:, r, :]) for r in range(flat.shape[1])])
    return order.reshape(values.shape)


def _row_mismatches(
    values: np.ndarray, expected: np.ndarray, actual: np.ndarray, tie: float, cut_may_move: bool
) -> int:
    """Indices of one row that differ beyond ties (groups of values within `tie`)."""
    groups: list[list[int]] = [[0]]
    for i in range(1, len(values)):
        if abs(float(values[i]) - float(values[groups[-1][-1]])) <= tie:
            groups[-1].append(i)
        else:
            groups.append([i])
    bad = 0
    for g, group in enumerate(groups):
        if g == len(groups) - 1 and cut_may_move:
            break  # the original's own choice at the cut moves with rounding
        if set(expected[group].tolist()) != set(actual[group].tolist()):
            bad += len(group)
    return bad
