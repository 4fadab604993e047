"""Environment suites (``orbitctl eval PROFILE --suite env:NAME``): held-out episodes played on the infer path.

The suite is the environment's held-out seeds, the pool ``orbitctl train`` never trains on for the same profile
(:func:`orbitctl.rl.envs.held_out_seeds`: ``data.eval_fraction`` of the pool, chosen by ``run.seed``), in the
seeded order, so ``--limit N`` plays a random N of them. Each seed is played ``samples`` times the way training
plays it (:func:`orbitctl.rl.multiturn.play`, under the chat template when ``data.chat_template`` is set), greedily
with one sample; sample ``j`` of seed ``i`` draws from the key ``i * samples + j``. A seed passes when its episode
is completed (return 1). Reported beside the completion rate: the mean turns of the completed episodes and, in an
environment with tools, the share of actions that were well-formed tool calls.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from orbitctl.errors import UserError


@dataclass(frozen=True)
class EpisodeSuite:
    """An environment's held-out seeds, and how many turns an episode may take."""

    name: str
    env: type
    seeds: list[int]
    """All held-out seeds, in the seeded order."""
    max_turns: int

    def task_ids(self) -> list[str]:
        return [f"{self.name}#{s}" for s in self.seeds]


@dataclass(frozen=True)
class Played:
    """What the episodes of one suite did."""

    per_task: list[tuple[str, int, int]]
    """``(task_id, episodes, completed)`` per seed."""
    turns_to_success: list[int]
    """Turns each completed episode took."""
    tool_calls: tuple[int, int] | None
    """``(valid, attempted)``; None when the environment has no tools."""
    transcripts: list[dict]

    def summary(self) -> dict:
        done = self.turns_to_success
        valid, calls = self.tool_calls or (0, 0)
        return {"episodes": sum(n for _, n, _ in self.per_task), "completed": len(done),
                "mean_turns_to_success": sum(done) / len(done) if done else None,
                "tool_call_valid_rate": valid / calls if self.tool_calls and calls else None,
                "tool_calls": calls if self.tool_calls else None}


def load_episode_suite(name: str, profile) -> EpisodeSuite:
    """The held-out seeds of ``env:NAME`` under ``profile`` (its data.eval_fraction, chat template and seed)."""
    from orbitctl.rl.envs import environment, held_out_seeds

    env = environment(name)
    if env.tools and not profile.data.chat_template:
        raise UserError(f"--suite {name} is played by tool calls, which are chat turns, and the profile's "
                        f"data.chat_template is false", fix="--set data.chat_template=true")
    _, held = held_out_seeds(env, profile.data, profile.run.seed)
    if not held:
        raise UserError(f"--suite {name}: data.eval_fraction is 0, so no seed is held out",
                        fix="--set data.eval_fraction=0.1")
    turns = profile.rollout.max_turns if profile.rollout.max_turns > 1 else env.turn_limit
    return EpisodeSuite(f"env:{env.name}", env, held, turns)


def play_suite(policy, suite: EpisodeSuite, count: int, sampling, *, base_only: bool, on_progress=None) -> Played:
    """``sampling.samples`` episodes of each of the first ``count`` seeds, a batch of whole seeds at a time."""
    from orbitctl.model.adapters import adapters_disabled
    from orbitctl.rl.envs import episode_items
    from orbitctl.rl.multiturn import play, start_episodes, won

    n = sampling.samples
    items = episode_items(suite.env, suite.seeds[:count])
    per_seed = max(1, sampling.batch_size // n)
    per_task, turns, valid, calls, transcripts = [], [], 0, 0, []
    context = adapters_disabled(policy.model) if base_only else contextlib.nullcontext()
    with context:
        for start in range(0, len(items), per_seed):
            chunk = items[start:start + per_seed]
            episodes = start_episodes(policy, suite.env, chunk, n, positions=list(range(start, start + len(chunk))))
            play(policy, episodes, batch_size=sampling.batch_size, max_turns=suite.max_turns,
                 max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                 generator=None, seed=sampling.seed)
            for i, item in enumerate(chunk):
                mine = episodes[i * n:(i + 1) * n]
                per_task.append((item.source, n, sum(won(ep) for ep in mine)))
            turns += [ep.turns for ep in episodes if won(ep)]
            valid += sum(ep.valid_calls for ep in episodes)
            calls += sum(ep.calls for ep in episodes)
            transcripts += [{"task_id": ep.item.source, "completed": won(ep), "turns": ep.turns,
                             "transcript": ep.transcript} for ep in episodes]
            if on_progress:
                on_progress("playing", start + len(chunk), len(items))
    return Played(per_task, turns, (valid, calls) if suite.env.tools else None, transcripts)
