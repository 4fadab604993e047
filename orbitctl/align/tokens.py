"""Per-token mismatch values accumulated over many batches, and their summary.

A :class:`TokenTable` takes train/infer logits batch by batch (``add``), full train logits against an
engine's top-K log-probs (``add_topk``) or per-token values computed elsewhere (``add_values``), keeps one
float64 value per token and metric, and summarises each metric by mean, p99, max and min over
tokens. Full logits are processed in chunks of rows, so a 160k vocabulary over many tokens never
holds more than one chunk of float64 temporaries; only the ``[N]`` per-token values are kept.

    table = TokenTable(k=5)
    for train_logits, infer_logits, sampled in batches:
        table.add(train_logits, infer_logits, sampled)
    table.summary()["js"]["p99"]
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import torch

from orbitctl.align.metrics import (
    COARSE_GRAIN_NOTE,
    DEFAULT_CHUNK_BYTES,
    TOKEN_METRICS,
    token_metrics,
    topk_tail_metrics,
)

SUMMARY_STATS: tuple[str, ...] = ("mean", "p99", "max", "min")
"""The statistics :meth:`TokenTable.summary` gives for every metric."""


class TokenTable:
    """Per-token values of the metrics in :data:`~orbitctl.align.metrics.TOKEN_METRICS`, streamed in."""

    def __init__(self, *, k: int = 5, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.k = k
        self.chunk_bytes = chunk_bytes
        self._parts: dict[str, list[torch.Tensor]] = {}
        self._n_tokens = 0
        self.coarse_grained = False
        """True once values came from an engine's top-k log-probs (see COARSE_GRAIN_NOTE)."""

    @property
    def n_tokens(self) -> int:
        """Tokens added so far."""
        return self._n_tokens

    @property
    def names(self) -> tuple[str, ...]:
        """The metrics this table holds, in display order."""
        return tuple(m for m in TOKEN_METRICS if m in self._parts)

    def add(self, train_logits: torch.Tensor, infer_logits: torch.Tensor,
            sampled_ids: torch.Tensor | None = None) -> None:
        """Compare full train and infer logits ``[N, V]`` and append the N tokens' values."""
        self.add_values(token_metrics(train_logits, infer_logits, sampled_ids, k=self.k,
                                      chunk_bytes=self.chunk_bytes))

    def add_topk(self, train_logits: torch.Tensor, infer_ids: torch.Tensor, infer_logp: torch.Tensor,
                 sampled_ids: torch.Tensor, sampled_infer_logp: torch.Tensor) -> None:
        """Compare full train logits with an engine's top-K log-probs (see ``topk_tail_metrics``) and append."""
        self.add_values(topk_tail_metrics(train_logits, infer_ids, infer_logp, sampled_ids, sampled_infer_logp,
                                          k=self.k, chunk_bytes=self.chunk_bytes))
        self.coarse_grained = True

    def add_values(self, values: Mapping[str, torch.Tensor]) -> None:
        """Append per-token values computed elsewhere: ``{metric: [N]}``; metrics not given stay absent.

        Every batch must bring the same metrics, so that each metric's values line up with the tokens.
        """
        unknown = sorted(set(values) - set(TOKEN_METRICS))
        if unknown:
            raise ValueError(f"unknown token metric(s) {unknown}; known: {', '.join(TOKEN_METRICS)}")
        if not values:
            raise ValueError("add_values needs at least one metric")
        if self._parts and set(values) != set(self._parts):
            raise ValueError(f"this table holds {sorted(self._parts)}; a batch brought {sorted(values)}")
        shapes = {name: tuple(v.shape) for name, v in values.items()}
        if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
            raise ValueError(f"per-token values must all be [N] of one length (got {shapes})")
        n = next(iter(shapes.values()))[0]
        for name, v in values.items():
            self._parts.setdefault(name, []).append(v.detach().to("cpu", torch.float64).clone())
        self._n_tokens += n

    def extend(self, other: TokenTable) -> None:
        """Append every token of another table (same metrics)."""
        if other.n_tokens or other.names:
            self.add_values({name: other.values(name) for name in other.names})
        self.coarse_grained = self.coarse_grained or other.coarse_grained

    def values(self, name: str) -> torch.Tensor:
        """The per-token values of one metric, float64 ``[N]``."""
        if name not in self._parts:
            raise KeyError(f"metric {name!r} not in this table (it holds {', '.join(self.names) or 'nothing'})")
        parts = self._parts[name]
        if len(parts) > 1:  # concatenate once, then keep the single tensor
            self._parts[name] = parts = [torch.cat(parts)]
        return parts[0]

    def summary(self) -> dict[str, dict[str, float]]:
        """``{metric: {"mean", "p99", "max", "min"}}`` over tokens (NaN for an empty table; may be inf)."""
        return {name: summarise(self.values(name)) for name in self.names}

    def to_dict(self) -> dict:
        """A JSON-safe document: token count, summary and, for top-k values, the coarse-graining note.

        Non-finite figures become the strings "inf", "-inf" and "nan" (strict JSON has no infinity).
        """
        doc = {
            "tokens": self.n_tokens,
            "metrics": {name: {s: _json_float(v) for s, v in stats.items()} for name, stats in self.summary().items()},
        }
        if self.coarse_grained:
            doc["note"] = COARSE_GRAIN_NOTE
        return doc

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict())


def summarise(values: torch.Tensor) -> dict[str, float]:
    """Mean, p99 (linear interpolation, as numpy's default), max and min of a 1-D tensor."""
    v = values.detach().to("cpu", torch.float64).flatten()
    if v.numel() == 0:
        return {s: math.nan for s in SUMMARY_STATS}
    return {"mean": float(v.mean()), "p99": percentile(v, 99.0), "max": float(v.max()), "min": float(v.min())}


def percentile(values: torch.Tensor, q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default method).

    Written out rather than torch.quantile so an infinite value (a KL where one side masks a token)
    gives inf above it and never NaN from inf·0.
    """
    v = values.detach().to("cpu", torch.float64).flatten().sort().values
    if v.numel() == 0:
        return math.nan
    h = (v.numel() - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, v.numel() - 1)
    frac = h - lo
    below, above = float(v[lo]), float(v[hi])
    if frac == 0.0 or below == above:
        return below
    return below + (above - below) * frac


def _json_float(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x
