"""`orbitctl quantize`: turn a Hugging Face checkpoint into the frozen quantized base, streaming.

    orbitctl quantize my-profile.yaml          (model.path -> model.quantized_path, quant section)
    orbitctl quantize hf/llama-8b out/llama-8b-nf4 --format nf4 --eval-prompts 8
    orbitctl quantize --verify out/llama-8b-nf4
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.command import Command
from orbitctl.cli.common import JsonOption, SetOption, overrides


def quantize(
    target: Optional[str] = typer.Argument(None, metavar="PROFILE | SRC", help="A profile YAML, or a checkpoint directory or .gguf file, pkg:PACKAGE/PATH too (then OUT and --format)."),
    out: Optional[str] = typer.Argument(None, metavar="OUT", help="Output directory (with SRC)."),
    fmt: Optional[str] = typer.Option(None, "--format", "-f", help="nf4, fp4, int4, fp8 or none (required with SRC; with a profile it sets quant.format)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="bnb block size (nf4/fp4) or INT4 group (32/64/128); unset: quant.group_size."),
    double_quant: Optional[bool] = typer.Option(None, "--double-quant/--no-double-quant", help="nf4/fp4: quantize the absmax scales again; unset: quant.double_quant."),
    storage_dtype: Optional[str] = typer.Option(None, "--storage-dtype", help="nf4/fp4 packed storage dtype: bf16 (ZeRO-3 shardable) or uint8; unset: quant.storage_dtype."),
    modules: Optional[str] = typer.Option(None, "--modules", help="all-linear, or experts (routed experts only); unset: quant.modules."),
    skip: Optional[List[str]] = typer.Option(None, "--skip", help="Module-name substring kept in bf16 (repeatable); unset: quant.skip."),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help="Largest output shard, e.g. 2GB (the default), 500MB."),
    eval_prompts: Optional[int] = typer.Option(None, "--eval-prompts", min=0, help="Compare next-token distributions on N prompts (model must fit in RAM); default 0."),
    verify: Optional[str] = typer.Option(None, "--verify", metavar="OUT", help="Re-hash a finished output against its manifest and exit."),
    set_: Optional[List[str]] = SetOption,
    json_out: bool = JsonOption,
) -> None:
    """Quantize a checkpoint tensor by tensor (nf4, fp4, int4, fp8), with a quality report; resumable.

    Unset flags take the profile schema's quant defaults. With a profile, a flag sets its quant key
    (--group-size 32 is --set quant.group_size=32); with SRC OUT, --set takes quant.* keys.

    Examples:

        orbitctl quantize my-profile.yaml --set quant.format=fp8

        orbitctl quantize hf/llama-8b out/llama-8b-nf4 --format nf4 --eval-prompts 8

        orbitctl quantize hf/qwen3-30b-a3b out/qwen3-int4 --format int4 --group-size 32 --modules experts --json

        orbitctl quantize --verify out/llama-8b-nf4
    """
    from orbitctl.quant import api

    flags = _quant_flags(fmt, group_size, double_quant, storage_dtype, modules, skip)
    with output.progress("quantizing", unit="bytes", enabled=not json_out and not verify) as progress:
        result = api.quantize(target, out, flags=flags, overrides=overrides(set_), verify=verify,
                              max_shard_size=max_shard_size, eval_prompts=eval_prompts, progress=progress)
    if verify:
        if json_out:
            output.emit_json(result)
        else:
            output.info(f"[green]ok[/green]  {len(result['files'])} files match {verify}/quant_manifest.json")
        return
    if json_out:
        output.emit_json(result.to_dict())
    else:
        _render(result)


def _quant_flags(fmt, group_size, double_quant, storage_dtype, modules, skip) -> dict:
    """The quant flags given on the command line: field -> (flag as typed, value)."""
    given = {
        "format": ("--format", fmt),
        "group_size": ("--group-size", group_size),
        "double_quant": ("--double-quant" if double_quant else "--no-double-quant", double_quant),
        "storage_dtype": ("--storage-dtype", storage_dtype),
        "modules": ("--modules", modules),
        "skip": ("--skip", list(skip) if skip else None),
    }
    return {name: pair for name, pair in given.items() if pair[1] is not None}


def _render(result) -> None:
    report = result.report
    table = output.table(f"{result.output}  ({_fmt_name(result.format)})",
                         ("kind", "tensors", "params", "rel err", "SQNR dB", "max abs", "bits/w"), no_wrap=True)
    for kind, row in report.get("summary", {}).get("quantized", {}).items():
        table.add_row(kind, str(row["tensors"]), f"{row['params']:,}", f"{row['rel_fro_error']:.4f}",
                      "exact" if row["sqnr_db"] is None else f"{row['sqnr_db']:.1f}", f"{row['max_abs_error']:.4g}",
                      f"{row['bits_per_weight']:.3f}")
    for kind, row in report.get("summary", {}).get("kept", {}).items():
        bits = row.get("bits_per_weight")
        table.add_row(f"[dim]{kind} kept[/dim]", str(row["tensors"]), f"{row['params']:,}", "-", "-", "-",
                      "-" if bits is None else f"{bits:.1f}")
    output.show(table)
    bpw = report.get("bits_per_weight_quantized")
    lines = [f"bytes in {result.bytes_in:,}  out {result.bytes_out:,}  "
             f"bits/weight (quantized) {bpw:.3f}" if bpw else f"bytes in {result.bytes_in:,}  out {result.bytes_out:,}"]
    if report.get("passthrough"):
        lines.append("source already in this format: copied as is, not re-quantized")
    if "eval" in report:
        ev = report["eval"]
        lines.append(f"next-token, {ev['prompts']} prompts / {ev['positions']} positions: JS mean {ev['js_mean']:.4g} max {ev['js_max']:.4g}, "
                     f"top-1 agreement {ev['top1_agreement']:.3f}, log-softmax L1 {ev['logsoftmax_l1_mean']:.4g}")
    resumed = f", {result.resumed_shards} resumed" if result.resumed_shards else ""
    lines.append(f"{result.shards} shard(s){resumed}, {result.seconds:.1f} s; report {result.report_path}")
    for line in lines:
        output.show(line)
    for note in report.get("notes", []):
        output.warn(note)


def _fmt_name(spec: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in spec.items())


def register(app: typer.Typer) -> None:
    app.command("quantize", cls=Command)(quantize)
