"""`orbitctl export`: the frozen base (and adapter) as GGUF for llama.cpp, or merged into a bf16 HF checkpoint.

    orbitctl export profiles/tiny-cpu.yaml out/tiny-gguf --format gguf --adapter runs/tiny-cpu/adapter
    orbitctl export profiles/tiny-cpu.yaml out/tiny-merged --format hf-merged --adapter runs/tiny-cpu/adapter
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.command import Command
from orbitctl.cli.common import JsonOption, SetOption, overrides


def export_command(
    profile_path: str = typer.Argument(..., metavar="PROFILE", help="Profile YAML whose frozen base is exported."),
    out: str = typer.Argument(..., metavar="OUT", help="Output directory (written under a temporary name, renamed when complete)."),
    fmt: str = typer.Option(..., "--format", "-f", help="gguf (llama.cpp: base + LoRA files) or hf-merged (bf16 HF checkpoint)."),
    adapter: Optional[str] = typer.Option(None, "--adapter", metavar="DIR", help="A run's adapter/ directory (PEFT LoRA)."),
    prompts: int = typer.Option(8, "--prompts", help="hf-merged: held-out sequences the merge cost is measured on."),
    fresh: bool = typer.Option(False, "--fresh", help="Start over: replace an existing OUT."),
    force: bool = typer.Option(False, "--force", hidden=True, help="The old name of --fresh."),
    set_: Optional[List[str]] = SetOption,
    json_out: bool = JsonOption,
) -> None:
    """Export the frozen base: GGUF (INT4 g32 as Q4_0 with the same integers, LoRA as a separate GGUF) or merged.

    Examples:

        orbitctl export profiles/tiny-cpu.yaml out/gguf --format gguf --set quant.format=int4 --set quant.group_size=32

        orbitctl export profiles/tiny-cpu.yaml out/gguf --format gguf --adapter runs/tiny-cpu/adapter --json

        orbitctl export profiles/tiny-cpu.yaml out/merged --format hf-merged --adapter runs/tiny-cpu/adapter
    """
    from orbitctl.export import api

    if force:
        output.warn("--force is the old name of --fresh, the one word every command uses for starting over")
    with output.progress(stages=True, enabled=not json_out) as progress:
        result = api.export(profile_path, out, fmt, adapter=adapter, overrides=overrides(set_), fresh=fresh or force,
                            prompts=prompts, progress=progress)
    if json_out:
        output.emit_json(result.to_dict())
    else:
        render(result)


def _records_table(title: str, records) -> object:
    table = output.table(title, ("tensor", "stored as", "written as", "status", "why"),
                         left=("tensor", "stored as", "why"))
    for r in records:
        table.add_row(r.name, r.stored_as, r.written_as,
                      output.status("PASS" if r.status == "exact" else "WARN", r.status), r.why)
    return table


def _counts_line(what: str, c: dict) -> str:
    types = ", ".join(f"{k} {v}" for k, v in c["by_type"].items())
    return f"{what}: {c['tensors']} tensors, {c['exact']} exact, {c['converted']} converted ({types})"


def render(result) -> None:
    output.show(_records_table(f"{result.output}  ({result.format})", result.tensors))
    if result.adapter_tensors:
        output.show(_records_table(f"adapter {result.adapter}", result.adapter_tensors))
    output.show(_counts_line("base", result.counts))
    if result.adapter_tensors:
        from orbitctl.export.report import counts

        output.show(_counts_line("adapter", counts(result.adapter_tensors)))
    if result.vocab:
        v = result.vocab
        output.show(f"tokenizer: {v['model']} ({v['tokens']} tokens, {v['merges']} merges), add_bos {v['add_bos']}")
    cost = result.merge_cost
    if cost:
        output.show(f"merge cost vs the train path ({cost['sequences']} held-out sequences, {cost['positions']} positions, "
                    f"{cost['compute_dtype']}): max |dlogit| {cost['max_abs_logit_diff']:.4g} "
                    f"({cost['ulps_at_logit_absmax']:.2f} ulps at |logit| {cost['logit_absmax']:.3g}), "
                    f"log-softmax L1 mean {cost['logsoftmax_l1_mean']:.4g} max {cost['logsoftmax_l1_max']:.4g}, "
                    f"JS max {cost['js_max']:.3g}, top-1 agreement {cost['top1_agreement']:.3f}")
    output.info(f"wrote {', '.join(result.files)} to {result.output} in {result.seconds:.1f} s")


def register(app: typer.Typer) -> None:
    app.command("export", cls=Command)(export_command)
