"""`orbitctl train`: GRPO/PPO with trainable adapters on the frozen quantized base.

    orbitctl train profiles/tiny-cpu.yaml
    orbitctl train profiles/tiny-cpu.yaml --steps 50 --set rl.lr=5e-4
    orbitctl train profiles/tiny-cpu.yaml --fresh --json
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.command import Command
from orbitctl.cli.common import JsonOption, SetOption, overrides
from orbitctl.units import gib


def train_command(
    profile_path: str = typer.Argument(..., metavar="PROFILE", help="Profile YAML file."),
    set_: Optional[List[str]] = SetOption,
    fresh: bool = typer.Option(False, "--fresh", help="Start over instead of resuming the run directory's newest checkpoint."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Optimizer steps (overrides rl.steps)."),
    hostfile: Optional[str] = typer.Option(None, "--hostfile", metavar="FILE",
                                           help="hardware.nodes > 1: DeepSpeed hostfile, one 'host slots=N' line per node."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", metavar="ADDR",
                                              help="hardware.nodes > 1: the address of the first node."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what train would build for each rank (layout, experts, "
                                 "DeepSpeed config, offload and chunking, the plan, the machine check) and exit; "
                                 "loads no weights and needs no GPU, but refuses a model or data path that is not "
                                 "there."),
    rehearse: bool = typer.Option(False, "--rehearse", help="Rehearse the profile's GPU paths on this CPU and exit: "
                                  "fake cuda tensors at the model's real widths, one rank of the profile's world under "
                                  "a group that takes CUDA tensors only, as NCCL does (docs/train.md, Rehearsal)."),
    json_out: bool = JsonOption,
) -> None:
    """Train adapters with GRPO/PPO on the profile's ranks (started here); rerunning resumes from the newest checkpoint.

    Examples:

        orbitctl train profiles/tiny-cpu.yaml

        orbitctl train profiles/tiny-cpu.yaml --steps 50 --set rl.lr=5e-4

        orbitctl train profiles/tiny-cpu.yaml --fresh --json

        orbitctl train profiles/kimi-k2_grpo_int4_8xh200.yaml --dry-run

        orbitctl train profiles/kimi-k2_grpo_int4_8xh200.yaml --rehearse
    """
    from orbitctl.launch import api

    profile = api.load_train_profile(profile_path, overrides(set_))
    if rehearse:
        _rehearse(profile, profile_path, overrides(set_), json_out,
                  {"--fresh": fresh, "--steps": steps is not None, "--hostfile": hostfile is not None,
                   "--master-addr": master_addr is not None, "--dry-run": dry_run})
        return
    if dry_run:
        report = api.dry_run(profile)
        if json_out:
            output.emit_json(report.to_dict())
        else:
            _show_dry_run(report)
        return
    view = None if json_out else LiveView(profile.rl.steps if steps is None else steps, profile.run.log_every)
    try:
        result = api.train(profile, fresh=fresh, steps=steps, on_event=view.event if view else None,
                           hostfile=hostfile, master_addr=master_addr)
    finally:
        if view:
            view.close()
    if result.rank != 0:  # under a launcher every rank returns; one of them reports
        return
    if json_out:
        output.emit_json(result.to_dict())
        return
    before = "n/a" if result.eval_before is None else f"{result.eval_before:.1%}"
    after = "n/a" if result.eval_after is None else f"{result.eval_after:.1%}"
    output.show(f"held-out greedy accuracy: before {before} -> after {after}  "
                f"({result.steps} steps, {result.wall_s:.0f} s; adapter in {result.adapter_dir})")
    phases = (result.last_metrics or {}).get("phase_memory")
    if phases:
        output.show(_memory_table(phases, (result.last_metrics or {}).get("phase_memory_kind", "")))


def _rehearse(profile, profile_path: str, sets: list[str], json_out: bool, others: dict[str, bool]) -> None:
    """``--rehearse``: the rehearsal in a process of its own (its fake CUDA loads before torch); exit 1 when a
    step failed."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from orbitctl.launch.rehearse import rehearsal_config
    from orbitctl.errors import UserError

    given = [name for name, on in others.items() if on]
    if given:
        raise UserError(f"--rehearse runs no training: {given[0]} does not go with it", fix=f"drop {given[0]}")
    rehearsal_config(profile, profile_path)  # exit 2 here for a model the rehearsal does not build
    with tempfile.TemporaryDirectory(prefix="orbitctl-rehearse-") as tmp:
        report_file = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "orbitctl.launch.rehearse", "--profile", profile_path, "--json", str(report_file)]
        for value in sets:
            cmd += ["--set", value]
        done = subprocess.run(cmd, capture_output=json_out, text=True, check=False)
        if not report_file.exists():
            raise SystemExit(done.returncode or 1)
        report = json.loads(report_file.read_text())
    if json_out:
        output.emit_json(report)
    if any(step["status"] == "fail" for step in report["steps"]):
        raise SystemExit(1)


def _show_dry_run(report) -> None:
    """The dry run as a few tables on stdout."""
    from orbitctl.units import gib

    output.show(f"{report.profile}: what `orbitctl train` would build ({report.world_size} rank(s) on "
                f"{report.nodes} node(s); nothing loaded)")
    ranks = output.table("ranks", ("rank", "node", "device", "sequences/step", "EP group", "EP rank", "routed experts"))
    for r in report.ranks:
        experts = "-" if r.experts is None else f"{r.experts[0]}..{r.experts[1]}"
        ranks.add_row(str(r.rank), str(r.node), r.device, str(r.sequences_per_step),
                      "-" if r.expert_group is None else str(r.expert_group),
                      "-" if r.expert_rank is None else str(r.expert_rank), experts)
    output.show(ranks)
    lay, acc = report.layout, report.accumulation
    output.show(f"layout: {lay['name']}, ZeRO stage {lay['zero_stage']}; micro-batch {acc['micro_batch_size']} x "
                f"{acc['derived']} accumulation steps per rank")
    mech = output.table("memory mechanics", ("key", "train builds", "planned bytes"))
    mech.columns[0].min_width = len("rollout.continuous_batching")  # the longest key, whole on a narrow terminal
    m = report.memory
    mech.add_row("gradient_checkpointing", str(m["gradient_checkpointing"]).lower(), "")
    mech.add_row("keep_frozen_outputs", str(m["keep_frozen_outputs"]).lower(),
                 f"{gib(m['kept_frozen_output_bytes'])} GiB kept per micro-batch" if m["keep_frozen_outputs"] else "")
    mech.add_row("offload_activations", m["offload_activations"],
                 f"{gib(m['offloaded_activation_bytes_per_node'])} GiB host per node" if m["offload_activations"] != "none" else "")
    chunks = f"{m['loss_chunks_per_micro_batch']} chunk(s) per micro-batch" if m["loss_chunk_size"] else "whole micro-batch"
    mech.add_row("loss_chunk_size", f"{m['loss_chunk_size']} ({chunks})",
                 f"{gib(m['logits_loss_bytes'])} GiB logits+loss (unchunked {gib(m['logits_loss_bytes_unchunked'])})")
    mech.add_row("flash_attention", m["attention"], "")
    mech.add_row("offload_params", m["offload_params"],
                 f"{gib(m['offloaded_base_bytes_per_node'])} GiB host per node" if m["offload_params"] != "none" else "")
    mech.add_row("offload_optimizer", m["offload_optimizer"], "")
    mech.add_row("prefetch_layers", str(m["prefetch_layers"]), "")
    mech.add_row("quant.kernel", m["int4_kernel"],
                 f"{gib(m['int4_kernel_pack_bytes'])} GiB kernel packs" if m["int4_kernel_pack_bytes"] else "")
    ro = report.rollout
    mech.add_row("rollout.kv_dtype", ro["kv_dtype"], "")
    mech.add_row("rollout.decode_graphs", "CUDA graphs" if ro["decode_graphs"] else "eager",
                 "static KV cache, each decode step a graph replay" if ro["decode_graphs"] else "")
    mech.add_row("rollout.continuous_batching", "on" if ro["continuous_batching"] else "off",
                 f"at most {ro['batch_size']} sequences at once, a finished one's slot refilled"
                 if ro["continuous_batching"] else "fixed batches")
    output.show(mech)
    output.show("DeepSpeed config:")
    output.emit_json(report.deepspeed_config)
    plan = output.table("plan per phase (per GPU)", ("phase", "peak GiB", "predicted s"))
    seconds = report.plan["phase_seconds"] or {}
    for phase, peak in report.plan["phase_peak_bytes"].items():
        s = seconds.get(phase)
        plan.add_row(phase, gib(peak), "-" if s is None else f"{s:.1f}")
    output.show(plan)
    output.show(report.plan["verdict"])
    check = report.machine_check
    state = "passes here" if check["passes_here"] else "fails here"
    output.show(f"machine check ({', '.join(check['checks'])}): needs {check['needs']}; {state}"
                + ("" if check["passes_here"] else f": {check['message']}"))
    for note in report.notes:
        output.warn(note)


def _memory_table(phases: dict, kind: str):
    """Measured (per rank) against predicted peak memory per phase, GiB."""
    ranks = max(len(p["measured_bytes"]) for p in phases.values())
    table = output.table(f"memory per phase, GiB ({kind}; predicted by orbitctl plan)",
                         ("phase", "predicted", *(f"rank {r}" for r in range(ranks)), "measured/predicted"))
    for name, p in phases.items():
        ratio = p.get("ratio")
        partial = p.get("partial_bytes") or [None] * len(p["measured_bytes"])
        table.add_row(name, "-" if p["predicted_bytes"] is None else gib(p["predicted_bytes"], 3),
                      *(gib(m, 3) if m is not None else f"{gib(q, 3)} (part)" if q is not None else "-"
                        for m, q in zip(p["measured_bytes"], partial)),
                      "-" if ratio is None else f"{ratio:.2f}")
    if any(p.get("partial_bytes") for p in phases.values()):
        table.caption = ("(part): only steps whose update left out the rows without a gradient were measured; "
                         "not compared with the plan")
    return table


class LiveView:
    """Progress, reward, entropy, mismatch, throughput and memory on stderr; warnings as they come."""

    def __init__(self, total: int, every: int) -> None:
        self.total, self.every = total, every
        self.line = output.LiveLine()
        self.last_eval = ""
        self.plan_step_s: float | None = None

    def event(self, kind: str, payload: dict) -> None:
        if kind == "setup":
            self.plan_step_s = payload.get("plan_step_s")
            output.info(f"adapter: {payload['adapter']}")
            output.info(f"base: {payload['base']}{' (built now)' if payload.get('built') else ' (cached)'}")
            if payload.get("quant"):
                output.info(f"frozen base {payload['quant']}")
            for key, fmt in (payload.get("data_formats") or {}).items():
                output.info(f"{key}: read as {fmt}")
            for message in payload.get("warnings", []):
                output.warn(message)
        elif kind == "engine":
            how = "started on loopback" if payload.get("started") else "attached"
            output.info(f"rollout engine: {payload['url']} ({payload['api']} API, {how}); the adapter is hot-loaded "
                        f"before each rollout")
        elif kind == "resume":
            output.info(f"resuming at step {payload['step']} from {payload['checkpoint']}")
        elif kind == "eval":
            self.last_eval = f"eval acc {payload.get('eval_accuracy', float('nan')):.1%}"
            output.info(f"step {payload['step']}: held-out greedy accuracy {payload.get('eval_accuracy', float('nan')):.1%}")
        elif kind == "step":
            for message in payload.get("warnings", []):
                output.warn(message)
            if "eval_accuracy" in payload:
                self.last_eval = f"eval acc {payload['eval_accuracy']:.1%}"
            if payload["step"] % self.every == 0 or payload["step"] == self.total:
                self.line.update(self._line(payload))

    def _line(self, r: dict) -> str:
        def fmt(value, spec):
            return "-" if value is None else format(value, spec)

        return (f"step {r['step']}/{self.total}  {self._eta(r)}  reward {fmt(r['reward_mean'], '.3f')}  "
                f"acc {fmt(r['accuracy'], '.1%')}  "
                f"{self.last_eval}  entropy {fmt(r['entropy'], '.3f')}  k3 {fmt(r['mismatch_k3_kl'], '.1e')}  "
                f"|dlogp|max {fmt(r['mismatch_logp_abs_max'], '.1e')}  {fmt(r['samples_per_s'], '.0f')} samples/s  "
                f"{fmt(r['tokens_per_s'], '.0f')} tok/s  mem {self._memory(r)}")

    def _eta(self, r: dict) -> str:
        """The time left from the measured seconds per step (the mean after the first), beside the plan's."""
        from orbitctl.plan.timing import seconds_text

        steps = [] if r.get("step_s_mean") is None else [f"{seconds_text(r['step_s_mean'])}/step"]
        if self.plan_step_s is not None:
            steps.append(f"plan {seconds_text(self.plan_step_s)}/step")
        return f"ETA {seconds_text(r.get('eta_s'))}" + (f" ({', '.join(steps)})" if steps else "")

    @staticmethod
    def _memory(r: dict) -> str:
        """Measured/predicted GiB per phase (the largest rank), else the process's peak."""
        phases = r.get("phase_memory")
        if not phases:
            return f"{gib(r['peak_memory_bytes'])} GiB"
        parts = []
        for name, p in phases.items():
            known = [m for m in p["measured_bytes"] if m is not None]
            predicted = "-" if p["predicted_bytes"] is None else gib(p["predicted_bytes"])
            parts.append(f"{name} {gib(max(known)) if known else '-'}/{predicted}")
        return " ".join(parts) + " GiB (measured/plan)"

    def close(self) -> None:
        self.line.close()


def register(app: typer.Typer) -> None:
    app.command("train", cls=Command)(train_command)
