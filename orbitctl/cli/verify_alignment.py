"""`orbitctl verify-alignment`: do the training path and the inference path agree?

    orbitctl verify-alignment profiles/tiny-cpu.yaml
    orbitctl verify-alignment profiles/tiny-cpu.yaml --infer-quant fp8 --per-layer --plot align.png
    orbitctl verify-alignment profiles/tiny-cpu.yaml --rollouts vllm_rollouts.jsonl --json
    orbitctl verify-alignment --logits-a train.safetensors --logits-b engine.safetensors
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.common import JsonOption, SetOption, overrides

INFER_QUANT_HELP = "Serve the infer path from a copy of the same weights in this format: nf4, fp4, int4, fp8 or bf16."


def verify_alignment_command(
    profile_path: Optional[str] = typer.Argument(None, metavar="[PROFILE]",
                                                 help="Profile YAML (needed for the internal check and --rollouts)."),
    adapter: Optional[str] = typer.Option(None, "--adapter", help="Adapter directory (default: the run's adapter/)."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="JSONL prompts (default: the profile's eval data)."),
    rollouts: Optional[str] = typer.Option(None, "--rollouts", help="An engine's rollouts with logprobs (OpenAI-compatible JSONL)."),
    logits_a: Optional[str] = typer.Option(None, "--logits-a", help="Logit dump of the train side: safetensors, tensor logits of tokens x vocab."),
    logits_b: Optional[str] = typer.Option(None, "--logits-b", help="Logit dump of the infer side."),
    run: Optional[str] = typer.Option(None, "--run", help="A run directory: entropy stability and the online mismatch trend."),
    infer_quant: Optional[str] = typer.Option(None, "--infer-quant", help=INFER_QUANT_HELP),
    per_layer: bool = typer.Option(False, "--per-layer", help="Compare hidden states layer by layer; name where they part."),
    perturb_layer: Optional[int] = typer.Option(None, "--perturb-layer", hidden=True),
    perturb_scale: Optional[float] = typer.Option(None, "--perturb-scale", hidden=True),
    engine_temperature: Optional[float] = typer.Option(None, "--engine-temperature", min=1e-6,
                                                       help="With --rollouts: the temperature the engine's logprobs were taken at "
                                                            "(default 1.0, vLLM's raw logprobs)."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG: JS histogram, |dlog p| vs p, per-layer error."),
    set_: Optional[List[str]] = SetOption,
    json_out: bool = JsonOption,
) -> None:
    """Compare the train path with the infer path and judge the profile's alignment gates (exit 1 on FAIL).

    Examples:

        orbitctl verify-alignment profiles/tiny-cpu.yaml

        orbitctl verify-alignment profiles/tiny-cpu.yaml --infer-quant fp8 --per-layer --plot align.png

        orbitctl verify-alignment profiles/tiny-cpu.yaml --rollouts vllm_rollouts.jsonl --json

        orbitctl verify-alignment --logits-a train.safetensors --logits-b engine.safetensors
    """
    from orbitctl.align.verify import verify_alignment
    from orbitctl.errors import CheckFailed, UserError

    sets = overrides(set_)
    source = _token_source(rollouts, logits_a, logits_b, run, prompts, adapter, infer_quant, per_layer)
    _refuse_flags_outside(source, adapter=adapter, prompts=prompts, perturb_layer=perturb_layer,
                          perturb_scale=perturb_scale, engine_temperature=engine_temperature, plot=plot)
    profile = None
    if profile_path is not None:
        from orbitctl.profile import load_profile
        from orbitctl.profile.support import VERIFY_INTERNAL, VERIFY_ROLLOUTS, given_keys, refuse_overrides_outside, \
            refuse_unsupported

        profile = load_profile(profile_path, sets)
        if source in ("internal", "rollouts"):
            refuse_unsupported(profile, VERIFY_INTERNAL if source == "internal" else VERIFY_ROLLOUTS, given_keys(sets))
        else:
            refuse_overrides_outside(sets, ("alignment",), f"verify-alignment {_SOURCE_FLAGS[source]}",
                                     fix="drop it: these comparisons run no model and judge only the alignment gates")
    elif set_:
        raise UserError("--set needs a PROFILE", fix="orbitctl verify-alignment PROFILE --set KEY=VALUE")
    perturb = None
    if perturb_layer is not None:
        from orbitctl.align.internal import Perturbation

        perturb = Perturbation(perturb_layer, 0.5 if perturb_scale is None else perturb_scale)
    progress = None if json_out else Progress()
    try:
        report = verify_alignment(profile, adapter=adapter, prompts_file=prompts, rollouts=rollouts, logits_a=logits_a,
                                  logits_b=logits_b, run=run, infer_quant=infer_quant, per_layer=per_layer,
                                  perturb=perturb, engine_temperature=1.0 if engine_temperature is None else engine_temperature,
                                  on_progress=progress.update if progress else None)
    finally:
        if progress:
            progress.close()
    if plot:
        from orbitctl.align.plot import write_plot

        js_gate = profile.alignment.js_max if profile is not None else 0.05
        write_plot(report, plot, js_gate)
    if json_out:
        output.emit_json(report.to_dict())
    else:
        render(report, plot)
    if report.verdict == "FAIL":
        failed = [g.name for g in report.gates if g.status == "FAIL"]
        raise CheckFailed(f"alignment gates failed: {', '.join(failed)}")


_SOURCE_FLAGS = {"internal": "(internal check)", "rollouts": "--rollouts", "dumps": "--logits-a/--logits-b",
                 None: "--run (alone)"}


def _token_source(rollouts, logits_a, logits_b, run, prompts, adapter, infer_quant, per_layer) -> str | None:
    """Which comparison runs, as the library picks it: rollouts, dumps, internal, or None (--run alone)."""
    if rollouts:
        return "rollouts"
    if logits_a or logits_b:
        return "dumps"
    if run and not (prompts or adapter or infer_quant or per_layer):
        return None
    return "internal"


def _refuse_flags_outside(source: str | None, *, adapter, prompts, perturb_layer, perturb_scale, engine_temperature,
                          plot) -> None:
    """Refuse a flag the chosen comparison would not use."""
    from orbitctl.errors import UserError

    where = f"with verify-alignment {_SOURCE_FLAGS[source]}"
    unused = []
    if source != "internal":
        unused += [("--adapter", adapter, where, "--rollouts recomputes with the adapter of the profile's run (run.dir); "
                                                 "dumps and --run run no model"),
                   ("--prompts", prompts, where, "--rollouts takes its prompts from the rollouts file; dumps and --run use none"),
                   ("--perturb-layer", perturb_layer, where, "only the internal check builds an infer copy to perturb")]
    if source != "rollouts":
        unused.append(("--engine-temperature", engine_temperature, where, "only --rollouts reads an engine's logprobs"))
    if source is None:
        unused.append(("--plot", plot, where, "--run alone compares no tokens to plot"))
    if perturb_layer is None:
        unused.append(("--perturb-scale", perturb_scale, "without --perturb-layer", "it scales the fault that one injects"))
    for flag, value, context, why in unused:
        if value is not None:
            raise UserError(f"{flag} does nothing {context}: {why}", fix=f"drop {flag}")


def render(report, plot: str | None) -> None:
    from rich.table import Table

    src = report.source
    if src:
        where = ", ".join(f"{k}: {v}" for k, v in src.items() if k not in ("per_layer", "first_jump"))
        output.show(f"[bold]compared[/bold] {report.tokens:,} tokens ({where})")
    floor = report.floor
    if report.summary:
        table = Table(title="per-token metrics (train vs infer)")
        columns = ("metric", "mean", "p99", "max") + (("floor mean", "floor max") if floor else ())
        for col in columns:
            table.add_column(col, justify="left" if col == "metric" else "right")
        for name, stats in report.summary.items():
            cells = [f"{stats[s]:.3g}" for s in ("mean", "p99", "max")]
            if floor:
                cells += [f"{floor.summary[name][s]:.3g}" if name in floor.summary else "" for s in ("mean", "max")]
            table.add_row(name, *cells)
        output.show(table)
    if floor:
        bound = floor.bound()
        output.show(f"kernel floor, measured as {floor.measured_as}, logits in {floor.compute_dtype}: "
                    f"JS max {floor.summary['js']['max']:.3g} (one ulp of the largest logit allows {bound['js']:.3g})")
        times = report.floor_times() or {}
        if floor.is_the_comparison:
            output.show("this comparison is the floor: both paths run the same model")
        elif times.get("js") is not None:
            output.show(f"this comparison is {times['js']:.3g}x the floor in JS (mean)")
    if report.layers:
        layers = Table(title="hidden-state relative error by layer")
        layers.add_column("layer")
        layers.add_column("rel. error", justify="right")
        jump = src.get("first_jump")
        for e in report.layers:
            mark = "  <- first jump" if jump and jump["index"] == e.index else ""
            layers.add_row(e.name, f"{e.rel_error:.3g}{mark}")
        output.show(layers)
        if not jump:
            output.show("no layer's error reaches 1% and doubles: the paths do not part at one layer")
        elif jump.get("likely_cause"):
            output.show(f"first jump at {jump['name']}: {jump['likely_cause']}")
    if report.run:
        r = report.run
        output.show(f"run {r['dir']}: {r['steps']} steps; worst entropy fluctuation {r['entropy_fluctuation']:.2%} "
                    f"over steps {r['worst_window'][0]}-{r['worst_window'][1]}")
        for t in r["mismatch_trends"]:
            output.show(f"  {t['metric']}: first {t['first']:.3g} -> last {t['last']:.3g} (max {t['max']:.3g}, "
                        f"slope {t['slope_per_100_steps']:+.3g}/100 steps)")
    gates = Table(title="gates")
    for col in ("check", "value", "gate", "margin", "status"):
        gates.add_column(col, justify="left" if col in ("check", "status") else "right")
    colour = {"PASS": "green", "FAIL": "red", "WARN": "yellow", "n/a": "dim"}
    for g in report.gates:
        value = "n/a" if g.value is None else f"{g.value:.4g}"
        margin = "" if g.margin is None else f"{g.margin:+.0%}"
        gates.add_row(g.name, value, f"{g.op} {g.threshold:g}", margin, f"[{colour[g.status]}]{g.status}[/]")
    output.show(gates)
    for note in report.notes:
        output.info(f"note: {note}")
    if plot:
        output.info(f"plot written to {plot}")
    output.show(f"[bold]verdict: [{colour[report.verdict]}]{report.verdict}[/][/bold]")


class Progress:
    """A bar on stderr while tokens are compared."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TimeElapsedColumn

        self.bar = Bar("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), console=output.stderr, transient=True)
        self.task = None

    def update(self, stage: str, done: int, total: int) -> None:
        if self.task is None:
            self.bar.start()
            self.task = self.bar.add_task(stage, total=total)
        self.bar.update(self.task, completed=done, total=total, description=stage)

    def close(self) -> None:
        if self.task is not None:
            self.bar.stop()


def register(app: typer.Typer) -> None:
    app.command("verify-alignment")(verify_alignment_command)
