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
    perturb_scale: float = typer.Option(0.5, "--perturb-scale", hidden=True),
    engine_temperature: float = typer.Option(1.0, "--engine-temperature", min=1e-6,
                                             help="Temperature the engine's logprobs were taken at (vLLM's default: raw, 1.0)."),
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

    profile = None
    if profile_path is not None:
        from orbitctl.profile import load_profile

        profile = load_profile(profile_path, overrides(set_))
    elif set_:
        raise UserError("--set needs a PROFILE", fix="orbitctl verify-alignment PROFILE --set KEY=VALUE")
    perturb = None
    if perturb_layer is not None:
        from orbitctl.align.internal import Perturbation

        perturb = Perturbation(perturb_layer, perturb_scale)
    progress = None if json_out else Progress()
    try:
        report = verify_alignment(profile, adapter=adapter, prompts_file=prompts, rollouts=rollouts, logits_a=logits_a,
                                  logits_b=logits_b, run=run, infer_quant=infer_quant, per_layer=per_layer,
                                  perturb=perturb, engine_temperature=engine_temperature,
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


def render(report, plot: str | None) -> None:
    from rich.table import Table

    src = report.source
    if src:
        where = ", ".join(f"{k}: {v}" for k, v in src.items() if k not in ("per_layer", "first_jump"))
        output.show(f"[bold]compared[/bold] {report.tokens:,} tokens ({where})")
    if report.summary:
        table = Table(title="per-token metrics (train vs infer)")
        for col in ("metric", "mean", "p99", "max"):
            table.add_column(col, justify="left" if col == "metric" else "right")
        for name, stats in report.summary.items():
            table.add_row(name, *(f"{stats[s]:.3g}" for s in ("mean", "p99", "max")))
        output.show(table)
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
