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
from orbitctl.cli.command import Command
from orbitctl.cli.common import JsonOption, SetOption, overrides

INFER_QUANT_HELP = "Serve the infer path from a copy of the same weights in this format: nf4, fp4, int4, fp8 or bf16."


def verify_alignment_command(
    profile_path: Optional[str] = typer.Argument(None, metavar="PROFILE",
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
    from orbitctl.align import api
    from orbitctl.errors import CheckFailed

    profile, perturb, engine_temperature = api.prepare_request(profile_path, overrides(set_), adapter=adapter, prompts=prompts,
                                           rollouts=rollouts, logits_a=logits_a, logits_b=logits_b, run=run,
                                           infer_quant=infer_quant, per_layer=per_layer, perturb_layer=perturb_layer,
                                           perturb_scale=perturb_scale, engine_temperature=engine_temperature, plot=plot)
    with output.progress(stages=True, enabled=not json_out) as progress:
        report = api.verify_alignment(profile, adapter=adapter, prompts_file=prompts, rollouts=rollouts, logits_a=logits_a,
                                      logits_b=logits_b, run=run, infer_quant=infer_quant, per_layer=per_layer,
                                      perturb=perturb, engine_temperature=engine_temperature,
                                      on_progress=progress)
    if plot:
        api.write_report_plot(report, plot, profile)
    if json_out:
        output.emit_json(report.to_dict())
    else:
        render(report, plot)
    if report.verdict == "FAIL":
        failed = [g.name for g in report.gates if g.status == "FAIL"]
        raise CheckFailed(f"alignment gates failed: {', '.join(failed)}")


def _render_routing(routing: dict) -> None:
    """An MoE's routing agreement per layer and its mismatch split into routing and numerics."""
    per_layer = ", ".join("n/a" if v is None else f"{v:.2%}" for v in routing["agreement_per_layer"])
    overall = routing["agreement"]
    output.show(f"routing agreement (same top-k set on both paths): "
                f"{'n/a' if overall is None else f'{overall:.2%}'} of {routing['tokens_compared']:,} tokens; "
                f"per MoE layer {per_layer}")
    table = output.table("MoE mismatch, routing vs numerics (means)",
                         ("metric", "without replay", "with replay (numerics)", "routing"))
    for metric, parts in routing["mismatch"].items():
        table.add_row(metric, *(f"{parts[k]:.3g}" for k in ("without_replay", "with_replay", "routing")))
    output.show(table)
    output.show("the comparison above " + ("replays the recorded routing (rl.router_replay: true)"
                                          if routing["replayed_in_comparison"] else
                                          "routes on each path (rl.router_replay: false)"))


def render(report, plot: str | None) -> None:
    src = report.source
    if src:
        where = ", ".join(f"{k}: {v}" for k, v in src.items() if k not in ("per_layer", "first_jump", "routing"))
        output.show(f"[bold]compared[/bold] {report.tokens:,} tokens ({where})")
    floor = report.floor
    if report.summary:
        columns = ("metric", "mean", "p99", "max") + (("floor mean", "floor max") if floor else ())
        table = output.table("per-token metrics (train vs infer)", columns)
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
            l1 = times.get("logsoftmax_l1")
            output.show(f"this comparison is {times['js']:.3g}x the floor in JS"
                        + (f", {l1:.3g}x in log-softmax L1" if l1 is not None else "") + " (means)")
    if src.get("routing"):
        _render_routing(src["routing"])
    if report.layers:
        layers = output.table("hidden-state relative error by layer", ("layer", "rel. error"))
        jump = src.get("first_jump")
        for e in report.layers:
            mark = "  <- first jump" if jump and jump["index"] == e.index else ""
            layers.add_row(e.name, f"{e.rel_error:.3g}{mark}")
        output.show(layers)
        if report.layer_finding():
            output.show(report.layer_finding())
    if report.run:
        r = report.run
        output.show(f"run {r['dir']}: {r['steps']} steps; worst entropy fluctuation {r['entropy_fluctuation']:.2%} "
                    f"over steps {r['worst_window'][0]}-{r['worst_window'][1]}")
        for t in r["mismatch_trends"]:
            output.show(f"  {t['metric']}: first {t['first']:.3g} -> last {t['last']:.3g} (max {t['max']:.3g}, "
                        f"slope {t['slope_per_100_steps']:+.3g}/100 steps)")
    gates = output.table("gates", ("check", "value", "gate", "margin", "status"), left=("check", "status"))
    for g in report.gates:
        value = "n/a" if g.value is None else f"{g.value:.4g}"
        margin = "" if g.margin is None else f"{g.margin:+.0%}"
        gates.add_row(g.name, value, f"{g.op} {g.threshold:g}", margin, output.status(g.status))
    output.show(gates)
    for note in report.notes:
        output.info(f"note: {note}")
    if plot:
        output.info(f"plot written to {plot}")
    output.show(output.status(report.verdict, f"verdict: {report.verdict}"))


def register(app: typer.Typer) -> None:
    app.command("verify-alignment", cls=Command)(verify_alignment_command)
