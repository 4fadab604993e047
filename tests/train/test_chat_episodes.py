"""Chat-format episodes with tool calls: the train path gets exactly the tokens the sampler read and drew.

The tiny model's character tokenizer is given a chat template that, like Qwen3's, writes a past assistant turn
differently from the one being generated (it drops everything up to ``</think>``), and that has a tool
specification of its own. A conversation rendered again at every turn would not be what the sampler saw.
"""

from typing import ClassVar

import pytest

torch = pytest.importorskip("torch")

TEMPLATE = (
    "{%- if tools %}#T:{% for t in tools %}{{ t.function.name }};{% endfor %}</s>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and not loop.last %}{{ '#A:' + m.content.split('</think>')[-1] + '</s>\\n' }}"
    "{%- else %}{{ '#' + m.role[0] + ':' + m.content + '</s>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}#A:{%- endif %}"
)


def _say_game():
    from orbitctl.rl.envs.base import Environment
    from orbitctl.rl.envs.tools import Tool

    class SayWord(Environment):
        """Won by calling say with the word "go"; every call is answered with a short reply."""

        name: ClassVar[str] = "say"
        turn_limit: ClassVar[int] = 3
        seed_pool: ClassVar[int] = 50
        tools: ClassVar[tuple] = (Tool("say", "Say a word.", {"word": "string"}),)
        system: ClassVar[str] = "Say go."
        example: ClassVar[tuple] = ("say", {"word": "go"})

        def reset(self, seed: int) -> str:
            return f"N{seed % 10}"

        def call(self, name: str, arguments: dict) -> tuple[str, float, bool]:
            won = arguments["word"] == "go"
            return ("yes" if won else "no"), float(won), won

    return SayWord


@pytest.fixture(scope="module")
def chat_policy(tiny_env_policy):
    """The tiny demo policy (fp32, random adapters) under the test's chat template."""
    _, policy = tiny_env_policy("chat", **{"data.train": "env:guess", "rollout.max_turns": 3})
    policy.tokenizer.chat_template = TEMPLATE
    policy.chat_template = True
    return policy


class _Recorder:
    """Wraps ``policy.sample``: every context the sampler was given and what it drew for each row."""

    def __init__(self, policy):
        self.policy, self.real, self.seen, self.continued = policy, policy.sample, [], 0

    def __call__(self, ids, mask, **kwargs):
        past = kwargs.get("past")  # a later turn continues the cache: it holds the context's start
        before = [past.held(row) if past is not None else [] for row in range(ids.shape[0])]
        out = self.real(ids, mask, **kwargs)
        for row in range(ids.shape[0]):
            kept = out.completion_mask[row].bool()
            self.seen.append((before[row] + ids[row][mask[row].bool()].tolist(), out.completion_ids[row][kept].tolist(),
                              out.logprobs[row][kept].tolist()))
        self.continued += past is not None
        return out


def test_the_train_path_sees_exactly_the_samplers_tokens_and_masks(chat_policy, monkeypatch):
    from orbitctl.data.tasks import PromptItem  # noqa: F401 - EpisodeItem's base
    from orbitctl.rl.envs import episode_items
    from orbitctl.rl.multiturn import collect_episodes
    from orbitctl.rl.update import _train_logdist

    policy, game = chat_policy, _say_game()
    recorder = _Recorder(policy)
    monkeypatch.setattr(policy, "sample", recorder)
    batch = collect_episodes(policy, game, episode_items(game, [1, 2]), group_size=4, batch_size=8, max_turns=3,
                             max_new_tokens=6, temperature=1.0, top_p=1.0, generator=torch.Generator(),
                             keys=(0, [0, 1]))
    assert batch.tool_calls == (0, batch.size * 3) or batch.tool_calls[1] > 0  # every action read as a call
    rows = []
    for row in range(batch.size):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        length = int(batch.completion_attention[row].sum())
        rows.append((prompt + batch.completion_ids[row][:length].tolist(), len(prompt), length))
    own_seen = [[0] * length for _, _, length in rows]
    for context, drawn, logps in recorder.seen:
        matches = [r for r, (full, _, _) in enumerate(rows) if full[:len(context)] == context]
        assert matches, "the sampler read a context that no episode's sequence starts with"
        # the action is what was drawn up to its EOS, token for token, with the sampler's own log-probs
        action = drawn[:drawn.index(policy.eos_id) + 1] if policy.eos_id in drawn else drawn
        for r in matches:
            full, start, _ = rows[r]
            at = len(context) - start
            # rows of one group share their first context: each drawn action belongs to one row
            if full[len(context):len(context) + len(action)] == action and not any(own_seen[r][at:at + 1]):
                own_seen[r][at:at + len(action)] = [1] * len(action)
                assert batch.infer_logprobs[r][at:at + len(action)].tolist() == pytest.approx(logps[:len(action)])
                break
        else:
            raise AssertionError("a drawn action is not in the sequence after the context it was drawn from")
    assert recorder.continued  # later turns read the kept cache, not the whole context again
    for row, (_, _, length) in enumerate(rows):
        assert batch.completion_mask[row][:length].tolist() == own_seen[row]  # loss on the policy's tokens only
    # the train path's forward over those tokens gives the sampler's log-probs on every action, later turns included
    mb = {"prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask, "completion_ids": batch.completion_ids,
          "attention": batch.completion_attention}
    with torch.no_grad():
        logdist = _train_logdist(policy, mb, 1.0, train=False)
    delta = (logdist.gather(-1, batch.completion_ids[..., None]).squeeze(-1) - batch.infer_logprobs).abs()
    own = batch.completion_mask.bool()
    later = ((batch.completion_attention - batch.completion_mask).cumsum(-1) > 0) & own
    assert later.any() and float(delta[own].max()) < 1e-3


def test_turns_are_appended_never_rendered_again():
    from orbitctl.model.charset import build_char_tokenizer
    from orbitctl.rl.chat_turns import ChatTurns
    from orbitctl.rl.envs.tools import format_call

    game = _say_game()
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    turns = ChatTurns(tok, game)
    assert turns.template_tools and turns.system == [{"role": "system", "content": "Say go."}]
    prompt = turns.prompt("N1")
    assert tok.decode(prompt) == "#T:say;</s>#s:Say go.</s>\n#u:N1</s>\n#A:"
    action_text = "<think>hm</think>" + format_call("say", {"word": "no"})
    action = tok(action_text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    answer = turns.answer("no", "tool", closed=True)
    assert tok.decode(answer) == "\n#t:no</s>\n#A:"  # the closing EOS is the action's own, not written twice
    assert tok.decode(turns.answer("no", "tool", closed=False)) == "</s>\n#t:no</s>\n#A:"  # a cut action is closed
    sequence = prompt + action + answer
    # what a re-render of the same conversation gives: the past turn's reasoning gone, so other tokens
    again = tok.apply_chat_template([{"role": "system", "content": "Say go."}, {"role": "user", "content": "N1"},
                                     {"role": "assistant", "content": action_text}, {"role": "tool", "content": "no"}],
                                    tools=[t.spec() for t in game.tools], add_generation_prompt=True, tokenize=False)
    assert tok.decode(sequence) != again and "<think>" not in again and "<think>hm</think>" in tok.decode(sequence)


def test_without_a_tool_specification_the_tools_go_in_the_system_turn():
    from orbitctl.model.charset import build_char_tokenizer
    from orbitctl.rl.chat_turns import ChatTurns

    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role + ':' + m.content + '</s>' }}{% endfor %}" \
                        "{% if add_generation_prompt %}A:{% endif %}"
    turns = ChatTurns(tok, _say_game(), system_prompt="Be brief.")
    assert not turns.template_tools
    system = turns.system[0]["content"]
    assert system.startswith("Be brief.\nSay go.\n") and "- say(word): Say a word." in system
    assert '{"name": "say", "arguments": {"word": "go"}}' in system


def test_a_malformed_call_is_answered_and_counted_a_valid_one_is_played():
    from orbitctl.rl.multiturn import Episode, _respond

    game = _say_game()
    ep = Episode(item=None, env=game(), key=None, prompt=[])
    ep.env.reset(0)
    assert _respond(ep, "say go") == (("Error: bad JSON: no tool call found. Answer with one <tool_call> call.",
                                       0.0, False), "tool")
    assert _respond(ep, '<tool_call>{"name": "say", "arguments": {"word": "go"}}</tool_call>') == \
        (("yes", 1.0, True), "tool")
    assert (ep.valid_calls, ep.calls) == (1, 2)
