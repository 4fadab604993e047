"""Multi-turn rollouts: the environments' rules, masks on environment tokens, their zero gradient, a run."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ENV_RUN = {"data.train": "env:guess", "rollout.max_turns": 4, "data.eval_size": 8}


def _bisect(env, seed: int) -> list[tuple[str, str, float, bool]]:
    """Plays ``env:guess`` by bisection; returns (action, observation, reward, done) per turn."""
    env.reset(seed)
    low, high, turns = 0, 9, []
    while True:
        guess = (low + high) // 2
        obs, reward, done = env.step(str(guess))
        turns.append((str(guess), obs, reward, done))
        if done:
            return turns
        low, high = (guess + 1, high) if obs == "H:" else (low, guess - 1)


def test_guess_rules_follow_the_seed():
    from orbitctl.rl.envs import environment
    from orbitctl.rl.envs.guess import GuessDigit

    env = environment("env:guess")()
    assert isinstance(env, GuessDigit) and env.reset(5) == "G:"
    games = {seed: _bisect(env, seed) for seed in range(60)}
    assert games == {seed: _bisect(GuessDigit(), seed) for seed in range(60)}  # same seed, same episode
    targets = {int(turns[-1][0]) for turns in games.values()}
    assert targets == set(range(10))  # the seeds hide every digit
    for turns in games.values():
        assert len(turns) <= GuessDigit.turn_limit  # the turn-limit hint is enough for bisection
        assert [t[2:] for t in turns] == [(0.0, False)] * (len(turns) - 1) + [(1.0, True)]
        assert all(obs in ("H:", "L:") for _, obs, _, _ in turns[:-1])
    env.reset(0)
    assert env.step("x") == ("?:", 0.0, False) and env.step("12") == ("?:", 0.0, False)
    target = int(games[0][-1][0])
    assert env.step(str(target)) == ("=", 1.0, True)
    with pytest.raises(RuntimeError):
        env.step(str(target))


def test_episode_split_holds_out_seeds_and_refuses_what_it_cannot_use(small_profile):
    from orbitctl.errors import UserError
    from orbitctl.rl.envs import GuessDigit, episode_split

    data = small_profile(**ENV_RUN).data
    split = episode_split(GuessDigit, data, 0)
    train, held = {it.seed for it in split.train}, {it.seed for it in split.eval}
    assert len(held) == data.eval_size and not train & held
    assert len(train) == GuessDigit.seed_pool - int(GuessDigit.seed_pool * data.eval_fraction)
    assert [it.seed for it in episode_split(GuessDigit, data, 0).eval] == [it.seed for it in split.eval]
    assert {it.seed for it in episode_split(GuessDigit, data, 1).eval} != held
    with pytest.raises(UserError, match="data.eval"):
        episode_split(GuessDigit, data.model_copy(update={"eval": "x.jsonl"}), 0)
    with pytest.raises(UserError, match="data.reward"):
        episode_split(GuessDigit, data.model_copy(update={"reward": "math"}), 0)
    # a plain-text game plays in chat form too; a tool game needs it (tests/train/test_household.py)
    chat = episode_split(GuessDigit, data.model_copy(update={"chat_template": True}), 0)
    assert [it.seed for it in chat.eval] == [it.seed for it in split.eval]


def test_textworld_quest_is_generated_from_the_seed_and_won_by_its_walkthrough(tmp_path, monkeypatch):
    pytest.importorskip("textworld")
    from orbitctl.rl.envs import environment
    from orbitctl.rl.envs.textworld_quest import quest_layout

    monkeypatch.setenv("ORBITCTL_CACHE", str(tmp_path))
    env = environment("env:textworld")()
    layout = quest_layout(3)
    first = env.reset(3)
    assert layout["key"] in first and layout["start"] in first.lower()
    obs, reward, done = env.step(f"go {layout['back']}")  # the other room lies the other way
    assert (reward, done) == (0.0, False) and "can't" in obs
    rewards = []
    for command in layout["walkthrough"]:
        obs, reward, done = env.step(command)
        rewards.append((reward, done))
    assert rewards == [(0.0, False)] * 4 + [(1.0, True)]
    assert env.reset(3) == first  # the compiled game is cached and replays alike
    env.close()


@pytest.fixture(scope="module")
def tiny(tiny_env_policy):
    """(profile, policy, split) of the tiny demo model, with random adapters so every context token matters."""
    from orbitctl.rl.envs import environment, episode_split

    profile, policy = tiny_env_policy("multiturn", **ENV_RUN)
    return profile, policy, episode_split(environment(profile.data.train), profile.data, profile.run.seed)


def _collect(policy, split, batch_size: int):
    from orbitctl.rl.envs import GuessDigit
    from orbitctl.rl.multiturn import collect_episodes

    return collect_episodes(policy, GuessDigit, split.train[:4], group_size=4, batch_size=batch_size, max_turns=4,
                            max_new_tokens=2, temperature=1.0, top_p=1.0, generator=torch.Generator(),
                            keys=(0, [10, 11, 12, 13]))


def test_multiturn_rollout_masks_exactly_the_environment_tokens(tiny):
    from orbitctl.rl.envs import GuessDigit
    from orbitctl.rl.update import _train_logdist

    profile, policy, split = tiny
    batch = _collect(policy, split, batch_size=16)
    tok = policy.tokenizer
    assert batch.size == 16 and batch.completion_attention is not None
    for row in range(batch.size):
        ids = batch.completion_ids[row].tolist()
        own, attend = batch.completion_mask[row].tolist(), batch.completion_attention[row].tolist()
        length = sum(attend)
        assert attend == [1] * length + [0] * (len(ids) - length) and all(t == policy.pad_id for t in ids[length:])
        # replay the episode from the policy's own segments: every other segment must be the environment's reply
        env, ret, i = GuessDigit(), 0.0, 0
        env.reset(batch.items[row].seed)
        while i < length:
            assert own[i] == 1
            j = i
            while j < length and own[j] == 1:
                j += 1
            obs, reward, done = env.step(tok.decode(ids[i:j], skip_special_tokens=True).replace("\n", ""))
            ret += reward
            reply = tok(obs, add_special_tokens=False)["input_ids"]
            if j < length:
                assert not done and ids[j:j + len(reply)] == reply and own[j:j + len(reply)] == [0] * len(reply)
            i = j + len(reply)
        assert batch.rewards[row] == ret
        logp = batch.infer_logprobs[row]
        assert bool((logp[torch.tensor(own) == 0] == 0).all()) and bool((logp <= 0).all())
    assert (batch.completion_mask == 0).logical_and(batch.completion_attention == 1).any()  # some env tokens
    assert bool((batch.infer_logprobs[batch.completion_mask.bool()] < 0).any())
    # keyed draws: another chunking samples the same episodes
    again = _collect(policy, split, batch_size=5)
    assert torch.equal(again.completion_ids, batch.completion_ids) and torch.equal(again.rewards, batch.rewards)
    # the train path reads the environment's tokens as context: with them it agrees with the sampler on every
    # action, later turns included; without them it does not
    mb = {"prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask, "completion_ids": batch.completion_ids}
    later = ((batch.completion_attention - batch.completion_mask).cumsum(-1) > 0) & batch.completion_mask.bool()

    def delta(attention):
        with torch.no_grad():
            logdist = _train_logdist(policy, {**mb, "attention": attention}, 1.0, train=False)
        return (logdist.gather(-1, batch.completion_ids[..., None]).squeeze(-1) - batch.infer_logprobs).abs()

    right, hidden = delta(batch.completion_attention), delta(batch.completion_mask)
    assert later.any() and float(right[batch.completion_mask.bool()].max()) < 1e-3  # test_policy's bound
    assert float(hidden[later].max()) > 10 * float(right[later].max())  # hiding the replies changes the context


def test_later_turns_continue_the_kept_cache_as_reading_the_whole_context_would(tiny, monkeypatch):
    """Each turn after the first feeds only what its episode's cache lacks; the episodes, their tokens and their
    log-probs are those of reading the whole context again at every turn (fp32: to rounding)."""
    from orbitctl.rl import multiturn

    _, policy, split = tiny
    real, fed = policy.sample, []

    def counting(ids, mask, **kwargs):
        fed.append((int(mask.sum()), kwargs.get("past") is not None))
        return real(ids, mask, **kwargs)

    monkeypatch.setattr(policy, "sample", counting)
    kept = _collect(policy, split, batch_size=16)
    kept_fed, fed[:] = list(fed), []
    monkeypatch.setattr(multiturn, "_continued", lambda caches, chunk: None)  # every turn reads whole contexts
    whole = _collect(policy, split, batch_size=16)
    assert [c for _, c in kept_fed] == [False] + [True] * (len(kept_fed) - 1) and not any(c for _, c in fed)
    assert len(fed) == len(kept_fed) > 1
    # a later turn feeds its new tokens only: the reply and the action's last token, not the context before them
    assert all(k < w for (k, _), (w, _) in zip(kept_fed[1:], fed[1:]))
    assert torch.equal(kept.completion_ids, whole.completion_ids) and torch.equal(kept.rewards, whole.rewards)
    own = kept.completion_mask.bool()
    assert torch.equal(kept.completion_mask, whole.completion_mask)
    assert float((kept.infer_logprobs - whole.infer_logprobs)[own].abs().max()) < 1e-5


def test_skipping_zero_advantage_rows_gives_the_same_gradient(tiny):
    """Rows whose loss is zero whatever the weights are not run through the update. Two groups of four episodes, one with advantages and one without: the adapters' gradient from the live rows
    alone is the gradient of all eight (fp32, to rounding), and a step where no row is live runs one row, with a
    gradient of zero."""
    from orbitctl.profile.schema import AlignLoss
    from orbitctl.rl.envs import GuessDigit
    from orbitctl.rl.multiturn import collect_episodes
    from orbitctl.rl.update import StepStats, _rows, live_rows, micro_loss, micro_rows

    profile, policy, split = tiny
    profile = profile.model_copy(update={"rl": profile.rl.model_copy(update={"align_loss": AlignLoss(kind="none")})})
    batch = collect_episodes(policy, GuessDigit, split.train[:2], group_size=4, batch_size=8, max_turns=3,
                             max_new_tokens=2, temperature=1.0, top_p=1.0, generator=torch.Generator(),
                             keys=(0, [0, 1]))
    tokens = float(batch.completion_mask.sum())

    def gradient(advantages, skip: bool) -> dict:
        policy.set_mode(train=False)  # no dropout: both runs see the same function
        policy.model.zero_grad(set_to_none=True)
        live = live_rows(profile.rl, advantages) if skip else None
        for rows in micro_rows(torch.arange(batch.size), 4, live):
            micro_loss(policy, _rows(batch, rows, advantages, None), profile, tokens, StepStats()).backward()
        return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in policy.named_trainable()}

    advantages = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.2, -0.4, 0.8, -1.6])
    every, live = gradient(advantages, skip=False), gradient(advantages, skip=True)
    assert max(float(g.abs().max()) for g in every.values()) > 0
    for name, grad in every.items():
        torch.testing.assert_close(live[name], grad, rtol=1e-5, atol=1e-7 * float(grad.abs().max() + 1e-30))
    dead = gradient(torch.zeros(8), skip=True)
    assert all(float(g.abs().max()) == 0.0 for g in dead.values())


class _FakePolicy:
    """Train-path logits as one leaf tensor, so the loss's gradient per position can be read off."""

    device = torch.device("cpu")
    model = torch.nn.Module()
    """No decoder layers: nothing for the activation offload to wrap."""

    def __init__(self, logits):
        self.logits, self.seen = logits, []

    def completion_logits(self, prompt_ids, prompt_mask, completion_ids, attention, train=True, routes=None):
        self.seen.append(attention.clone())
        return self.logits

    def reference_logits(self, prompt_ids, prompt_mask, completion_ids, attention, routes=None):
        return self.logits.detach() * 0.5


def test_environment_tokens_get_zero_gradient_and_no_weight_in_the_metrics(small_profile):
    from orbitctl.rl.update import StepStats, micro_loss

    profile = small_profile(**ENV_RUN, **{"rl.kl_ref_coef": 0.05, "rl.is_correction.kind": "icepop"})
    gen = torch.Generator().manual_seed(0)
    B, T, V = 4, 9, 100
    own = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0, 1], [1, 0, 0, 0, 1, 1, 0, 0, 0],
                        [1, 1, 0, 0, 1, 1, 1, 0, 0], [1, 0, 0, 1, 0, 0, 0, 0, 0]])
    attention = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 7 + [0] * 2, [1] * 4 + [0] * 5])
    ids = torch.randint(0, V, (B, T), generator=gen)
    logits = torch.randn(B, T, V, generator=gen)
    infer = torch.log_softmax(logits + 0.1 * torch.randn(B, T, V, generator=gen), -1).gather(
        -1, ids[..., None]).squeeze(-1) * own

    def run(infer_logp, old_logp):
        leaf = logits.clone().requires_grad_(True)
        policy = _FakePolicy(leaf)
        mb = {"prompt_ids": torch.ones(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": ids, "completion_mask": own, "attention": attention, "infer_logp": infer_logp,
              "adv": torch.tensor([1.0, -0.5, 0.3, -1.2]), "dist": None, "old_logp": old_logp}
        stats = StepStats()
        loss = micro_loss(policy, mb, profile, float(own.sum()), stats)
        loss.backward()
        assert torch.equal(policy.seen[0], attention)  # the forward reads environment tokens as context
        return loss.detach(), leaf.grad, stats

    old = infer + 0.05 * own
    loss, grad, stats = run(infer, old)
    per_position = grad.abs().sum(-1)
    assert bool((per_position[own == 0] == 0).all())
    assert bool((per_position[own == 1] > 0).all())
    # whatever the sampler or pi_old recorded at environment positions changes nothing
    noise = torch.randn(B, T, generator=gen) * (1 - own)
    loss2, grad2, stats2 = run(infer + noise - 3.0 * (1 - own), old + noise)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    assert stats.means() == stats2.means() and stats.tokens == float(own.sum())
    assert {k for k in stats.means() if k.startswith("mismatch_")} == {
        "mismatch_logp_abs_mean", "mismatch_logp_abs_max", "mismatch_k3_kl", "mismatch_prob_abs_mean"}


@pytest.mark.slow
def test_multiturn_train_on_the_tiny_model_writes_metrics(small_profile):
    from orbitctl.rl.api import train
    from orbitctl.rundir import metric_series, read_metrics

    profile = small_profile("mt-run", **ENV_RUN, **{"rl.steps": 2, "rl.prompts_per_step": 4,
                                                    "memory.micro_batch_size": 16, "rollout.max_new_tokens": 2})
    result = train(profile)
    records = read_metrics(result.run_dir)
    assert [r["step"] for r in records] == [1, 2] and all(r["update_applied"] for r in records)
    # the two paths agree on the policy's tokens in context: below the profile's own warning level
    assert all(0 <= r["mismatch_k3_kl"] < profile.alignment.k3_kl_warn for r in records)
    assert all(r["mismatch_logp_abs_mean"] <= r["mismatch_logp_abs_max"] for r in records)
    # response_length counts the policy's tokens only: at most max_turns actions of max_new_tokens
    assert all(0 < length <= 4 * 2 for _, length in metric_series(records, "response_length"))
    assert 0.0 <= records[-1]["eval_accuracy"] <= 1.0 and records[-1]["eval_prompts"] == 8
    summary = json.loads((Path(result.run_dir) / "summary.json").read_text())
    assert summary["status"] == "finished" and (Path(result.run_dir) / "adapter").is_dir()


def test_max_turns_without_an_environment_and_unknown_environments_exit_2(tmp_path, profile_yaml, capsys):
    from orbitctl.cli.app import main

    assert main(["train", str(profile_yaml("no-env", **{"rollout.max_turns": 3}))]) == 2
    err = capsys.readouterr().err
    assert "rollout.max_turns" in err and "env:guess" in err and "Traceback" not in err
    assert main(["train", str(profile_yaml("bad-env", **{"data.train": "env:chess"}))]) == 2
    err = capsys.readouterr().err
    assert "env:chess" in err and "env:guess" in err and "env:textworld" in err
    assert not (tmp_path / "no-env").exists() and not (tmp_path / "bad-env").exists()


def test_textworld_without_its_package_is_refused_before_any_work(monkeypatch):
    import importlib.util

    from orbitctl.errors import UserError
    from orbitctl.rl.envs import environment

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "textworld" else real(name, *a))
    with pytest.raises(UserError, match="data.train: env:textworld needs the textworld package") as caught:
        environment("env:textworld")
    assert "pip install" in caught.value.fix
