"""`orbitctl plan PROFILE`: does the run fit, where does the memory go, what to change.

    orbitctl plan profiles/kimi-k2_grpo_int4_8xb200.yaml
    orbitctl plan profiles/llama-3.1-8b_grpo_qlora-nf4_1x24g.yaml --json
    orbitctl plan profiles/kimi-k2_grpo_int4_8xh200.yaml --sweep memory.micro_batch_size=1,2,4,8

Renders what orbitctl.plan computes: the memory table, the verdict, the communication of one
RL step, its predicted seconds by phase (and on twice the nodes) and the comparison of base
layouts; no rule of its own.
"""

# No ``from __future__ import annotations``: typer reads the command's signature and type hints with every
# annotation evaluated, and string annotations would be compiled at each of those reads, on every run.
from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.command import Command
from orbitctl.cli.common import JsonOption, SetOption, overrides
from orbitctl.units import GiB, MiB, TiB, gib



def plan(
    profile: Optional[str] = typer.Argument(None, metavar="PROFILE", help="Profile YAML file."),
    set_: Optional[List[str]] = SetOption,
    json_out: bool = JsonOption,
    sweep: Optional[List[str]] = typer.Option(
        None, "--sweep", metavar="KEY=V1,V2", help="Plan every value of a key (repeatable: all combinations)."),
    measure: bool = typer.Option(
        False, "--measure", help="Calibrate activations and logits with one fake-tensor step of a 2-layer copy (imports torch)."),
    measure_time: bool = typer.Option(
        False, "--measure-time", help="Time real RL steps on this CPU (one rank, one thread) against the predicted "
                                      "seconds per phase at this machine's measured rates (imports torch)."),
    calibrate: bool = typer.Option(
        False, "--calibrate", help="Measure the kernels the time model counts at the profile's shapes on this machine "
                                   "(its GPU kind, or a CPU profile here), write a calibration file and plan with it "
                                   "(imports torch; under 2 minutes on one GPU)."),
    out: Optional[str] = typer.Option(
        None, "--out", metavar="FILE", help="The calibration file --calibrate writes (default: "
                                            "calibration-GPU.json here); name it as hardware.calibration."),
    compare: Optional[str] = typer.Option(
        None, "--compare", metavar="AXES", help="Rank the run in other layouts by predicted step time at equal batch: "
                                               "all, or a comma list of layout (ZeRO-3 gathers vs EP), engine "
                                               "(shared vs separate), nodes (1 vs 2)."),
    list_archs: bool = typer.Option(False, "--list-archs", help="List the built-in architectures and exit."),
) -> None:
    """Per-GPU memory by component and phase, the verdict, the largest micro-batch and advice.

    Exit code 0 when the plan fits, 1 when it does not, 2 on bad input.

    Examples:

        orbitctl plan profiles/kimi-k2_grpo_int4_8xb200.yaml

        orbitctl plan profiles/llama-3.1-70b_grpo_qlora-nf4_2x24g.yaml --set memory.seq_len=2048 --json

        orbitctl plan profiles/qwen3-235b-a22b_grpo_int4_8xh100.yaml --sweep memory.micro_batch_size=1,2,4,8

        orbitctl plan profiles/tiny-cpu.yaml --measure

        orbitctl plan profiles/tiny-moe-cpu.yaml --set hardware.gpus_per_node=1 --set memory.expert_parallel=1 --measure-time

        orbitctl plan profiles/kimi-k2_grpo_int4_8xh200.yaml --compare all --set hardware.price_per_gpu_hour=3.5

        orbitctl plan profiles/kimi-k2_grpo_int4_8xh200.yaml --calibrate --out calibration-h200.json
    """
    from orbitctl.plan import api

    result = api.run_plan(profile, overrides(set_), sweeps=list(sweep or []), measure=measure, list_archs=list_archs,
                          measure_time=measure_time, compare=compare, calibrate=calibrate, out=out)
    if json_out:
        output.emit_json(result.to_dict())
    elif result.archs is not None:
        output.show(_arch_table(result.archs))
    elif result.sweep is not None:
        output.show(_sweep_table(result.sweep, result.usable_bytes))
    else:
        _render(result)
    if not result.ok:
        from orbitctl.errors import CheckFailed

        raise CheckFailed(result.failure(), fix="Apply one of the advice lines (--set KEY=VALUE) and plan again")


def _count(params: int) -> str:
    """A parameter count in billions, or in millions below one billion (a 135 M model is not '0.1 B')."""
    return f"{params / 1e9:.1f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"


def _line(markup: str) -> None:
    """One line, never wrapped: verdicts and --set flags must stay copy-pasteable."""
    output.console("stdout").print(markup, soft_wrap=True, highlight=False)


def _summary(result) -> None:
    """The answer first, in at most 10 lines: the verdict, the step and what it rests on, GPU-hours, the first
    advice with its --set line. The tables follow."""
    plan, timing = result.plan, result.plan.timing
    color = "green" if plan.fits and not plan.tight else ("yellow" if plan.fits else "red")
    _line(f"[bold]{result.profile_name}[/bold]: [{color}]{plan.verdict()}[/{color}]")
    if timing is not None:
        phases = timing.phases
        _line(f"step {seconds_text(timing.seconds)} (rollout {seconds_text(phases['rollout'].seconds)}, update "
              f"{seconds_text(phases['policy_update'].seconds + phases['adapter_sync'].seconds)}): "
              f"{timing.confidence()}")
        fast = timing.faster()
        if fast is not None:
            _line(f"  {seconds_text(fast.seconds)} if the grouped INT4 experts ran at the dense kernels' rates (an "
                  "assumption no published kernel meets)")
        _line(_cost_line(timing))
    if plan.advice:
        first = plan.advice[0]
        flags = " ".join(f"--set {value}" for value in first.set_values())
        more = f" ({len(plan.advice) - 1} more below)" if len(plan.advice) > 1 else ""
        _line(f"advice: {first.text}   [dim]{flags}[/dim]{more}")
    _line("")


def _render(result) -> None:
    from rich.table import Table

    from orbitctl.plan import COMPONENTS, PHASES

    plan = result.plan
    _summary(result)
    table = Table(title=f"{result.profile_name}: GiB per GPU", title_justify="left")
    table.add_column("component")
    for phase in PHASES:
        marker = " (peak)" if phase == plan.peak_phase else ""
        table.add_column(phase + marker, justify="right", style="bold" if marker else None)
    for component, meaning in COMPONENTS.items():
        cells = [plan.phases[p].get(component) for p in PHASES]
        if all(not c for c in cells):
            continue
        table.add_row(component, *("" if c is None else gib(c) for c in cells))
    table.add_section()
    table.add_row("total", *(gib(plan.phase_peak_bytes[p]) for p in PHASES))
    output.show(table)
    _line(f"params: {_count(plan.params_total)} total, {_count(plan.params_active)} active, "
          f"{plan.params_trainable / 1e6:.1f} M trainable; largest micro-batch that fits: {plan.max_micro_batch}; "
          f"host RAM {gib(plan.host_bytes)} of {gib(plan.host_capacity_bytes)} GiB per node")
    if plan.communication is not None and plan.communication.total_bytes:
        output.show(_comm_table(plan.communication))
        _line(_comm_line(plan.communication))
    if plan.timing is not None:
        output.show(_time_table(plan.timing))
        output.show(_where_table(plan.timing))
    if plan.nodes:
        output.show(_nodes_table(plan.nodes))
    if plan.layouts:
        output.show(_layouts_table(plan.layouts))
        _line("*: the profile's layout; green: the least traffic, and the shortest predicted rollout and step, "
              "of the layouts that run (max mb > 0)")
    for note in plan.notes:
        _line(f"note: {note}")
    if plan.advice:
        _line("advice:")
        for i, advice in enumerate(plan.advice, 1):
            flags = " ".join(f"--set {value}" for value in advice.set_values())
            _line(f"  {i}. {advice.text}   [dim]{flags}[/dim]")
    if result.measurement is not None:
        output.show(_measure_table(result.measurement))
    if result.time_measurement is not None:
        output.show(_measure_time_table(result.time_measurement))
    if getattr(result, "comparison", None) is not None:
        output.show(_compare_table(result.comparison))
        for note in result.comparison["notes"]:
            _line(f"note: {note}")


def seconds_text(s: float | None) -> str:
    """orbitctl.plan.timing.seconds_text, imported when a table needs it (the CLI starts without the planner)."""
    from orbitctl.plan.timing import seconds_text as text

    return text(s)


def _unit(rows) -> tuple[str, int]:
    """The layouts table's unit: the largest of TiB, GiB, MiB that some layout's total reaches."""
    most = max(r["total_bytes"] for r in rows)
    return next(((name, size) for name, size in (("TiB", TiB), ("GiB", GiB)) if most >= size), ("MiB", MiB))


def _in(n: float, unit: int) -> str:
    return f"{n / unit:,.0f}" if n >= 100 * unit else f"{n / unit:.2f}"


def _comm_table(comm):
    from orbitctl.plan import COMM_TERMS
    from orbitctl.plan.comm import bytes_text

    table = output.table(f"one RL step, {comm.layout}: bytes each GPU sends", ("term", "bytes"))
    for term in COMM_TERMS:
        table.add_row(term, bytes_text(comm.terms[term]))
    table.add_section()
    table.add_row("total", bytes_text(comm.total_bytes))
    return table


def _comm_line(comm) -> str:
    step = comm.shape
    return (f"RL step per GPU: {step.sequences} completions in {step.rollout_rounds} rollout round(s) of "
            f"{step.rollout_forwards} forwards, {step.micro_batches} micro-batches of {step.tokens_per_micro_batch} "
            f"tokens; at least {seconds_text(comm.link_seconds)} of traffic on the GPU links")


WIDE = 110
"""Columns from which the layouts table shows each traffic term; narrower, their total only (--json has all)."""


def _layouts_table(rows):
    from rich import box

    name, unit = _unit(rows)
    wide = output.console("stdout").width >= WIDE
    terms = ("gather", "a2a", "reduce") if wide else ()
    table = output.table(f"base layouts: peak GiB per GPU; {name} each GPU sends per RL step",
                         ("EP", "dense", "peak", "max mb", *terms, name, ">= link", "rollout", "step"),
                         left=("dense",))
    table.box, table.pad_edge = box.SIMPLE_HEAD, False
    for row in rows:
        b = row["bytes"]
        peak = gib(row["peak_bytes"], 1)
        split = [_in(b["gathered"], unit), _in(b["exchanged"], unit), _in(b["all_reduce"], unit)] if wide else []
        cells = [str(row["expert_parallel"]) + ("*" if row["current"] else ""), row["dense_layout"],
                 peak if row["fits"] else f"[red]{peak}[/red]", str(row["max_micro_batch"]), *split,
                 _in(row["total_bytes"], unit), seconds_text(row["link_seconds"]), seconds_text(row["rollout_seconds"]),
                 seconds_text(row["step_seconds"])]
        table.add_row(*(f"[bold green]{c}[/bold green]" if row["best"] else c for c in cells[:-2]),
                      *(f"[bold green]{c}[/bold green]" if row["fastest"] else c for c in cells[-2:]))
    return table


def _time_table(timing):
    from rich import box

    from orbitctl.plan.timing import TIME_PHASES

    table = output.table(f"one RL step, predicted seconds per GPU: {seconds_text(timing.seconds)}, "
                         f"{timing.gpu_hours:.3g} GPU-hours on {timing.world} GPU(s)",
                         ("phase", "compute", "HBM", "comm", "overhead", "time", "bound", "tok/s"))
    table.box, table.pad_edge, table.padding = box.SIMPLE_HEAD, False, (0, 0, 0, 1)
    for name in TIME_PHASES:
        p = timing.phases[name]
        table.add_row(name, seconds_text(p.compute_s), seconds_text(p.memory_s), seconds_text(p.comm_s),
                      seconds_text(p.overhead_s + p.host_s), seconds_text(p.seconds), p.bound,
                      f"{p.tokens_per_s:,.0f}" if p.tokens else "-")
    if timing.phases["rollout"].synchronous:
        rule = ("time = compute + HBM + overhead + comm, one op after another;\n"
                "overhead: the ops' own and the host's (tokenizer, draws) (docs/plan.md)")
    else:
        rule = ("time: kernels one after another (each class at the slowest of FLOPs,\n"
                "bytes, floors) + comm + host; overhead: floors, gaps, host (docs/plan.md)")
    table.caption, table.caption_justify = rule, "left"
    return table


def _rate_text(name: str, rate: dict) -> str:
    value, unit = rate["value"], rate["unit"]
    shown = f"{value * 1e6:.3g} us" if unit == "s" else f"{value:.3g} {unit}"
    return f"{name} {shown} ({rate['kind']}): {rate['brief'] or rate['source']}"


def _where_table(timing):
    """The terms that make up most of each phase, and where the rates they rest on come from."""
    from rich import box

    table = output.table("where the predicted time goes, and where its rates come from",
                         ("phase", "term", "time", "share", "rates"), left=("phase", "term", "rates"))
    table.box, table.pad_edge, table.padding = box.SIMPLE_HEAD, False, (0, 0, 0, 1)
    for row in timing.dominant():
        rates = "\n".join(_rate_text(k, r) for k, r in row["rates"].items()) or "-"
        table.add_row(row["phase"], row["term"], seconds_text(row["seconds"]), f"{row['share']:.0%}", rates)
    fast = timing.faster()
    if fast is not None:
        from orbitctl.plan.rates import TUNED

        changes = ", ".join(f"{k} {r.value:g} {r.unit}" for k, r in TUNED.items())
        table.caption_justify = "left"
        table.caption = (f"faster, on an assumption no published kernel meets ({changes}):\nstep "
                         f"{seconds_text(fast.seconds)}, rollout {seconds_text(fast.phases['rollout'].seconds)}, "
                         f"update {seconds_text(fast.phases['policy_update'].seconds)}")
    return table


def _cost_line(timing) -> str:
    from orbitctl.plan.timing import cost_text

    text = (f"GPU-hours: {timing.gpu_hours:.3g} per step, {timing.run_gpu_hours:,.4g} per run of {timing.steps} RL "
            f"step(s) ({seconds_text(timing.seconds * timing.steps)})")
    if timing.price_per_gpu_hour is None:
        return text + "; no price (set hardware.price_per_gpu_hour, USD)"
    return (text + f"; at ${timing.price_per_gpu_hour:g}/GPU-hour: {cost_text(timing.cost_per_step)} per step, "
            f"{cost_text(timing.cost_per_run)} per run")


def _compare_table(doc):
    from rich import box

    from orbitctl.plan.timing import cost_text

    table = output.table("--compare: predicted seconds per RL step at equal batch, fastest first",
                         ("option", "rollout", "update", "step", "x own", "GPU-h", "cost", "fits"), left=("option",),
                         )
    table.box, table.pad_edge, table.padding = box.SIMPLE_HEAD, False, (0, 0, 0, 1)
    axis = None
    for row in doc["rows"]:
        if row["axis"] != axis:
            axis = row["axis"]
            table.add_row(f"[bold]{axis}[/bold]", *[""] * 7)
        ph, ratio = row["phase_seconds"], row["vs_current"]
        cells = ["  " + row["option"] + ("*" if row["current"] else ""), seconds_text(ph["rollout"]),
                 seconds_text(ph["policy_update"] + ph["adapter_sync"]), seconds_text(row["seconds"]),
                 "-" if ratio is None else f"{ratio:.2f}", f"{row['gpu_hours']:.3g}", cost_text(row["cost_per_step"]),
                 "yes" if row["fits"] else "[red]no[/red]"]
        table.add_row(*(f"[bold green]{c}[/bold green]" if row["rank"] == 1 else c for c in cells))
    table.caption = ("*: the profile's own; update includes the adapter sync; x own: step / the profile's step;\n"
                     "the --set values of each row: --json (comparison.rows[].set)")
    return table


def _nodes_table(rows):
    table = output.table("the same run on more nodes (same global batch; NIC between nodes)",
                         ("nodes", "GPUs", "rollout", "update", "step", "GPU-h", "decode tok/s", "fits"))
    for row in rows:
        ph = row["phase_seconds"]
        table.add_row(str(row["nodes"]), str(row["world"]), seconds_text(ph["rollout"]),
                      seconds_text(ph["policy_update"]), seconds_text(row["seconds"]), f"{row['gpu_hours']:.3g}",
                      f"{row['rollout_tokens_per_s']:,.0f}", "yes" if row["fits"] else "[red]no[/red]")
    return table


def _measure_table(m):
    table = output.table(f"--measure: {m.layers}-layer copy at real width, {m.tokens} tokens per micro-batch (MiB)",
                         ("component", "predicted", "measured", "measured/predicted"))
    for row in m.rows:
        pred, meas = row["predicted_bytes"], row["measured_bytes"]
        table.add_row(row["component"], f"{pred / MiB:.1f}", f"{meas / MiB:.1f}",
                      f"{meas / pred:.2f}" if pred else "-")
    table.caption = (f"calibrated full-model activations {gib(m.calibrated_bytes['activations'])} GiB, "
                     f"logits {gib(m.calibrated_bytes['logits_loss'])} GiB (ratio {m.activation_ratio:.2f})"
                     + "".join(f"\nnote: {n}" for n in m.notes))
    return table


def _measure_time_table(m):
    calibrated = m.calibrated is not None
    table = output.table("--measure-time: one real RL step on this machine (seconds)",
                         ("phase", "predicted", "measured", "predicted/measured", "bound")
                         + (("calibrated", "calibrated/measured") if calibrated else ()))
    for row in m.rows:
        ratio = row["predicted_over_measured"]
        cells = [row["phase"], f"{row['predicted_s']:.4f}", f"{row['measured_s']:.4f}",
                 "-" if ratio is None else f"{ratio:.3g}", row["bound"]]
        if calibrated:
            cal = row["calibrated_over_measured"]
            cells += [f"{row['calibrated_s']:.4f}", "-" if cal is None else f"{cal:.3g}"]
        table.add_row(*cells)
    table.caption = "\n".join(f"note: {n}" for n in m.notes)
    return table


def _sweep_table(rows, usable):
    from rich.table import Table

    keys = list(rows[0]["values"]) if rows else []
    table = Table(title=f"sweep (GiB per GPU, limit {gib(usable)})", title_justify="left")
    for k in keys:
        table.add_column(k.rsplit(".", 1)[-1], overflow="fold")  # the section is in the --sweep flag
    priced = any(row.get("cost_per_step") is not None for row in rows)
    for col in ("peak", "phase", "util", "fits", "max mb", "step", "GPU-h") + (("cost",) if priced else ()):
        table.add_column(col, justify="right", overflow="fold")
    for row in rows:
        cost = []
        if priced:
            from orbitctl.plan.timing import cost_text

            cost = [cost_text(row.get("cost_per_step"))]
        table.add_row(*(str(row["values"][k]) for k in keys), gib(row["peak_bytes"]), row["peak_phase"],
                      f"{row['utilization']:.0%}", "yes" if row["fits"] else "[red]no[/red]", str(row["max_micro_batch"]),
                      seconds_text(row["step_seconds"]), f"{row['gpu_hours']:.3g}", *cost)
    return table


def _arch_table(archs):
    table = output.table("built-in architectures", ("arch", "model_type", "layers", "attention", "total (B)", "active (B)"),
                         left=("arch", "model_type", "attention"))
    for a in archs:
        table.add_row(a["name"], a["model_type"], str(a["layers"]), a["attention"],
                      f"{a['params_total'] / 1e9:.2f}", f"{a['params_active'] / 1e9:.2f}")
    return table


def register(app: typer.Typer) -> None:
    app.command("plan", cls=Command)(plan)
