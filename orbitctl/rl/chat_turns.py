"""Chat-format episodes: every turn rendered once with the model's own chat template, and never again.

An episode under ``data.chat_template`` is a conversation: the system turn (what the game is and, for a tool
environment, its tools), the first observation as a user turn, then each action as an assistant turn and each
answer as a ``tool`` turn (after a tool call) or a user turn (a plain-text game). The token sequence is built by
appending, turn by turn:

* the prompt: the system and first user turn rendered with the generation prompt (``<|im_start|>assistant\\n``);
* each action: the tokens the sampler drew, as drawn (never decoded and encoded again);
* each answer: what the template writes after an assistant turn's content up to the next generation prompt
  (the turn's closing, the answer's turn, the generation prompt), with the closing token left out when the
  action already ended with it (the EOS that stopped the sampler).

The template never renders the episode so far again. Rendering a whole conversation at every turn is what makes
the train path see other tokens than the sampler saw: a template may write a past assistant turn differently
from the one being generated (Qwen3 strips the reasoning of earlier turns), and text decoded and encoded again
may not give back the same tokens. Here the answer's text comes from a render of a fixed conversation around a
marker (:meth:`ChatTurns.answer`), so what the policy wrote is never in it.

The tools go into the template's own tool specification (``apply_chat_template(tools=...)``) when the template
reads ``tools``; otherwise they are described in the system turn with the call format (:mod:`.envs.tools`).
"""

from __future__ import annotations

from orbitctl.rl.envs.tools import format_call, tools_system_text

MARK = "ORBITCTL-ACTION-MARK"
"""Stands for an assistant turn's content in the render an answer's tokens are cut from."""
PLACEHOLDER_TURNS = ({"role": "user", "content": "start"},)
"""The conversation before the marked assistant turn: only what the template writes after the mark is kept."""


class ChatTurns:
    """The chat-format tokens of one environment's episodes for one tokenizer."""

    def __init__(self, tokenizer, env_cls, system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = env_cls.tools
        template = tokenizer.chat_template or ""
        self.template_tools = bool(self.tools) and "tools" in template
        """The template has a tool specification of its own (it reads the ``tools`` variable)."""
        parts = [system_prompt, env_cls.system or None]
        if self.tools and not self.template_tools:
            parts.append(tools_system_text(self.tools, format_call(*env_cls.example)))
        text = "\n".join(p for p in parts if p)
        self.system = [{"role": "system", "content": text}] if text else []
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""

    def render(self, turns: list[dict], *, generation_prompt: bool) -> str:
        kwargs = {"tools": [t.spec() for t in self.tools]} if self.template_tools else {}
        return self.tokenizer.apply_chat_template(list(turns), tokenize=False,
                                                  add_generation_prompt=generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        """Rendered text as ids; the template writes the special tokens (BOS) itself."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, observation: str, demonstration: list[dict] = ()) -> list[int]:
        """The episode's first tokens: the system turn, a solved example's turns where the environment gives one,
        the first observation as a user turn, the generation prompt."""
        return self.encode(self.render(self.system + list(demonstration) + [{"role": "user", "content": observation}],
                                       generation_prompt=True))

    def answer(self, observation: str, role: str, *, closed: bool) -> list[int]:
        """The tokens after an action: its turn's closing (without the EOS the action ``closed`` on), the
        observation as a ``role`` turn, and the generation prompt of the next action."""
        turns = [*self.system, *PLACEHOLDER_TURNS, {"role": "assistant", "content": MARK}]
        try:
            text = self.render(turns + [{"role": role, "content": observation}], generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template without a tool role raises its own error type
            if role == "user":
                raise
            text = self.render(turns + [{"role": "user", "content": observation}], generation_prompt=True)
        text = text[text.rindex(MARK) + len(MARK):]
        end = text.find(self.eos_text) if closed and self.eos_text else -1
        if end >= 0 and not text[:end].strip():  # the closing the sampler already wrote (and what precedes it)
            text = text[end + len(self.eos_text):]
        return self.encode(text)
