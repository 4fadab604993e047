"""env:household: the quest generator (same seed, same game; disjoint pools) and the game's rules."""

import pytest

from orbitctl.rl.envs.household_world import KINDS, LEVELS, make_quest


def _play(env, seed: int, calls) -> list[tuple[str, float, bool]]:
    env.reset(seed)
    return [env.call(name, arguments) for name, arguments in calls]


def test_the_same_seed_gives_the_same_game_and_other_seeds_other_games():
    from orbitctl.rl.envs import environment

    for kind in KINDS + ("all",):
        for level in LEVELS:
            games = [make_quest(seed, kind=kind, level=level) for seed in range(40)]
            assert games == [make_quest(seed, kind=kind, level=level) for seed in range(40)]
            assert len({(g.goal, g.start, repr(sorted(g.contents.items()))) for g in games}) > 20
    env = environment("env:household-heat-2")
    first = env().reset(5)
    assert first == env().reset(5) and first.startswith("Your task is to: put a hot ")
    assert {make_quest(s, kind="all", level=1).kind for s in range(60)} == set(KINDS)  # the mix holds every kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("level", LEVELS)
def test_every_walkthrough_wins_on_its_last_call_only(kind, level):
    from orbitctl.rl.envs import environment

    env = environment(f"env:household-{kind}-{level}")()
    assert env.kind == kind and env.level == level and env.name == f"household-{kind}-{level}"
    for seed in range(25):
        quest = make_quest(seed, kind=kind, level=level)
        assert len(quest.walkthrough) <= env.turn_limit
        outcomes = _play(env, seed, quest.walkthrough)
        assert [o[1:] for o in outcomes] == [(0.0, False)] * (len(outcomes) - 1) + [(1.0, True)], (seed, outcomes)
        assert outcomes[-1][0].endswith("Task complete.")
        if level >= 2:
            assert quest.walkthrough[0][0] == "go"  # the object is never in the start room
        if level == 3:
            assert "open" in [name for name, _ in quest.walkthrough]  # it is shut inside something


def test_pools_are_disjoint_and_the_same_for_the_same_run_seed(small_profile):
    from orbitctl.rl.envs import environment, episode_split, held_out_seeds

    data = small_profile(**{"data.train": "env:household-pick-1", "data.chat_template": True}).data
    env = environment(data.train)
    train, held = held_out_seeds(env, data, 0)
    assert not set(train) & set(held) and len(train) + len(held) == env.seed_pool
    assert len(held) == int(env.seed_pool * data.eval_fraction)
    assert held_out_seeds(env, data, 0) == (train, held) and held_out_seeds(env, data, 1)[1] != held
    split = episode_split(env, data, 0)
    assert {it.seed for it in split.eval} <= set(held) and not {it.seed for it in split.train} & set(held)
    assert split.eval[0].source.startswith("env:household-pick-1#")


def test_wrong_moves_are_answered_and_change_nothing():
    from orbitctl.rl.envs import environment

    env = environment("env:household-clean-1")()
    quest = make_quest(0, kind="clean", level=1)
    env.reset(0)
    assert env.call("go", {"room": "garden"})[0].startswith("There is no garden")
    assert env.call("put", {"object": quest.object, "receptacle": quest.target})[0].startswith("You hold nothing")
    assert env.call("clean", {"object": quest.object})[0].startswith("You hold nothing")
    assert env.call("take", {"object": "spaceship"})[0].startswith("You see no spaceship here.\nPossible calls: ")
    # put away without cleaning: placed, but the task wants it clean
    take, put = quest.walkthrough[0], quest.walkthrough[-1]
    env.call(*take)
    if quest.target in ("cabinet", "drawer"):
        env.call("open", {"receptacle": quest.target})
    assert env.call(*put)[1:] == (0.0, False)
    assert _play(env, 0, quest.walkthrough)[-1][1:] == (1.0, True)
    with pytest.raises(RuntimeError):  # the episode is over
        env.call("look", {})


def test_bad_names_are_refused_with_the_options():
    from orbitctl.errors import UserError
    from orbitctl.rl.envs import environment

    with pytest.raises(UserError, match="household-KIND-LEVEL"):
        environment("env:household-bake-1")
    with pytest.raises(UserError, match="household-KIND-LEVEL"):
        environment("env:household-pick-7")
    with pytest.raises(UserError, match="takes no options"):
        environment("env:guess-2")
    assert environment("env:household-2").kind == "all" and environment("env:household-2").level == 2
    tools = {t.name for t in environment("env:household-light").tools}
    assert tools == {"go", "open", "take", "put", "look", "use"}


def test_a_tool_environment_needs_the_chat_template(small_profile):
    from orbitctl.errors import UserError
    from orbitctl.rl.envs import environment, episode_split

    data = small_profile(**{"data.train": "env:household"}).data
    with pytest.raises(UserError, match="data.chat_template"):
        episode_split(environment(data.train), data, 0)
