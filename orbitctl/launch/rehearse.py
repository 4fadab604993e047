"""The CUDA rehearsal of one profile's GPU paths, on this CPU: ``python -m orbitctl.launch.rehearse``.

    python -m orbitctl.launch.rehearse --profile profiles/kimi-k2_grpo_int4_8xh200.yaml --json report.json
    python -m orbitctl.launch.rehearse --rank 7 --layers 3

The profile's model is written as a header-only checkpoint at its real widths (hidden, experts, vocabulary) and a
reduced depth (``--layers``: the dense layers first, then MoE layers), and every step runs on fake ``cuda``
tensors (:mod:`orbitctl.dist.rehearsal`) as rank ``--rank`` of the profile's world, under a process group that,
like NCCL, takes CUDA tensors only:

1. ``load``: the frozen base and adapters onto the device (:func:`orbitctl.builder.load_policy`): INT4 experts
   split by expert parallelism, the dense weights replicated, the grouped-expert stacks, the LoRA;
2. ``prefill``: the prompts' forward with the router tape recording (the eager all-to-all);
3. ``decode``: one decode step of the path CUDA graphs capture (:class:`~orbitctl.model.graph_decode.StaticDecode`),
   run eagerly under the capturability check, its routing recorded for router replay, then the ranks' lockstep
   (:class:`~orbitctl.model.expert_parallel.Lockstep`: whether every rank is done, the most batches of any);
4. ``sampling``: the keyed draw on the device, with no device-to-host copy of the ``[B, V]`` probabilities;
5. ``update``: one micro-batch of the policy update (router replay, chunked loss, activation offload, backward);
6. ``statistics``: the step's statistics reduced over the ranks;
7. ``adapter_sync``: the adapters' gradients reduced over the data-parallel ranks, as ZeRO does.

Each step records pass or fail with the file and line of a defect; the report (``--json``) lists the collectives
that crossed the group and the device values the host read outside captured regions. Exit 1 if a step failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

DEFAULT_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml"
STEPS = ("load", "prefill", "decode", "sampling", "update", "statistics", "adapter_sync")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE), help="the profile whose GPU paths run")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="override a profile key (repeatable)")
    parser.add_argument("--rank", type=int, default=0, help="the rank this process plays")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers of the model (its first dense layers, "
                                                                 "then MoE layers)")
    parser.add_argument("--batch", type=int, default=0, help="rollout rows (0: the profile's rollout batch)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--json", dest="json_out", help="write the report here")
    args = parser.parse_args(argv)

    from orbitctl.dist import fake_cuda
    from orbitctl.errors import OrbitError

    state = fake_cuda.load()  # before torch: ATen reads its CUDA hooks once
    try:
        report = run(args, state)
    except OrbitError as exc:  # a bad profile or key: one line, its exit code (2), as the CLI prints it
        print(f"Error: {exc.render()}", file=sys.stderr)
        return exc.exit_code
    text = json.dumps(report, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    for step in report["steps"]:
        line = f"{step['step']:<13} {step['status']:<5} {step.get('seconds', 0):6.2f}s"
        if step.get("where"):
            line += f"  {step['where']}: {step['error']}"
        elif step.get("error"):
            line += f"  {step['error']}"
        print(line, flush=True)
    return 1 if any(s["status"] == "fail" for s in report["steps"]) else 0


def run(args, fake_cuda_state: int) -> dict:
    import torch

    from orbitctl.dist.rehearsal import RehearsalError, rehearsal
    from orbitctl.profile.loader import load_profile

    profile = load_profile(args.profile, args.overrides)
    world = profile.hardware.gpus_per_node * profile.hardware.nodes
    work = Path(tempfile.mkdtemp(prefix="orbitctl-rehearsal-"))
    base = _header_only_base(profile, work, args.layers)
    profile = load_profile(args.profile, [*args.overrides, f"model.quantized_path={base}"])
    _import_before_the_shims()
    report: dict = {"profile": str(args.profile), "world": world, "rank": args.rank, "layers": args.layers,
                    "expert_parallel": profile.memory.expert_parallel, "torch": torch.__version__,
                    "fake_cuda_state": fake_cuda_state, "steps": []}
    done: dict = {}
    with rehearsal(world=world, rank=args.rank) as r, _no_disk_reads():
        for name in STEPS:
            entry = {"step": name}
            start = time.perf_counter()
            needed = [d for d in NEEDS.get(name, ()) if d not in done]
            if needed:
                entry.update(status="skip", error=f"needs {', '.join(needed)}")
            else:
                try:
                    facts = STEP_FUNCTIONS[name](r, profile, done, args)
                    entry.update(status="pass", **(facts or {}))
                    done[name] = True
                except RehearsalError as error:
                    entry.update(status="fail", kind=error.kind, where=error.where, error=error.detail)
                except Exception as error:  # noqa: BLE001 - the report keeps going: one step's failure is its own
                    frame = _innermost_own_frame(error)
                    entry.update(status="fail", kind=type(error).__name__, where=frame,
                                 error=str(error).splitlines()[0][:400] if str(error) else type(error).__name__)
            entry["seconds"] = round(time.perf_counter() - start, 2)
            report["steps"].append(entry)
        report["collectives"] = [{"op": c.op, "dtypes": list(c.dtypes), "shapes": [list(s) for s in c.shapes],
                                  "where": c.where} for c in r.collectives]
        report["host_reads"] = r.guard.host_reads
    return report


def _import_before_the_shims() -> None:
    """Libraries that choose a backend when first imported, by asking torch.cuda.is_available(): imported while it
    still answers False, as on a CPU (bitsandbytes would load its CUDA kernels, which a CPU-only torch cannot)."""
    import importlib

    for name in ("bitsandbytes", "peft", "deepspeed"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _innermost_own_frame(error: BaseException) -> str:
    """``file:line`` of the innermost frame of ``error``'s traceback in orbitctl (else the innermost of all)."""
    from orbitctl.dist.rehearsal import _short

    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if "/orbitctl/" in f.filename and "/orbitctl/dist/" not in f.filename]
    pick = (own or frames or [None])[-1]
    return f"{_short(pick.filename)}:{pick.lineno}" if pick is not None else "unknown"


REHEARSED_TYPES = ("deepseek_v3", "kimi_k2")
"""The model types the rehearsal builds (its header-only checkpoint is a DeepSeek-V3-type INT4 MoE's)."""


def rehearsal_config(profile, path: str = "profile") -> dict:
    """The profile's architecture (model.arch from the catalog, or model.config) as a config dict; exit 2 for one
    the rehearsal does not build."""
    from orbitctl.arch.catalog import builtin_config
    from orbitctl.errors import UserError
    from orbitctl.rundir import read_json

    if profile.model.arch is not None:
        config = builtin_config(profile.model.arch)
    elif profile.model.config is not None:
        config = read_json(Path(profile.model.config), what="config.json", key="model.config")
    else:
        raise UserError(f"{path}: model.arch: the rehearsal builds the model from a catalog architecture or "
                        "model.config", fix="set model.arch (orbitctl plan --list-archs) or model.config")
    if config.get("model_type") not in REHEARSED_TYPES:
        raise UserError(f"{path}: model.arch: the rehearsal builds DeepSeek-V3-type MoE models (Kimi-K2, "
                        f"DeepSeek-V3), not {config.get('model_type')}", fix="rehearse a Kimi-K2 or DeepSeek-V3 profile")
    return config


def _header_only_base(profile, work: Path, layers: int) -> Path:
    """The profile's architecture at ``layers`` decoder layers as a header-only INT4 checkpoint with a tokenizer."""
    from orbitctl.model.charset import save_char_tokenizer
    from orbitctl.model.synthetic import write_int4_moe

    config = rehearsal_config(profile)
    config["num_hidden_layers"] = layers
    config["first_k_dense_replace"] = min(int(config.get("first_k_dense_replace", 1)), layers - 1)
    path = write_int4_moe(work / "base", config=config, header_only=True, group_size=profile.quant.group_size,
                          shard_bytes=1 << 62)
    save_char_tokenizer(path, int(config["vocab_size"]))
    return path


class _no_disk_reads:
    """The checkpoint's tensors come back empty (fake, inside the rehearsal): the header-only files hold no data."""

    def __enter__(self):
        import torch

        import orbitctl.codec.safetensors_io as io

        self.module, self.saved = io, io.read_tensor
        io.read_tensor = lambda entry, handle=None, scratch=None: torch.empty(entry.shape, dtype=io.DTYPES[entry.dtype])
        return self

    def __exit__(self, *exc):
        self.module.read_tensor = self.saved


# -- the steps ----------------------------------------------------------------------------------------------------
def _load(r, profile, done, args) -> dict:
    from orbitctl.builder import PreparedBase, load_policy
    from orbitctl.model.expert_parallel import ExpertParallelExperts

    policy = load_policy(profile, PreparedBase(Path(profile.model.quantized_path), None, False, {}),
                         device="cuda:0")
    done["policy"] = policy
    elsewhere = [n for n, t in [*policy.model.named_parameters(), *policy.model.named_buffers()]
                 if t.device.type != "cuda"]
    if elsewhere:
        raise AssertionError(f"{len(elsewhere)} tensors of the model are not on the device, e.g. {elsewhere[0]}")
    layers = [m for m in policy.model.modules() if isinstance(m, ExpertParallelExperts)]
    ep = profile.memory.expert_parallel
    facts = {"moe_layers": len(layers), "trainable_tensors": sum(1 for p in policy.model.parameters()
                                                                    if p.requires_grad)}
    if ep > 1:
        if not layers:
            raise AssertionError(f"memory.expert_parallel {ep}: no expert-parallel layer was built")
        first = layers[0]
        facts.update(experts_held=[first.held.start, first.held.stop - 1], experts_total=first.num_experts,
                     grouped_stack=first.stack is not None,
                     expert_bytes_held=sum(t.numel() * t.element_size() for t in first.buffers()))
        if len(first.held) * ep != first.num_experts:
            raise AssertionError(f"rank holds {len(first.held)} of {first.num_experts} experts at EP {ep}")
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    if not trainable or any(p.device.type != "cuda" for p in trainable):
        raise AssertionError("the adapters are not trainable parameters on the device")
    facts["trainable_params"] = sum(p.numel() for p in trainable)
    return facts


def _prefill(r, profile, done, args) -> dict:
    import torch

    policy = done["policy"]
    batch = args.batch or 8
    ids = torch.zeros((batch, args.prompt), dtype=torch.long, device="cuda")
    mask = torch.ones((batch, args.prompt), dtype=torch.long, device="cuda")
    if policy.routing is not None:
        policy.routing.record()
    with torch.no_grad():
        out = policy.model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache = getattr(out, policy._cache_kw)
    done.update(cache=cache, mask=mask, batch=batch, logits=out.logits[:, -1, :])
    return {"rows": batch, "prompt_tokens": args.prompt, "cache_layers": len(cache.layers)}


def _decode(r, profile, done, args) -> dict:
    import torch

    import contextlib

    from orbitctl.model.graph_decode import StaticDecode, sync_free

    policy, batch, mask = done["policy"], done["batch"], done["mask"]
    new = 4
    positions = mask.sum(-1, keepdim=True)
    if policy.routing is not None:
        policy.routing.record()
    stepper = StaticDecode(policy.model, policy._cache_kw, done["cache"], mask, positions, new, capture=False,
                           routing=policy.routing)
    token = torch.zeros(batch, dtype=torch.long, device="cuda")
    alive = torch.ones(batch, dtype=torch.bool, device="cuda")
    # a GPU captures the step where the profile decodes from graphs and the layers read nothing on the host (the
    # per-expert loop does: it stays eager, and so unchecked here)
    captured = policy.decode_graphs is True and stepper.static and sync_free(policy.model)
    check = r.capturable("the captured decode step (orbitctl/model/graph_decode.py)") if captured \
        else contextlib.nullcontext()
    with torch.no_grad(), check:
        logits = stepper(token, alive)
    finished = torch.zeros(batch, dtype=torch.bool, device="cuda")
    all_done = policy.lockstep.all_done(bool(finished.all()))  # what the sampler asks after every decoded token
    rounds = policy.lockstep.rounds(1)  # what the rollout asks before its batches
    facts = {"static": stepper.static, "captured": captured, "logits": list(logits.shape),
             "lockstep": policy.lockstep.shared,
             "all_done": all_done, "rounds": rounds}
    if policy.routing is not None:
        routes = policy.routing.pop_last()
        facts["recorded_layers"] = len(routes)
        if any(t.device.type != "cuda" for t in routes):
            raise AssertionError("the recorded routing left the device")
        done["routes"] = routes
    done["decode_logits"] = logits
    return facts


def _sampling(r, profile, done, args) -> dict:
    import torch

    from orbitctl.model.draws import KeyedDraws
    from orbitctl.model.policy import _drawn

    logits = done.get("decode_logits", done["logits"])
    batch = logits.shape[0]
    draws = KeyedDraws(profile.run.seed, tuple(range(batch)))
    with torch.no_grad(), r.capturable("device sampling (orbitctl/model/draws.py: no [B, V] copy to the host)"):
        token = _drawn(logits.float(), temperature=profile.rollout.temperature or 1.0, top_p=profile.rollout.top_p,
                       generator=None, draws=draws, step=0)
    if token.device.type != "cuda":
        raise AssertionError(f"the drawn tokens are on {token.device}, not where the probabilities are")
    return {"rows": batch, "vocab": int(logits.shape[-1])}


def _update(r, profile, done, args) -> dict:
    import torch

    from orbitctl.rl.update import StepStats, micro_loss

    policy = done["policy"]
    rows, completion = profile.memory.micro_batch_size, 32
    # the rollout batch lives on the host, as the trainer keeps it: micro_loss moves the micro-batch to the device
    mb = {"prompt_ids": torch.zeros((rows, args.prompt), dtype=torch.long),
          "prompt_mask": torch.ones((rows, args.prompt), dtype=torch.long),
          "completion_ids": torch.zeros((rows, completion), dtype=torch.long),
          "completion_mask": torch.ones((rows, completion), dtype=torch.long),
          "infer_logp": torch.zeros((rows, completion)), "adv": torch.zeros(rows),
          "dist": None, "old_logp": None, "routes": None}
    mb["attention"] = mb["completion_mask"]
    tape = policy.routing
    if tape is not None and profile.rl.router_replay:  # the experts the infer path recorded, replayed
        k = int(policy.model.config.num_experts_per_tok)
        mb["routes"] = torch.zeros((rows, completion, tape.layers, k), dtype=torch.long)
    stats = StepStats()
    loss = micro_loss(policy, mb, profile, float(rows * completion), stats)
    loss.backward()
    grads = [p.grad for p in policy.model.parameters() if p.requires_grad]
    missing = sum(1 for g in grads if g is None)
    if missing == len(grads):
        raise AssertionError("the backward reached no adapter")
    done["grads"] = [g for g in grads if g is not None]
    return {"micro_batch": rows, "completion_tokens": completion, "loss": list(loss.shape),
            "adapters_with_gradient": len(grads) - missing, "offload_bytes": stats.totals.get("offload_bytes", 0),
            "router_replay": mb["routes"] is not None}


def _statistics(r, profile, done, args) -> dict:
    import torch

    from orbitctl.rl.rollout import RolloutBatch
    from orbitctl.rl.trainer import _rollout_stats

    rows = 8
    batch = RolloutBatch(items=[], prompt_ids=torch.zeros((rows, 4), dtype=torch.long),
                         prompt_mask=torch.ones((rows, 4), dtype=torch.long),
                         completion_ids=torch.zeros((rows, 4), dtype=torch.long),
                         completion_mask=torch.ones((rows, 4), dtype=torch.long),
                         infer_logprobs=torch.zeros((rows, 4)), infer_dist=None, completions=[""] * rows,
                         rewards=torch.zeros(rows), rollout_s=0.0, reward_s=0.0)
    before = len(r.collectives)
    stats = _rollout_stats(batch)
    return {"collectives": len(r.collectives) - before, "keys": sorted(stats)}


def _adapter_sync(r, profile, done, args) -> dict:
    from orbitctl.dist import collectives

    before = len(r.collectives)
    for grad in done["grads"]:
        collectives.all_reduce(grad)
    return {"gradients_reduced": len(r.collectives) - before}


STEP_FUNCTIONS = {"load": _load, "prefill": _prefill, "decode": _decode, "sampling": _sampling, "update": _update,
                  "statistics": _statistics, "adapter_sync": _adapter_sync}
NEEDS = {"prefill": ("load",), "decode": ("prefill",), "sampling": ("prefill",), "update": ("load",),
         "adapter_sync": ("update",)}


if __name__ == "__main__":
    sys.exit(main())
