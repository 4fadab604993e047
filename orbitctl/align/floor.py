"""The kernel floor: how far the infer path and the train path part when the weights are the same.

Incremental KV-cache decoding (one row of new tokens at a time) and one full-sequence forward
multiply the same weights by the same activations, but a CPU's or a GPU's GEMM may reduce a
one-row product in another order than a many-row one, and every layer rounds its output to the
compute dtype. So even with the same weights and the same unmerged adapter, the two paths agree
bit for bit only on some machines (measured: yes on an AVX512-BF16 CPU, no with the same CPU's
kernels capped to AVX2, never on a GPU). That residual is the floor; a comparison is about
weights or formats only where it stands clear of it.

The floor is measured on the machine that runs the comparison: the trainer's own weights decode
the compared tokens through the KV cache (teacher-forced) and are compared with the trainer's
full-sequence forward of the same tokens. When the comparison itself uses one model on both
paths, it *is* the floor and no second pass is needed.

``dtype_bound`` states what the compute dtype alone explains: if every logit of the two paths
differs by at most ``delta``, then ``JS <= delta**2 / 4`` (Hoeffding's lemma bounds each KL by
``range**2 / 8`` and ``JS <= (KL(p||q) + KL(q||p)) / 4``; the range is at most ``2 * delta``),
and ``|dlog p|`` of any token and the mean log-softmax L1 are at most ``2 * delta``. With
``delta`` = ``ulps`` units in the last place of the largest logit, ``ulp <= eps * |logit|``.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOOR_METRICS: tuple[str, ...] = ("js", "logsoftmax_l1", "sampled_dlogp_abs")
"""The distances the floor is summed up in (it holds mean and max of every per-token metric)."""
FLOOR_MARGIN = 10.0
"""A per-layer jump is attributed to weights or format only where it is at least this many times the floor."""
SAME_MODEL = "this comparison (one model on both paths)"
"""``measured_as`` where the comparison itself is the floor."""
_EPS = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def dtype_eps(dtype_name: str) -> float:
    """Spacing of the dtype's numbers at 1.0 (``torch.finfo(dtype).eps``), by name (``bfloat16``, ...)."""
    name = str(dtype_name).removeprefix("torch.")
    if name not in _EPS:
        raise ValueError(f"no epsilon for dtype {dtype_name!r}")
    return _EPS[name]


def dtype_bound(dtype_name: str, logit_absmax: float, ulps: float = 1.0) -> dict[str, float]:
    """Bounds on the distances when every logit differs by at most ``ulps`` ulps of the largest one."""
    delta = ulps * dtype_eps(dtype_name) * logit_absmax
    return {"delta_logit": delta, "js": delta * delta / 4.0, "logsoftmax_l1": 2.0 * delta,
            "sampled_dlogp_abs": 2.0 * delta}


@dataclass
class KernelFloor:
    """The floor measured for one comparison."""

    measured_as: str
    """How: :data:`SAME_MODEL` (one model on both paths) or the second pass that measured it."""
    compute_dtype: str
    """The dtype the logits were computed in (``bfloat16``, ``float32``, ...)."""
    summary: dict[str, dict[str, float]]
    """``{metric: {"mean", "max"}}`` for every per-token metric the source provides."""
    logit_absmax: float
    """Largest |logit| on the train path over the compared tokens (temperature-scaled)."""
    layers: list[float] | None = None
    """Per-layer hidden-state relative error with the same weights, when ``--per-layer`` ran."""

    @property
    def is_the_comparison(self) -> bool:
        """True where one model served both paths, so the comparison is the floor itself."""
        return self.measured_as == SAME_MODEL

    def bound(self) -> dict[str, float]:
        """:func:`dtype_bound` for one ulp of the largest logit in this floor's dtype."""
        return dtype_bound(self.compute_dtype, self.logit_absmax)

    def times(self, summary: dict, metric: str, statistic: str = "mean") -> float | None:
        """How many times the floor a comparison's ``metric`` is (inf where the floor is exactly 0)."""
        if metric not in summary or metric not in self.summary:
            return None
        value, floor = float(summary[metric][statistic]), float(self.summary[metric][statistic])
        if floor > 0:
            return value / floor
        return 1.0 if value == 0 else float("inf")

    def to_dict(self) -> dict:
        doc = {"measured_as": self.measured_as, "compute_dtype": self.compute_dtype,
               "logit_absmax": self.logit_absmax, "metrics": self.summary, "dtype_bound_1ulp": self.bound()}
        if self.layers is not None:
            doc["per_layer"] = self.layers
        return doc


def floor_from_table(table, *, measured_as: str, compute_dtype: str, logit_absmax: float,
                     layers: list[float] | None = None) -> KernelFloor:
    """A :class:`KernelFloor` from a :class:`~orbitctl.align.tokens.TokenTable` of same-weight comparisons."""
    summary = table.summary()
    kept = {m: {"mean": stats["mean"], "max": stats["max"]} for m, stats in summary.items()}
    return KernelFloor(measured_as, compute_dtype, kept, float(logit_absmax), layers)


def clear_of_floor(value: float, floor: float | None, margin: float = FLOOR_MARGIN) -> bool:
    """True where ``value`` stands at least ``margin`` times above ``floor`` (always, without a floor)."""
    return floor is None or value >= margin * floor
