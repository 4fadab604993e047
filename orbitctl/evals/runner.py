"""Generate completions on the infer path and grade samples.

Generation builds the policy the trainer builds (the same frozen quantized base, warm-started
on the same task, so the cache serves the trained base) and samples on its infer path
(:meth:`~orbitctl.model.policy.Policy.sample`: KV cache, eval mode). With an adapter directory
its weights are loaded into the fresh adapters; without one the adapters are switched off and
the base alone answers. Sample ``j`` of task ``i`` draws its tokens from key ``i * N + j``
(:mod:`orbitctl.model.draws`), so a completion does not depend on the batch it was decoded in.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orbitctl.data.tasks import PromptItem
from orbitctl.errors import InputFileError
from orbitctl.evals.samples import Sample
from orbitctl.evals.suites import Suite, Verdict, default_workers

ProgressFn = Callable[[str, int, int], None]

HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
"""Where a generated HumanEval completion is cut: the stop sequences of Chen et al. 2021 (the function
body ends where top-level code starts)."""


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn."""

    samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    batch_size: int
    """Sequences decoded at once."""
    seed: int
    stop: tuple[str, ...] = ()
    """A completion is cut before the first of these."""
    chat_code: bool = False
    """Completions are chat replies to code prompts (HumanEval under ``data.chat_template``): the code is taken
    from the reply (:func:`chat_completion`) instead of cutting the text at :attr:`stop`."""

    def to_dict(self) -> dict:
        return {"samples": self.samples, "temperature": self.temperature, "top_p": self.top_p,
                "max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size, "seed": self.seed,
                "stop": list(self.stop), "chat_code": self.chat_code}


def truncate(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to the first stop sequence it holds."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)


def chat_completion(reply: str, entry_point: str | None) -> str:
    """A chat reply to a HumanEval prompt as a completion of that prompt.

    An instruct model answers in its own words, usually with the whole function in a fenced block. The code is
    the first fenced block (the whole reply when there is none). When it defines ``entry_point`` at top level it
    follows the prompt as a new definition that replaces the prompt's (a docstring-only body), its imports with
    it; otherwise it is read as the body and cut at :data:`HUMANEVAL_STOP`."""
    block = _FENCE.search(reply)
    code = block.group(1) if block else reply
    if entry_point and re.search(rf"^def {re.escape(entry_point)}\s*\(", code, re.M):
        return "\n" + code
    return truncate(code, HUMANEVAL_STOP)


def build_policy(profile, adapter: str | None):
    """The profile's policy on its device, with the adapter in ``adapter`` loaded (None: fresh adapters)."""
    import torch

    from orbitctl.align.selfcheck import load_adapter_into
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import PromptSplit, load_prompts
    from orbitctl.rl.envs import env_name

    if adapter is not None and not Path(adapter).is_dir():
        raise InputFileError(f"--adapter {adapter}: no such directory",
                             fix="Pass the adapter/ directory of a run (runs/NAME/adapter)")
    if env_name(profile.data.train) is not None:  # an environment run's base, warm-started as train does
        warm_task = PromptSplit([], [], None).warm_task
    else:
        warm_task = load_prompts(profile.data, profile.run.seed).warm_task
    torch.manual_seed(profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, warm_task))
    if adapter is not None:
        load_adapter_into(policy, Path(adapter), profile.adapter.kind)
    return policy


def generate(policy, items: list[PromptItem], sampling: Sampling, *, base_only: bool,
             on_progress: ProgressFn | None = None) -> list[Sample]:
    """``sampling.samples`` completions of every item, task by task; ``base_only`` switches the adapters off."""
    from orbitctl.model.adapters import adapters_disabled
    from orbitctl.rl.rollout import sample_groups

    n = sampling.samples
    tasks_per_batch = max(1, sampling.batch_size // n)
    out: list[Sample] = []
    context = adapters_disabled(policy.model) if base_only else contextlib.nullcontext()
    with context:
        for start in range(0, len(items), tasks_per_batch):
            chunk = items[start:start + tasks_per_batch]
            _, parts = sample_groups(policy, chunk, group_size=n, batch_size=sampling.batch_size,
                                     max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                     top_p=sampling.top_p, generator=None, keep_dist=False,
                                     keys=(sampling.seed, list(range(start, start + len(chunk)))))
            texts = [t for p in parts for t in policy.decode(p.completion_ids, p.completion_mask)]
            out += [Sample(start + row // n, chat_completion(text, chunk[row // n].entry_point) if sampling.chat_code
                           else truncate(text, sampling.stop)) for row, text in enumerate(texts)]
            if on_progress:
                on_progress("generating", start + len(chunk), len(items))
    return out


def grade(suite: Suite, samples: list[Sample], on_progress: ProgressFn | None = None) -> list[Verdict]:
    """The verdict of every sample, in order, graded a few at a time so progress moves."""
    step = 4 * default_workers()
    verdicts: list[Verdict] = []
    for start in range(0, len(samples), step):
        chunk = samples[start:start + step]
        verdicts += suite.grade([s.completion for s in chunk], [suite.items[s.task] for s in chunk])
        if on_progress:
            on_progress("grading", start + len(chunk), len(samples))
    return verdicts
