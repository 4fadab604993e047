"""The per-token train/infer mismatch metrics of verify-alignment.

Pure torch, no model code: the training path is compared with the inference path per token with
:func:`token_metrics` (full logits on both sides) or :func:`topk_tail_metrics` (an engine that
returns only its top-k log-probs). Every function reduces over the vocabulary only and returns
one value per position; :class:`orbitctl.align.tokens.TokenTable` streams and summarises them.
The plain distances between two log-distributions (JS, log-softmax L1, top-k, entropy) are
:mod:`orbitctl.distances`, shared with the quantization report and the trainer.
"""

from __future__ import annotations

import math

import torch

from orbitctl.distances import entropy
from orbitctl.errors import UserError
from orbitctl.procmem import return_freed_heap


# ---------------------------------------------------------------------------------------------
# Per-token mismatch metrics between the train path (side a) and the infer path (side b).
#
# Inputs are raw logits [N, V] in any float dtype; -inf marks a masked vocabulary entry
# (padded vocabulary, constrained decoding). Everything is computed in float64 and in chunks
# of rows, so a 160k vocabulary never holds more than ``chunk_bytes`` of float64 temporaries.
# ---------------------------------------------------------------------------------------------

TOKEN_METRICS: tuple[str, ...] = (
    "js", "kl_train_infer", "kl_infer_train", "logsoftmax_l1", "logit_l1", "prob_l1",
    "top1_agree", "topk_overlap", "sampled_dp_abs", "sampled_dlogp_abs", "k3",
    "entropy_train", "entropy_infer",
)
"""Every per-token metric name, in display order."""

SAMPLED_METRICS: tuple[str, ...] = ("sampled_dp_abs", "sampled_dlogp_abs", "k3")
"""The metrics that exist only when the sampled token of each position is known."""

DEFAULT_CHUNK_BYTES = 256 * 2**20
"""Budget for the float64 temporaries of one chunk of rows."""

FLOAT64_COPIES = 8
"""How many [rows, V] float64 arrays one chunk keeps alive at its peak (measured, rounded up)."""

LN2 = math.log(2.0)


def rows_per_chunk(vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows of a [N, vocab] pair processed at once so the float64 temporaries stay under ``chunk_bytes``."""
    return max(1, int(chunk_bytes) // (max(1, vocab) * 8 * FLOAT64_COPIES))


def token_metrics(train_logits: torch.Tensor, infer_logits: torch.Tensor, sampled_ids: torch.Tensor | None = None,
                  *, k: int = 5, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """Every metric of :data:`TOKEN_METRICS` per token, float64 ``[N]`` each, from full logits ``[N, V]``.

    Side a is the train path, side b the infer path. ``js`` is in [0, ln 2], ``prob_l1`` = 2·TV in
    [0, 2]; the KLs are +inf where the first distribution has mass on an entry the second masks.
    ``logsoftmax_l1`` (shift-invariant) and ``logit_l1`` (raw) average |a - b| over the vocabulary
    entries that are not masked on both sides; an entry masked on one side only makes them +inf.
    ``top1_agree`` is 1 where the train argmax is among the infer path's maximal entries;
    ``topk_overlap`` = |top-k(a) ∩ top-k(b)| / k with k clipped to the unmasked entries of the row.
    With ``sampled_ids`` ``[N]`` (tokens drawn by the infer path) the sampled-token metrics are added:
    |Δp|, |Δlog p| and k3 = r - 1 - log r with r = p_train(y) / p_infer(y), whose mean estimates
    KL(infer‖train). Entropies are in nats.
    """
    n, vocab = _check_pair(train_logits, infer_logits)
    if k < 1:
        raise UserError(f"top-k overlap needs k >= 1 (got {k})", fix="set alignment.top_k to 1 or more")
    if sampled_ids is not None:
        _check_ids(sampled_ids, (n,), vocab, "sampled_ids")
    names = [m for m in TOKEN_METRICS if sampled_ids is not None or m not in SAMPLED_METRICS]
    return _by_chunks(n, rows_per_chunk(vocab, chunk_bytes), names, lambda s, e: _token_metrics_rows(
        train_logits[s:e], infer_logits[s:e], None if sampled_ids is None else sampled_ids[s:e], k, s))


def _token_metrics_rows(train: torch.Tensor, infer: torch.Tensor, sampled: torch.Tensor | None, k: int,
                        first_row: int = 0) -> dict:
    _check_logits(train, "train", first_row)
    _check_logits(infer, "infer", first_row)
    # private float64 copies on the input's device: they become log-probabilities in place below
    a = train.detach().to(torch.float64, copy=True)
    b = infer.detach().to(a.device, torch.float64, copy=True)
    out = {"logit_l1": _masked_mean_abs(a, b)}
    out["top1_agree"] = _top1_agree(a, b)
    out["topk_overlap"] = _topk_overlap(a, b, k)
    # raw logits are no longer needed: turn them into log-probabilities in place
    a.sub_(torch.logsumexp(a, -1, keepdim=True))
    b.sub_(torch.logsumexp(b, -1, keepdim=True))
    out.update(_distances(a, b))
    out["entropy_train"] = entropy(a)
    out["entropy_infer"] = entropy(b)
    if sampled is not None:
        y = sampled.to(a.device, torch.long)[:, None]
        out.update(_sampled(a.gather(1, y)[:, 0], b.gather(1, y)[:, 0]))
    return out


def _distances(la: torch.Tensor, lb: torch.Tensor) -> dict[str, torch.Tensor]:
    """JS, KL both ways, probability L1 and log-softmax L1 of two normalised float64 log-distributions."""
    ma, mb = torch.isneginf(la), torch.isneginf(lb)
    pa, pb = la.exp(), lb.exp()
    log_m = torch.logaddexp(la, lb) - LN2
    # 0·log 0 = 0: a masked entry contributes nothing to its own side's sums
    js_a = torch.where(ma, 0.0, pa * (la - log_m)).sum(-1)
    js_b = torch.where(mb, 0.0, pb * (lb - log_m)).sum(-1)
    del log_m
    out = {"js": (0.5 * (js_a + js_b)).clamp(0.0, LN2)}
    out["kl_train_infer"] = _kl(pa, la, lb, ma, mb)
    out["kl_infer_train"] = _kl(pb, lb, la, mb, ma)
    out["prob_l1"] = (pa - pb).abs_().sum(-1).clamp(0.0, 2.0)
    out["logsoftmax_l1"] = _masked_mean_abs(la, lb)
    return out


def _kl(p: torch.Tensor, lp: torch.Tensor, lq: torch.Tensor, mp: torch.Tensor, mq: torch.Tensor) -> torch.Tensor:
    kl = torch.where(mp, 0.0, p * (lp - lq)).sum(-1).clamp_min(0.0)
    # mass (however small) where the other side masks: infinite, even if exp() underflowed to 0
    return kl.masked_fill((mq & ~mp).any(-1), math.inf)


def _masked_mean_abs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean |x - y| over entries not masked on both sides; +inf where one side alone masks an entry."""
    both = torch.isneginf(x) & torch.isneginf(y)
    total = torch.where(both, 0.0, (x - y).abs()).sum(-1)
    return total / (x.shape[-1] - both.sum(-1)).to(torch.float64)


def _top1_agree(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 where the train argmax is among the infer path's maximal entries (ties count as agreement)."""
    pick = a.argmax(-1, keepdim=True)
    return (b.gather(1, pick)[:, 0] == b.max(-1).values).to(torch.float64)


def _topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    unmasked = torch.minimum((~torch.isneginf(a)).sum(-1), (~torch.isneginf(b)).sum(-1))
    k_eff = unmasked.clamp(max=k)
    shared = (_topk_members(a, k_eff) & _topk_members(b, k_eff)).sum(-1)
    return shared.to(torch.float64) / k_eff.to(torch.float64)


def _topk_members(x: torch.Tensor, k_eff: torch.Tensor) -> torch.Tensor:
    """Boolean ``[N, V]``: the k_eff largest entries of each row, ties at the boundary going to the lower index.

    torch.topk breaks ties arbitrarily; bf16 logits tie often, and the overlap must not depend on it.
    """
    kth = x.topk(int(k_eff.max()), -1).values.gather(1, (k_eff - 1).clamp_min(0)[:, None])
    above = x > kth
    at = x == kth
    room = k_eff[:, None] - above.sum(-1, keepdim=True)
    return above | (at & (at.cumsum(-1) <= room))


def _sampled(lpa_y: torch.Tensor, lpb_y: torch.Tensor) -> dict[str, torch.Tensor]:
    """|Δp|, |Δlog p| and k3 of the sampled token from its log-probability on each side."""
    lpa_y, lpb_y = lpa_y.to(torch.float64), lpb_y.to(torch.float64)
    both = torch.isneginf(lpa_y) & torch.isneginf(lpb_y)
    one = torch.isneginf(lpa_y) ^ torch.isneginf(lpb_y)
    d = lpa_y - lpb_y  # log r
    # r - 1 - log r = expm1(log r) - log r keeps precision when the paths nearly agree
    k3 = (torch.expm1(d) - d).clamp_min(0.0)
    return {
        "sampled_dp_abs": (lpa_y.exp() - lpb_y.exp()).abs(),
        "sampled_dlogp_abs": torch.where(both, 0.0, d.abs()),
        "k3": torch.where(both, 0.0, torch.where(one, math.inf, k3)),
    }


def _by_chunks(n: int, step: int, names: list[str], rows) -> dict[str, torch.Tensor]:
    """Run ``rows(start, end)`` over chunks of rows, writing each chunk's values into ``[n]`` outputs.

    The outputs are allocated before the first chunk and each chunk's results are dropped before
    the next starts: small tensors that outlive a chunk would pin the allocator's heap between the
    chunk-sized holes, and resident memory would then grow with the number of chunks.
    """
    out = {m: torch.empty(n, dtype=torch.float64) for m in names}
    for start in range(0, n, step):
        part = rows(start, min(n, start + step))
        for m in names:
            out[m][start:start + step].copy_(part[m])
        del part
        return_freed_heap()
    return out


def _check_pair(train_logits: torch.Tensor, infer_logits: torch.Tensor) -> tuple[int, int]:
    if train_logits.dim() != 2 or train_logits.shape != infer_logits.shape:
        raise UserError(f"train and infer logits must both be [tokens, vocab] of one shape "
                        f"(got {tuple(train_logits.shape)} and {tuple(infer_logits.shape)})")
    for name, x in (("train", train_logits), ("infer", infer_logits)):
        if not x.is_floating_point():
            raise UserError(f"{name} logits must be floating point (got {x.dtype})")
    return train_logits.shape[0], train_logits.shape[1]


def _check_logits(x: torch.Tensor, name: str, first_row: int) -> None:
    """Called per chunk, so the boolean temporaries stay chunk-sized too."""
    bad = torch.isnan(x) | torch.isposinf(x)
    if bad.any():
        row = first_row + int(bad.any(-1).nonzero()[0, 0])
        raise UserError(f"{name} logits row {row} holds NaN or +inf; only -inf (a masked entry) is allowed")
    dead = torch.isneginf(x).all(-1)
    if dead.any():
        row = first_row + int(dead.nonzero()[0, 0])
        raise UserError(f"{name} logits row {row} masks every vocabulary entry (all -inf)")


def _check_ids(ids: torch.Tensor, shape: tuple[int, ...], vocab: int, name: str, *, allow_absent: bool = False) -> None:
    if ids.is_floating_point() or ids.dtype == torch.bool or tuple(ids.shape) != shape:
        raise UserError(f"{name} must be integer token ids of shape {shape} (got {ids.dtype} {tuple(ids.shape)})")
    low = -1 if allow_absent else 0
    if ids.numel() and (int(ids.min()) < low or int(ids.max()) >= vocab):
        raise UserError(f"{name} holds a token id outside [0, {vocab}) (min {int(ids.min())}, max {int(ids.max())})")


# ---------------------------------------------------------------------------------------------
# A rollout engine that returns only its top-K log-probs (OpenAI ``top_logprobs``).
# ---------------------------------------------------------------------------------------------

COARSE_GRAIN_NOTE = (
    "The engine returned only its top-K log-probs, so JS, both KLs and probability L1 are computed on "
    "coarse-grained buckets: each token in the engine's top-K or sampled (known on both sides) plus one "
    "tail bucket holding the remaining mass. Merging tokens never increases these divergences "
    "(data-processing inequality), so they are lower bounds of the full-vocabulary values, and so is "
    "entropy_infer. Log-softmax L1 is averaged over the buckets instead of the vocabulary: it is not "
    "comparable with the full-vocabulary value. Sampled-token |Δp|, |Δlog p| and k3 are exact."
)
"""What a report says about metrics computed from top-K log-probs."""

TAIL_RESOLUTION = 1e-6
"""Smallest tail mass an engine's float32 log-probs resolve: when its top-K mass reaches 1, its
tail is taken as min(train tail, this) rather than 0, so rounding alone never reads as an infinite KL."""


def topk_tail_metrics(train_logits: torch.Tensor, infer_ids: torch.Tensor, infer_logp: torch.Tensor,
                      sampled_ids: torch.Tensor, sampled_infer_logp: torch.Tensor, *, k: int,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """Per-token metrics against an engine that returned only its top-K log-probs.

    ``train_logits`` ``[N, V]`` are the train path's full logits; ``infer_ids`` ``[N, K]`` (long, -1 =
    absent) and ``infer_logp`` ``[N, K]`` the engine's top-K tokens and log-probs; ``sampled_ids`` and
    ``sampled_infer_logp`` ``[N]`` the token it sampled and its log-prob.

    Both distributions are coarse-grained onto the same buckets: every distinct id of the top-K set
    and the sampled id, plus one tail bucket with the rest of the mass (the engine's is 1 - Σ known;
    the train path's is the logsumexp of its complement, exact in float64). ``js``, both KLs and
    ``prob_l1`` on the buckets are LOWER BOUNDS of the full-vocabulary values (data-processing
    inequality: merging outcomes never increases an f-divergence), as is ``entropy_infer``;
    ``logsoftmax_l1`` is the mean |Δlog p| over the buckets, not comparable with the full value.
    ``sampled_dp_abs``, ``sampled_dlogp_abs``, ``k3`` and ``entropy_train`` are exact;
    ``top1_agree`` compares the train argmax with the engine's most likely known token and
    ``topk_overlap`` the train top-k with the engine's (k <= K). ``logit_l1`` is absent.
    """
    if train_logits.dim() != 2:
        raise UserError(f"train logits must be [tokens, vocab] (got {tuple(train_logits.shape)})")
    n, vocab = train_logits.shape
    if not train_logits.is_floating_point():
        raise UserError(f"train logits must be floating point (got {train_logits.dtype})")
    if infer_ids.dim() != 2 or infer_logp.shape != infer_ids.shape:
        raise UserError(f"engine top-k ids and log-probs must both be [tokens, K] "
                        f"(got {tuple(infer_ids.shape)} and {tuple(infer_logp.shape)})")
    _check_ids(infer_ids, (n, infer_ids.shape[1]), vocab, "engine top-k ids", allow_absent=True)
    _check_ids(sampled_ids, (n,), vocab, "sampled_ids")
    if sampled_infer_logp.shape != (n,):
        raise UserError(f"sampled-token log-probs must be [{n}] (got {tuple(sampled_infer_logp.shape)})")
    if torch.isnan(infer_logp).any() or torch.isnan(sampled_infer_logp).any():
        raise UserError("engine log-probs hold NaN")
    if not 1 <= k <= infer_ids.shape[1]:
        raise UserError(f"top-k overlap needs 1 <= k <= K = {infer_ids.shape[1]} engine top log-probs (got k={k})",
                        fix="request more top_logprobs from the engine or lower alignment.top_k")
    names = [m for m in TOKEN_METRICS if m != "logit_l1"]
    return _by_chunks(n, rows_per_chunk(vocab, chunk_bytes), names, lambda s, e: _topk_tail_rows(
        train_logits[s:e], infer_ids[s:e], infer_logp[s:e], sampled_ids[s:e], sampled_infer_logp[s:e], k, s))


def _topk_tail_rows(train, infer_ids, infer_logp, sampled, sampled_lp, k, first_row=0) -> dict[str, torch.Tensor]:
    _check_logits(train, "train", first_row)
    la = train.detach().to(torch.float64, copy=True)
    la.sub_(torch.logsumexp(la, -1, keepdim=True))
    vocab, dev = la.shape[1], la.device
    sampled = sampled.to(dev, torch.long)
    ids = torch.cat([infer_ids.to(dev, torch.long), sampled[:, None]], 1)
    # a log-prob above 0 is the engine's rounding
    sampled_lp = sampled_lp.to(dev, torch.float64).clamp_max(0.0)
    lpb = torch.cat([infer_logp.to(dev, torch.float64).clamp_max(0.0), sampled_lp[:, None]], 1)
    known = _first_occurrences(ids)
    # absent and repeated slots point at the sampled id, which is always known: scattering and
    # gathering through them is harmless
    safe = torch.where(known, ids, sampled[:, None])
    lpa = torch.where(known, la.gather(1, safe), -math.inf)
    lpb = torch.where(known, lpb, -math.inf)

    # train tail: logsumexp over the complement of the known ids, never 1 - Σ, which loses every
    # digit below 1e-16
    hits = torch.zeros(la.shape, dtype=torch.bool, device=dev).scatter_(1, safe, True)
    tail_a = torch.logsumexp(la.masked_fill(hits, -math.inf), -1)
    del hits
    rest_b = 1.0 - lpb.exp().sum(-1)
    tail_b = torch.where(rest_b > 0, torch.log(rest_b.clamp_min(1e-300)),
                         torch.minimum(tail_a, torch.full_like(tail_a, math.log(TAIL_RESOLUTION))))
    no_tail = known.sum(-1) >= vocab  # the known ids cover the whole vocabulary: no tail bucket
    tail_a = tail_a.masked_fill(no_tail, -math.inf)
    tail_b = tail_b.masked_fill(no_tail, -math.inf)
    bucket_a = torch.cat([lpa, tail_a[:, None]], 1)
    bucket_b = torch.cat([lpb, tail_b[:, None]], 1)

    out = _distances(bucket_a, bucket_b)
    out["entropy_train"] = entropy(la)
    out["entropy_infer"] = entropy(bucket_b)
    # the engine's ranking of the tokens it reported (stable: its own order breaks ties)
    engine_top = safe.gather(1, torch.sort(lpb, dim=-1, descending=True, stable=True).indices)
    pick = la.argmax(-1, keepdim=True)
    best_b = lpb.max(-1).values
    pick_b = torch.where((ids == pick) & known, lpb, -math.inf).max(-1).values
    out["top1_agree"] = (pick_b == best_b).to(torch.float64)
    unmasked = (~torch.isneginf(la)).sum(-1)
    k_eff = torch.minimum(unmasked, known.sum(-1)).clamp(max=k)
    live = torch.arange(k, device=dev)[None, :] < k_eff[:, None]
    shared = (_topk_members(la, k_eff).gather(1, engine_top[:, :k]) & live).sum(-1)
    out["topk_overlap"] = shared.to(torch.float64) / k_eff.to(torch.float64)
    out.update(_sampled(la.gather(1, sampled[:, None])[:, 0], sampled_lp))
    return out


def _first_occurrences(ids: torch.Tensor) -> torch.Tensor:
    """True at each present id (>= 0) not already seen earlier in its row."""
    present = ids >= 0
    same = (ids[:, :, None] == ids[:, None, :]) & present[:, None, :]
    earlier = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril(-1)
    return present & ~(same & earlier).any(-1)
