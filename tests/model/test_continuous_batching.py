"""Continuous batching (Policy.sample_stream, rollout.continuous_batching): at most ``slots`` rows decode at once, a
finished row's slot goes to the next waiting row, prefilled then and appended to the running batch.

Each row must sample what it samples in a fixed chunk (Policy.sample): the same greedy tokens, the same keyed draws,
the same routing on an MoE, log-probs within a few roundings of the compute dtype (an admitted row's cache is
left-padded to the batch's length, the padding masked: attention over it adds exact zeros); where rows end early
the stream runs fewer forwards than the chunks, and where every row runs full length as many.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def _chunked(policy, ids, mask, slots, draws=None, **kw):
    """Policy.sample over chunks of ``slots`` rows, right-padded and stacked like one batch."""
    from orbitctl.model.draws import KeyedDraws
    from orbitctl.rl.rollout import _pad_right

    parts = []
    for start in range(0, ids.shape[0], slots):
        rows = slice(start, start + slots)
        part_draws = KeyedDraws(draws.seed, draws.keys[rows]) if draws is not None else None
        parts.append(policy.sample(ids[rows], mask[rows], draws=part_draws, **kw))
    return (_pad_right([p.completion_ids for p in parts], policy.pad_id), _pad_right([p.completion_mask for p in parts], 0),
            _pad_right([p.logprobs for p in parts], 0.0),
            _pad_right([p.routes for p in parts], -1) if parts[0].routes is not None else None)


def _forward_counter(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)
    return calls, handle


def _same_up_to_width(a, b, fill):
    """``a`` and ``b`` equal where both have columns, and the wider one only ``fill`` beyond."""
    width = min(a.shape[1], b.shape[1])
    wide = a if a.shape[1] > b.shape[1] else b
    return torch.equal(a[:, :width], b[:, :width]) and bool((wide[:, width:] == fill).all())


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "tiny-moe-cpu.yaml"])
@pytest.mark.parametrize("eos", ["model", "never"])
def test_stream_samples_what_the_chunks_sample(name, eos, profile_policy):
    """Greedy rows through 3 slots against chunks of 3: with the model's EOS (rows end after 1-2 tokens, at different
    steps, so slots are refilled mid-batch) and with no EOS (every row full length: the same forwards as the
    chunks)."""
    policy, split, _ = profile_policy(name)
    prompts = [it.prompt + " 7" * (i % 3) for i, it in enumerate(split.train[:7])]
    ids, mask = policy.encode_prompts(prompts)
    if eos == "never":
        policy.eos_id = -1
    kw = dict(max_new_tokens=8, temperature=0.0, top_p=1.0, generator=None)
    calls, handle = _forward_counter(policy.model)
    try:
        ids_c, mask_c, logp_c, routes_c = _chunked(policy, ids, mask, 3, **kw)
        chunk_forwards = len(calls)
        calls.clear()
        stream = policy.sample_stream(ids, mask, slots=3, **kw)
        stream_forwards = len(calls)
    finally:
        handle.remove()
    lengths = mask_c.sum(-1)
    if eos == "never":
        assert (lengths == 8).all() and stream_forwards == chunk_forwards
    else:
        assert lengths.min() < lengths.max() < 8  # rows end at different steps
    assert _same_up_to_width(stream.completion_mask, mask_c, 0)
    kept = stream.completion_mask.bool()
    width = stream.completion_ids.shape[1]
    assert torch.equal(stream.completion_ids[kept], ids_c[:, :width][kept])
    dtype = policy.model.get_input_embeddings().weight.dtype
    bound = 64 * torch.finfo(dtype).eps * (1 + logp_c.abs().max())
    assert (stream.logprobs[kept] - logp_c[:, :width][kept]).abs().max() <= bound
    if policy.routing is not None:  # each fed token's experts, and the prompts'
        fed = stream.routes >= 0
        assert fed.any() and torch.equal(stream.routes[fed], routes_c[:, :width][fed])
        assert int((stream.prompt_routes >= 0).all(-1).sum()) == int(mask.sum()) * policy.routing.layers


def test_keyed_draws_follow_the_row_not_the_batch(profile_policy):
    """Sampling at temperature 1 with keyed draws: a row's tokens are those it draws in its chunk, though the stream
    takes it at another batch step."""
    from orbitctl.model.draws import KeyedDraws

    policy, split, _ = profile_policy("tiny-cpu.yaml")
    ids, mask = policy.encode_prompts([it.prompt for it in split.train[:6]])
    draws = KeyedDraws(5, tuple(range(100, 106)))
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=0.9, generator=None)
    policy.eos_id = int(policy.sample(ids[:1], mask[:1], draws=KeyedDraws(5, (100,)), **kw).completion_ids[0, 1])
    ids_c, mask_c, _, _ = _chunked(policy, ids, mask, 4, draws=draws, **kw)
    stream = policy.sample_stream(ids, mask, slots=4, draws=draws, **kw)
    assert (mask_c.sum(-1) < 6).any()
    assert _same_up_to_width(stream.completion_mask, mask_c, 0)
    kept = stream.completion_mask.bool()
    assert torch.equal(stream.completion_ids[kept], ids_c[:, :stream.completion_ids.shape[1]][kept])


def test_forced_rows_of_different_lengths_and_the_fp8_cache(profile_policy):
    """Teacher-forced rows that end at different tokens, through the float8 cache (its scales padded alongside): each
    row's distributions as in its chunk; a row with nothing forced keeps nothing."""
    policy, split, _ = profile_policy("tiny-cpu.yaml")
    ids, mask = policy.encode_prompts([it.prompt for it in split.train[:5]])
    g = torch.Generator().manual_seed(3)
    completion = torch.randint(5, 40, (5, 6), generator=g)
    keep = torch.ones_like(completion)
    for row, length in enumerate((6, 2, 4, 0, 1)):
        keep[row, length:] = 0
    kw = dict(max_new_tokens=0, temperature=1.0, top_p=1.0, generator=None, keep_dist=True, kv_dtype="fp8")
    calls, handle = _forward_counter(policy.model)
    try:
        stream = policy.sample_stream(ids, mask, slots=2, forced=(completion, keep), **kw)
        stream_forwards = len(calls)
        calls.clear()
        chunks = [policy.sample(ids[s:s + 2], mask[s:s + 2], forced=(completion[s:s + 2], keep[s:s + 2]), **kw)
                  for s in range(0, 5, 2)]
        chunk_forwards = len(calls)
    finally:
        handle.remove()
    # chunks decode each to its longest row (6, 4, 1 tokens: 3 prefills + 8 decode forwards); the stream refills
    # row 1's slot after its 2 tokens, and so on
    assert chunk_forwards == 11 and stream_forwards < chunk_forwards
    assert stream.completion_mask.sum(-1).tolist() == [6, 2, 4, 0, 1]
    bound = 64 * torch.finfo(torch.float32).eps * 50
    for s, chunk in zip(range(0, 5, 2), chunks):
        for i in range(chunk.completion_ids.shape[0]):
            n = int(keep[s + i].sum())
            assert torch.equal(stream.completion_ids[s + i, :n], completion[s + i, :n])
            if n:
                assert (stream.dist[s + i, :n] - chunk.dist[i, :n]).abs().max() <= bound


def test_the_rollout_streams_its_rows_where_the_profile_asks(profile_policy):
    """rollout.continuous_batching (auto: on where the decode is eager) reaches the rollout: sample_groups calls
    sample_stream once with the step's rows and rollout.batch_size slots; false samples fixed chunks."""
    from orbitctl.rl.rollout import sample_groups

    for setting, streams in (("auto", True), ("false", False)):
        policy, split, profile = profile_policy("tiny-cpu.yaml",
                                         **{"rollout.continuous_batching": setting})
        assert policy.continuous_batching is streams
        seen = []
        for method in ("sample", "sample_stream"):
            original = getattr(policy, method)
            setattr(policy, method, lambda *a, _m=method, _o=original, **k: seen.append((_m, k.get("slots"))) or _o(*a, **k))
        expanded, parts = sample_groups(policy, split.train[:3], group_size=2, batch_size=4, max_new_tokens=3,
                                        temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(0),
                                        keep_dist=False, keys=(1, [0, 1, 2]))
        assert len(expanded) == 6 and sum(p.completion_ids.shape[0] for p in parts) == 6
        assert seen == ([("sample_stream", 4)] if streams else [("sample", None), ("sample", None)])


WORLD = 2


def _ep_worker(rank: int, path: str, store: str, out: str) -> None:
    """Rank ``rank`` of an EP-2 run streaming its own rows (rank 0: 5 rows ending at different tokens, rank 1: 1 row
    of 7): every prefill and decode forward matched on the other rank (fillers where a rank has nothing to run),
    against the whole model streaming the same rows alone."""
    import json

    import torch.distributed as dist

    from orbitctl.model.charset import build_char_tokenizer
    from orbitctl.model.expert_parallel import ExpertGroup, Lockstep
    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.model.policy import Policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        tokenizer = build_char_tokenizer()
        tokenizer.padding_side = "left"
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

        def policy(experts, lockstep):
            model = load_frozen_base(path, compute_dtype=torch.float32, experts=experts)
            return Policy(model, tokenizer, None, hidden_size=int(model.config.hidden_size), adapter_kind="lora",
                          gradient_checkpointing=False, lockstep=lockstep)

        split, whole = policy(ExpertGroup.of_world(WORLD), Lockstep()), policy(None, None)
        g = torch.Generator().manual_seed(21 + rank)
        rows, lengths = (5, (6, 2, 4, 1, 3)) if rank == 0 else (1, (7,))
        prompt = torch.randint(1, 90, (rows, 5), generator=g)
        completion = torch.randint(1, 90, (rows, 7), generator=g)
        keep = torch.ones_like(completion)
        for row, length in enumerate(lengths):
            keep[row, length:] = 0
        kw = dict(slots=2, max_new_tokens=0, temperature=1.0, top_p=1.0, generator=None, keep_logits=True,
                  forced=(completion, keep))
        ep = split.sample_stream(prompt, torch.ones_like(prompt), **kw)
        alone = whole.sample_stream(prompt, torch.ones_like(prompt), **kw)
        kept = keep[:, :ep.logits.shape[1]].bool()
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "kept": ep.completion_mask.sum(-1).tolist(), "routes": int((ep.routes >= 0).all(-1).any(-1).sum()),
            "err": float((ep.logits[kept] - alone.logits[kept]).abs().max()),
            "logit_absmax": float(alone.logits[kept].abs().max())}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_expert_parallel_ranks_stream_in_lockstep(tmp_path, int4_moe):
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_ep_worker, args=(str(int4_moe), str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert results[0]["kept"] == [6, 2, 4, 1, 3] and results[1]["kept"] == [7]
    # every fed token's routing recorded: a row's tokens but its last
    assert results[0]["routes"] == 5 + 1 + 3 + 0 + 2 and results[1]["routes"] == 6
    eps = torch.finfo(torch.float32).eps
    for r in results:  # expert parallelism changes the experts' sums by a few roundings only
        assert r["err"] <= 64 * eps * r["logit_absmax"], r


@pytest.mark.parametrize("sets, needle", [
    (["rollout.continuous_batching=true", "hardware.gpu=h200", "rollout.decode_graphs=true"],
     "rollout.decode_graphs true replays fixed rows"),
    (["rollout.continuous_batching=true", "rollout.engine=http"], "http engine"),
])
def test_continuous_batching_true_is_refused_where_it_cannot_apply(sets, needle):
    from orbitctl.profile import load_profile
    from orbitctl.profile.support import unsupported_for

    profile = load_profile(ROOT / "profiles" / "tiny-cpu.yaml", sets)
    found = [u.render() for u in unsupported_for("train", profile) if u.key == "rollout.continuous_batching"]
    assert len(found) == 1 and needle in found[0], found
    auto = load_profile(ROOT / "profiles" / "tiny-cpu.yaml", [s.replace("=true", "=auto", 1) for s in sets[:1]] + sets[1:])
    assert not [u for u in unsupported_for("train", auto) if u.key == "rollout.continuous_batching"]


def test_continuous_true_makes_auto_graphs_decode_eagerly_and_the_dry_run_says_which_runs():
    """On a GPU profile whose plan graphs the decode under auto, continuous batching true resolves decode_graphs auto
    to false (train's dry run shows eager decode and streamed rows); auto keeps the graphs and fixed batches."""
    from orbitctl.launch.dryrun import dry_run
    from orbitctl.plan import apply_changes, resolve_decode_graphs
    from orbitctl.profile import load_profile

    kimi = load_profile(ROOT / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml")
    assert resolve_decode_graphs(kimi).rollout.decode_graphs is True
    streamed = apply_changes(kimi, {"rollout.continuous_batching": True})
    assert resolve_decode_graphs(streamed).rollout.decode_graphs is False
    for profile, graphs in ((kimi, True), (streamed, False)):
        rollout = dry_run(profile).rollout
        assert rollout["decode_graphs"] is graphs and rollout["continuous_batching"] is (not graphs)


def test_waiting_rows_are_admitted_together_once_a_quarter_of_the_slots_is_free(profile_policy):
    """Each admission is a prefill forward: one row ending among 8 slots leaves its slot idle until a quarter of
    the slots (2) is free, or the batch runs dry, and then the waiting rows are prefilled together."""
    policy, split, _ = profile_policy("tiny-cpu.yaml")
    ids, mask = policy.encode_prompts([it.prompt for it in split.train[:10]])
    lengths = (1, 5, 5, 5, 5, 5, 5, 5, 3, 3)
    completion = torch.randint(5, 40, (10, 5), generator=torch.Generator().manual_seed(0))
    keep = (torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]).long()
    prefills = []
    handle = policy.model.register_forward_pre_hook(
        lambda module, args, kwargs: prefills.append(kwargs["input_ids"].shape[0]) if kwargs["input_ids"].shape[1] > 1
        else None, with_kwargs=True)
    try:
        stream = policy.sample_stream(ids, mask, slots=8, max_new_tokens=0, temperature=1.0, top_p=1.0,
                                      generator=None, forced=(completion, keep))
    finally:
        handle.remove()
    assert policy.admit_at(8) == 2 and policy.admit_at(3) == 1
    assert prefills == [8, 2]  # rows 8 and 9 wait for rows 1-7 to end, not row 0 alone
    assert stream.completion_mask.sum(-1).tolist() == list(lengths)
