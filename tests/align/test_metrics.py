"""Per-token train/infer mismatch metrics against an independent float64 computation.

The reference below is written from the definitions with numpy, one row at a time, sharing no
code with orbitctl.align.metrics.
"""

import json
import math

import numpy as np
import pytest
import torch

from orbitctl.align.metrics import (
    COARSE_GRAIN_NOTE,
    TOKEN_METRICS,
    rows_per_chunk,
    token_metrics,
    topk_tail_metrics,
)
from orbitctl.align.tokens import TokenTable, percentile
from orbitctl.errors import UserError

LN2 = math.log(2.0)
DISTANCES = ("js", "kl_train_infer", "kl_infer_train", "logsoftmax_l1", "logit_l1", "prob_l1")


def reference_row(a: np.ndarray, b: np.ndarray, y: int | None, k: int) -> dict[str, float]:
    """Every metric for one position, from the definitions (numpy float64)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    ma, mb = np.isneginf(a), np.isneginf(b)
    pa = np.where(ma, 0.0, np.exp(a - a[~ma].max()))
    pa /= pa.sum()
    pb = np.where(mb, 0.0, np.exp(b - b[~mb].max()))
    pb /= pb.sum()
    # log-probabilities from log-sum-exp, so tiny probabilities keep their digits
    la = np.full_like(a, -np.inf)
    la[~ma] = a[~ma] - (a[~ma].max() + np.log(np.exp(a[~ma] - a[~ma].max()).sum()))
    lb = np.full_like(b, -np.inf)
    lb[~mb] = b[~mb] - (b[~mb].max() + np.log(np.exp(b[~mb] - b[~mb].max()).sum()))
    m = 0.5 * (pa + pb)
    sa, sb = ~ma, ~mb
    js = 0.5 * np.sum(pa[sa] * (la[sa] - np.log(m[sa]))) + 0.5 * np.sum(pb[sb] * (lb[sb] - np.log(m[sb])))

    def kl(p, lp, lq, sp, mq):
        if np.any(sp & mq):
            return math.inf
        return float(np.sum(p[sp] * (lp[sp] - lq[sp])))

    keep = ~(ma & mb)
    one_sided = np.any(ma ^ mb)
    out = {
        "js": js,
        "kl_train_infer": kl(pa, la, lb, sa, mb),
        "kl_infer_train": kl(pb, lb, la, sb, ma),
        "logsoftmax_l1": math.inf if one_sided else float(np.abs(la[keep] - lb[keep]).mean()),
        "logit_l1": math.inf if one_sided else float(np.abs(a[keep] - b[keep]).mean()),
        "prob_l1": float(np.abs(pa - pb).sum()),
        "top1_agree": float(b[int(np.argmax(a))] == b.max()),
        "entropy_train": float(-np.sum(pa[sa] * la[sa])),
        "entropy_infer": float(-np.sum(pb[sb] * lb[sb])),
    }
    kk = min(k, int(sa.sum()), int(sb.sum()))
    top_a = set(np.argsort(-a, kind="stable")[:kk].tolist())
    top_b = set(np.argsort(-b, kind="stable")[:kk].tolist())
    out["topk_overlap"] = len(top_a & top_b) / kk
    if y is not None:
        r = math.exp(la[y] - lb[y])
        out["sampled_dp_abs"] = abs(math.exp(la[y]) - math.exp(lb[y]))
        out["sampled_dlogp_abs"] = abs(la[y] - lb[y])
        out["k3"] = r - 1.0 - math.log(r)
    return out


def assert_close(got: torch.Tensor, want: list[float], tol: float, name: str) -> None:
    got_np = got.numpy()
    want_np = np.array(want)
    assert got.dtype == torch.float64, name
    assert np.array_equal(np.isinf(got_np), np.isinf(want_np)), f"{name}: inf positions differ"
    finite = np.isfinite(want_np)
    err = np.abs(got_np[finite] - want_np[finite])
    assert np.all(err <= tol * np.maximum(1.0, np.abs(want_np[finite]))), f"{name}: max error {err.max():.3e}"


def random_pair(n, v, gen, *, scale=3.0, noise=0.3, dtype=torch.float64, mask=True):
    a = torch.randn(n, v, generator=gen, dtype=torch.float64) * scale
    b = a + noise * torch.randn(n, v, generator=gen, dtype=torch.float64)
    if mask and v > 4:
        both = torch.rand(n, v, generator=gen) < 0.1
        a[both] = -math.inf
        b[both] = -math.inf
    return a.to(dtype), b.to(dtype)


def test_names_are_in_display_order():
    assert TOKEN_METRICS[:3] == ("js", "kl_train_infer", "kl_infer_train")
    assert len(set(TOKEN_METRICS)) == 13


def test_identical_inputs_give_zero_distance_and_full_agreement():
    gen = torch.Generator().manual_seed(1)
    a, _ = random_pair(9, 300, gen)
    y = torch.randint(0, 300, (9,), generator=gen)
    y = torch.where(torch.isneginf(a.gather(1, y[:, None]))[:, 0], a.argmax(-1), y)
    m = token_metrics(a, a.clone(), y, k=5)
    for name in (*DISTANCES, "sampled_dp_abs", "sampled_dlogp_abs", "k3"):
        assert torch.all(m[name].abs() < 1e-15), name
    assert torch.equal(m["top1_agree"], torch.ones(9, dtype=torch.float64))
    assert torch.equal(m["topk_overlap"], torch.ones(9, dtype=torch.float64))
    assert torch.equal(m["entropy_train"], m["entropy_infer"])


def test_disjoint_supports_give_ln2_and_total_variation_two():
    a = torch.tensor([[1.0, 2.0, -math.inf, -math.inf, -math.inf]])
    b = torch.tensor([[-math.inf, -math.inf, 0.5, 0.1, -math.inf]])
    m = token_metrics(a, b, k=2)
    assert abs(m["js"].item() - LN2) < 1e-15
    assert abs(m["prob_l1"].item() - 2.0) < 1e-15
    assert m["kl_train_infer"].item() == math.inf and m["kl_infer_train"].item() == math.inf
    assert m["logsoftmax_l1"].item() == math.inf
    assert m["top1_agree"].item() == 0.0 and m["topk_overlap"].item() == 0.0
    assert "k3" not in m and "sampled_dp_abs" not in m


def test_log_softmax_l1_ignores_a_constant_shift_while_raw_logit_l1_does_not():
    gen = torch.Generator().manual_seed(2)
    a, b = random_pair(6, 400, gen)
    before = token_metrics(a, b, k=5)
    after = token_metrics(a + 7.25, b, k=5)
    for name in TOKEN_METRICS:
        if name in before and name != "logit_l1":
            assert torch.allclose(before[name], after[name], rtol=0, atol=1e-12), name
    assert torch.all((after["logit_l1"] - before["logit_l1"]).abs() > 1.0)
    same = token_metrics(a + 7.25, a, k=5)
    assert torch.all(same["logsoftmax_l1"] < 1e-12)
    assert torch.allclose(same["logit_l1"], torch.full((6,), 7.25, dtype=torch.float64))


def test_entries_masked_on_both_sides_are_ignored():
    gen = torch.Generator().manual_seed(3)
    a, b = random_pair(5, 200, gen, mask=False)
    pad = torch.full((5, 56), -math.inf, dtype=torch.float64)  # a padded vocabulary
    plain = token_metrics(a, b, k=5)
    padded = token_metrics(torch.cat([a, pad], 1), torch.cat([b, pad], 1), k=5)
    for name in plain:
        assert torch.allclose(plain[name], padded[name], rtol=1e-13, atol=1e-15), name


def test_an_entry_masked_on_one_side_only():
    a = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[2.0, 1.0, -math.inf, -1.0]], dtype=torch.float64)
    m = token_metrics(a, b, torch.tensor([2]), k=3)
    assert m["kl_train_infer"].item() == math.inf  # train has mass where infer masks
    assert math.isfinite(m["kl_infer_train"].item())
    assert 0.0 < m["js"].item() < LN2
    assert m["logsoftmax_l1"].item() == math.inf and m["logit_l1"].item() == math.inf
    assert m["sampled_dlogp_abs"].item() == math.inf and m["k3"].item() == math.inf
    assert math.isfinite(m["sampled_dp_abs"].item())
    want = reference_row(a[0].numpy(), b[0].numpy(), 2, 3)
    assert abs(m["kl_infer_train"].item() - want["kl_infer_train"]) < 1e-15
    assert abs(m["js"].item() - want["js"]) < 1e-15


@pytest.mark.parametrize("n,v,dtype", [
    (1, 7, torch.float64), (17, 1000, torch.float64), (11, 3000, torch.float32),
    (9, 2500, torch.bfloat16), (3, 50_000, torch.float64), (2, 50_000, torch.bfloat16),
])
def test_random_cases_agree_with_the_reference(n, v, dtype):
    gen = torch.Generator().manual_seed(n * 1000 + v)
    a, b = random_pair(n, v, gen, dtype=dtype)
    if v > 10:  # one-sided masks on a couple of rows
        a[0, 3] = -math.inf
        b[-1, 5] = -math.inf
    y = torch.stack([row.float().argmax() if torch.rand(1, generator=gen) < 0.5 else
                     torch.multinomial(torch.softmax(row.float(), -1), 1, generator=gen)[0] for row in b])
    got = token_metrics(a, b, y, k=7)
    # the reference sees the very same (already rounded) input values, so the tolerance is float64's
    want = [reference_row(a[i].double().numpy(), b[i].double().numpy(), int(y[i]), 7) for i in range(n)]
    for name in TOKEN_METRICS:
        assert got[name].shape == (n,)
        assert_close(got[name], [w[name] for w in want], 1e-9, name)


def test_table_fed_in_uneven_pieces_with_a_tiny_chunk_equals_one_shot():
    gen = torch.Generator().manual_seed(4)
    a, b = random_pair(61, 500, gen, dtype=torch.float32)
    y = torch.multinomial(torch.softmax(b.float(), -1), 1, generator=gen)[:, 0]
    whole = token_metrics(a, b, y, k=4)
    table = TokenTable(k=4, chunk_bytes=1)  # one row per chunk
    assert rows_per_chunk(500, 1) == 1
    cuts = [0, 1, 9, 10, 24, 40, 41, 61]  # 7 pieces, one of a single row
    for lo, hi in zip(cuts, cuts[1:]):
        table.add(a[lo:hi], b[lo:hi], y[lo:hi])
    assert table.n_tokens == 61
    assert table.names == TOKEN_METRICS
    for name in TOKEN_METRICS:  # equal up to the summation order of one row versus many
        assert torch.allclose(table.values(name), whole[name], rtol=1e-13, atol=1e-16), name
    summary = table.summary()
    for name in TOKEN_METRICS:
        v = whole[name].numpy()
        assert summary[name]["p99"] == pytest.approx(np.percentile(v, 99), rel=1e-12, abs=1e-15)
        assert summary[name]["mean"] == pytest.approx(v.mean(), rel=1e-12, abs=1e-15)
        assert summary[name]["max"] == v.max() and summary[name]["min"] == v.min()
    doc = json.loads(table.to_json())
    assert doc["tokens"] == 61 and set(doc["metrics"]["js"]) == {"mean", "p99", "max", "min"}


def test_chunk_size_follows_the_memory_budget():
    assert rows_per_chunk(160_000) >= 1
    assert rows_per_chunk(160_000) * 160_000 * 8 * 6 <= 256 * 2**20
    assert rows_per_chunk(10, 256 * 2**20) > 100_000


def test_percentile_matches_numpy_and_survives_infinite_values():
    gen = np.random.default_rng(5)
    for n in (1, 2, 7, 100, 1001):
        v = gen.standard_normal(n)
        assert percentile(torch.from_numpy(v), 99.0) == pytest.approx(np.percentile(v, 99), rel=1e-12, abs=1e-15)
    v = torch.tensor([0.1] * 200 + [math.inf], dtype=torch.float64)
    assert percentile(v, 99.0) == 0.1 and percentile(v, 100.0) == math.inf
    table = TokenTable()
    table.add_values({"kl_train_infer": v})
    doc = table.to_dict()
    assert doc["metrics"]["kl_train_infer"]["max"] == "inf" and doc["metrics"]["kl_train_infer"]["mean"] == "inf"
    json.dumps(doc, allow_nan=False)


def test_table_rejects_batches_with_other_metrics_and_extends():
    first, second = TokenTable(), TokenTable()
    first.add_values({"js": torch.tensor([0.1, 0.2]), "k3": torch.tensor([0.0, 1.0])})
    second.add_values({"js": torch.tensor([0.3]), "k3": torch.tensor([2.0])})
    first.extend(second)
    assert first.n_tokens == 3 and first.names == ("js", "k3")
    assert torch.equal(first.values("k3"), torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="holds"):
        first.add_values({"js": torch.tensor([0.1])})
    with pytest.raises(ValueError, match="unknown"):
        first.add_values({"jsd": torch.tensor([0.1])})
    with pytest.raises(KeyError, match="logit_l1"):
        first.values("logit_l1")


def test_k3_is_nonnegative_and_estimates_kl_infer_train_from_infer_samples():
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(3, 40, generator=gen, dtype=torch.float64)
    b = a + 0.4 * torch.randn(3, 40, generator=gen, dtype=torch.float64)
    samples = 40_000
    for row in range(3):
        y = torch.multinomial(torch.softmax(b[row], -1), samples, replacement=True, generator=gen)
        m = token_metrics(a[row].expand(samples, 40), b[row].expand(samples, 40), y, k=5)
        assert torch.all(m["k3"] >= 0)
        kl = m["kl_infer_train"][0].item()
        stderr = m["k3"].std().item() / math.sqrt(samples)
        assert abs(m["k3"].mean().item() - kl) < 5 * stderr + 1e-4, (m["k3"].mean().item(), kl)


def engine_topk(b: torch.Tensor, big_k: int, y: torch.Tensor):
    """What an engine returns: its top-K ids and log-probs and the sampled token's log-prob."""
    lb = torch.log_softmax(b.double(), -1)
    top = lb.topk(big_k, -1)
    return top.indices, top.values, lb.gather(1, y[:, None])[:, 0]


def test_topk_tail_with_the_whole_vocabulary_equals_the_full_metrics():
    gen = torch.Generator().manual_seed(7)
    a, b = random_pair(12, 300, gen, mask=False)
    y = torch.multinomial(torch.softmax(b, -1), 1, generator=gen)[:, 0]
    full = token_metrics(a, b, y, k=5)
    ids, logp, y_logp = engine_topk(b, 300, y)
    tail = topk_tail_metrics(a, ids, logp, y, y_logp, k=5)
    assert "logit_l1" not in tail
    for name in tail:
        assert torch.allclose(tail[name], full[name], rtol=1e-12, atol=1e-14), name


def test_topk_tail_bucket_metrics_are_lower_bounds_of_the_full_ones():
    gen = torch.Generator().manual_seed(8)
    for big_k, noise in ((1, 0.3), (5, 0.3), (20, 1.0), (100, 0.05)):
        a, b = random_pair(20, 1000, gen, noise=noise)
        y = torch.multinomial(torch.softmax(b, -1), 1, generator=gen)[:, 0]
        full = token_metrics(a, b, y, k=1)
        ids, logp, y_logp = engine_topk(b, big_k, y)
        ids = torch.where(torch.isneginf(logp), -1, ids)  # an engine never lists a masked token
        tail = topk_tail_metrics(a, ids, logp, y, y_logp, k=1)
        for name in ("js", "kl_train_infer", "kl_infer_train", "prob_l1", "entropy_infer"):
            assert torch.all(tail[name] <= full[name] + 1e-12), (big_k, name)
            assert torch.all(tail[name] > 0), (big_k, name)
        assert torch.any(tail["js"] < full["js"] - 1e-6)  # coarse-graining loses something
        for name in ("sampled_dp_abs", "sampled_dlogp_abs", "k3", "entropy_train", "top1_agree", "topk_overlap"):
            assert torch.allclose(tail[name], full[name], rtol=1e-12, atol=1e-14), (big_k, name)
    assert "lower bounds" in COARSE_GRAIN_NOTE


def test_topk_tail_against_hand_built_buckets():
    a = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.5, 1.2, 0.5, 0.3, -2.0]], dtype=torch.float64)
    lb = torch.log_softmax(b, -1)[0]
    la = torch.log_softmax(a, -1)[0]
    # engine top-2 = ids 0, 1 with one padding slot; the sampled id 3 lies outside it
    ids = torch.tensor([[1, 0, -1]])
    logp = torch.tensor([[lb[1], lb[0], 0.0]])
    got = topk_tail_metrics(a, ids, logp, torch.tensor([3]), lb[3:4], k=2)
    keep = [0, 1, 3]
    pa = [math.exp(la[i]) for i in keep] + [math.exp(la[2]) + math.exp(la[4])]
    pb = [math.exp(lb[i]) for i in keep]
    pb.append(1.0 - sum(pb))
    m = [(p + q) / 2 for p, q in zip(pa, pb)]
    js = 0.5 * sum(p * math.log(p / x) for p, x in zip(pa, m)) + 0.5 * sum(q * math.log(q / x) for q, x in zip(pb, m))
    assert got["js"].item() == pytest.approx(js, rel=1e-12)
    assert got["kl_train_infer"].item() == pytest.approx(sum(p * math.log(p / q) for p, q in zip(pa, pb)), rel=1e-12)
    assert got["prob_l1"].item() == pytest.approx(sum(abs(p - q) for p, q in zip(pa, pb)), rel=1e-12)
    want_l1 = sum(abs(math.log(p) - math.log(q)) for p, q in zip(pa, pb)) / 4
    assert got["logsoftmax_l1"].item() == pytest.approx(want_l1, rel=1e-12)
    assert got["entropy_infer"].item() == pytest.approx(-sum(q * math.log(q) for q in pb), rel=1e-12)
    assert got["top1_agree"].item() == 1.0 and got["topk_overlap"].item() == 1.0
    assert got["k3"].item() == pytest.approx(math.exp(la[3] - lb[3]) - 1 - (la[3] - lb[3]).item(), rel=1e-12)


def test_topk_tail_duplicates_padding_and_rounding():
    gen = torch.Generator().manual_seed(9)
    a, b = random_pair(4, 50, gen, mask=False)
    y = b.argmax(-1)  # the sampled token is also in the engine's top-K
    ids, logp, y_logp = engine_topk(b, 5, y)
    plain = topk_tail_metrics(a, ids, logp, y, y_logp, k=3)
    padded = topk_tail_metrics(a, torch.cat([ids, torch.full((4, 2), -1)], 1),
                               torch.cat([logp, torch.zeros(4, 2, dtype=torch.float64)], 1), y, y_logp, k=3)
    for name in plain:
        assert torch.allclose(plain[name], padded[name], rtol=1e-14, atol=1e-17), name
    # an engine whose rounded top-K mass reaches 1: finite divergences, not inf from a zero tail
    sharp = torch.tensor([[30.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    got = topk_tail_metrics(sharp, torch.tensor([[0]]), torch.tensor([[1e-9]]), torch.tensor([0]),
                            torch.tensor([0.0]), k=1)
    assert all(math.isfinite(got[name].item()) for name in got)
    assert got["js"].item() < 1e-10


@pytest.mark.parametrize("bad,match", [
    (lambda a, b: (a.clone().fill_(math.nan), b), "NaN"),
    (lambda a, b: (a, b[:, :5]), "one shape"),
    (lambda a, b: (torch.full_like(a, -math.inf), b), "masks every"),
])
def test_bad_logits_are_user_errors(bad, match):
    a, b = torch.randn(2, 6), torch.randn(2, 6)
    with pytest.raises(UserError, match=match):
        token_metrics(*bad(a, b))


def test_bad_engine_inputs_are_user_errors():
    a = torch.randn(2, 6)
    ids, logp = torch.tensor([[0, 1], [2, 3]]), torch.full((2, 2), -1.0)
    y, y_logp = torch.tensor([0, 2]), torch.tensor([-1.0, -1.0])
    with pytest.raises(UserError, match="k <= K"):
        topk_tail_metrics(a, ids, logp, y, y_logp, k=3)
    with pytest.raises(UserError, match="outside"):
        topk_tail_metrics(a, torch.tensor([[0, 9], [2, 3]]), logp, y, y_logp, k=2)
    with pytest.raises(UserError, match="outside"):
        token_metrics(a, a, torch.tensor([0, 6]))


def test_ties_are_broken_the_same_way_every_time():
    # bf16 logits tie often: the train argmax counts as agreeing when it is one of the infer maxima,
    # and top-k ties at the boundary go to the lower token id on both sides
    a = torch.tensor([[2.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.bfloat16)
    b = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]], dtype=torch.bfloat16)
    m = token_metrics(a, b, k=2)
    assert m["top1_agree"].tolist() == [1.0, 0.0]
    assert m["topk_overlap"].tolist() == [1.0, 0.5]  # row 0: {0, 1} both; row 1: {0, 1} vs {1, 2}


def test_a_bad_row_is_named_by_its_position_in_the_whole_input():
    a, b = torch.randn(9, 6), torch.randn(9, 6)
    b[7, 2] = math.nan
    with pytest.raises(UserError, match="infer logits row 7 holds NaN"):
        token_metrics(a, b, chunk_bytes=1)  # one row per chunk
    b[7, 2] = 0.0
    a[5] = -math.inf
    with pytest.raises(UserError, match="train logits row 5 masks every"):
        TokenTable(chunk_bytes=1).add(a, b)


def test_table_of_engine_top_k_values_carries_the_coarse_grain_note():
    gen = torch.Generator().manual_seed(10)
    a, b = random_pair(30, 200, gen, mask=False)
    y = torch.multinomial(torch.softmax(b, -1), 1, generator=gen)[:, 0]
    ids, logp, y_logp = engine_topk(b, 8, y)
    table = TokenTable(k=3, chunk_bytes=1)
    table.add_topk(a[:11], ids[:11], logp[:11], y[:11], y_logp[:11])
    table.add_topk(a[11:], ids[11:], logp[11:], y[11:], y_logp[11:])
    once = topk_tail_metrics(a, ids, logp, y, y_logp, k=3)
    assert table.names == tuple(m for m in TOKEN_METRICS if m != "logit_l1")
    for name in table.names:
        assert torch.allclose(table.values(name), once[name], rtol=1e-13, atol=1e-16), name
    doc = table.to_dict()
    assert doc["note"] == COARSE_GRAIN_NOTE and doc["tokens"] == 30
    with pytest.raises(ValueError, match="holds"):
        table.add(a[:2], b[:2], y[:2])  # full-logit values bring logit_l1: not the same metrics
    with pytest.raises(ValueError, match="one length"):
        TokenTable().add_values({"js": torch.zeros(3), "k3": torch.zeros(2)})
