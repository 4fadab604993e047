"""`verify-alignment` as a library call: pick the source, compare, judge.

Sources of per-token comparisons (one per call):
  * internal (default): :func:`orbitctl.align.selfcheck.compare_internal`;
  * an engine's rollouts (OpenAI-compatible logprobs JSONL): the train path recomputes the
    engine's tokens; metrics on the engine's top-K plus a tail bucket;
  * two logit dumps ``A`` (train side) and ``B`` (infer side), streamed chunk by chunk.
A training run's ``metrics.jsonl`` (``run``) adds entropy stability and the online mismatch
trend, alone or next to a token source.

Every source with a model (internal, rollouts) also reports the kernel floor measured on this
machine (:mod:`orbitctl.align.floor`): how far the trainer's own infer and train paths part on the
same tokens with the same weights, so a mismatch can be read as kernels or as weights and format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from orbitctl.align.verdict import Gate, judge_run, judge_tokens, overall
from orbitctl.errors import UserError
from orbitctl.rundir import RunDir


@dataclass
class AlignmentReport:
    source: dict
    gates: list[Gate]
    summary: dict | None = None
    tokens: int = 0
    run: dict | None = None
    notes: list[str] = field(default_factory=list)
    table: object | None = None          # the TokenTable, for plots
    infer_token_logp: object | None = None
    layers: list | None = None
    floor: object | None = None           # orbitctl.align.floor.KernelFloor, where a model ran

    @property
    def verdict(self) -> str:
        return overall(self.gates)

    def to_dict(self) -> dict:
        return _json_safe({"verdict": self.verdict, "source": self.source, "tokens": self.tokens,
                           "gates": [g.to_dict() for g in self.gates], "metrics": self.summary, "run": self.run,
                           "floor": None if self.floor is None else self.floor.to_dict(),
                           "floor_times": self.floor_times(), "notes": self.notes})

    def layer_finding(self) -> str | None:
        """With ``--per-layer``: where the two paths part, in one sentence (None without per-layer errors)."""
        if not self.layers:
            return None
        from orbitctl.align.selfcheck import JUMP_FLOOR

        jump = self.source.get("first_jump")
        if not jump:
            return f"no layer's error reaches {JUMP_FLOOR:.0%} and doubles: the paths do not part at one layer"
        if jump.get("likely_cause"):
            return f"first jump at {jump['name']}: {jump['likely_cause']}"
        return None

    def floor_times(self) -> dict | None:
        """For each floor metric, the comparison's mean over the floor's mean (None without a floor)."""
        if self.floor is None or self.summary is None:
            return None
        from orbitctl.align.floor import FLOOR_METRICS

        return {m: self.floor.times(self.summary, m) for m in FLOOR_METRICS if m in self.floor.summary}


def _json_safe(value):
    """Non-finite floats (an infinite KL where one side masks a token) as the strings "inf"/"nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


ProgressFn = Callable[[str, int, int], None]


def prepare_request(profile_path: str | None, overrides: list[str], *, adapter=None, prompts=None, rollouts=None,
                    logits_a=None, logits_b=None, run=None, infer_quant=None, per_layer=False, perturb_layer=None,
                    perturb_scale=None, engine_temperature=None, plot=None):
    """What `orbitctl verify-alignment` was asked, checked before anything runs: the loaded profile (or
    None), the fault to inject (or None) and the engine temperature, as a :class:`Request`. A flag, ``--set`` key or profile value the chosen comparison
    would not use is a UserError naming it."""
    source = _token_source(rollouts, logits_a, logits_b, run, prompts, adapter, infer_quant, per_layer)
    _refuse_flags_outside(source, adapter=adapter, prompts=prompts, perturb_layer=perturb_layer,
                          perturb_scale=perturb_scale, engine_temperature=engine_temperature, plot=plot)
    profile = None
    if profile_path is not None:
        from orbitctl.profile import load_profile
        from orbitctl.profile.support import VERIFY_INTERNAL, VERIFY_ROLLOUTS, given_keys, refuse_overrides_outside, \
            refuse_unsupported

        profile = load_profile(profile_path, overrides)
        if source in ("internal", "rollouts"):
            refuse_unsupported(profile, VERIFY_INTERNAL if source == "internal" else VERIFY_ROLLOUTS,
                               given_keys(overrides))
        else:
            refuse_overrides_outside(overrides, ("alignment",), f"verify-alignment {_SOURCE_FLAGS[source]}",
                                     fix="drop it: these comparisons run no model and judge only the alignment gates")
    elif overrides:
        raise UserError("--set needs a PROFILE", fix="orbitctl verify-alignment PROFILE --set KEY=VALUE")
    perturb = None
    if perturb_layer is not None:
        from orbitctl.align.selfcheck import Perturbation

        perturb = Perturbation(perturb_layer, DEFAULT_PERTURB_SCALE if perturb_scale is None else perturb_scale)
    temperature = DEFAULT_ENGINE_TEMPERATURE if engine_temperature is None else engine_temperature
    return Request(profile, perturb, temperature)


class Request(NamedTuple):
    """A checked verify-alignment request: what :func:`verify_alignment` is called with besides the flags."""

    profile: Any
    """The loaded profile, or None (dumps and runs need none)."""
    perturb: Any
    """The fault to inject into the infer copy (``--perturb-layer``), or None."""
    engine_temperature: float
    """The temperature the engine's logprobs were taken at (``--rollouts``)."""


DEFAULT_PERTURB_SCALE = 0.5
"""``--perturb-layer`` without ``--perturb-scale``: the layer's weights times 1.5 (a fault that must be found)."""
DEFAULT_ENGINE_TEMPERATURE = 1.0
"""``--rollouts`` without ``--engine-temperature``: vLLM's raw logprobs are taken at temperature 1."""


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


def write_report_plot(report: AlignmentReport, path: str, profile=None) -> None:
    """The PNG of a report, the JS gate drawn at the profile's ``alignment.js_max`` (the schema's default
    without a profile)."""
    from orbitctl.align.plot import write_plot
    from orbitctl.profile.schema import AlignmentSection

    alignment = profile.alignment if profile is not None else AlignmentSection()
    write_plot(report, path, alignment.js_max)




def verify_alignment(profile, *, adapter: str | None = None, prompts_file: str | None = None,
                     rollouts: str | None = None, logits_a: str | None = None, logits_b: str | None = None,
                     run: str | None = None, infer_quant: str | None = None, per_layer: bool = False,
                     perturb=None, engine_temperature: float | None = None,
                     on_progress: ProgressFn | None = None) -> AlignmentReport:
    """Compare the train path with the infer path (or a run's record) and judge the gates.

    ``profile`` may be None for logit dumps and runs (default gates apply then).
    """
    from orbitctl.profile.schema import AlignmentSection

    alignment = profile.alignment if profile is not None else AlignmentSection()
    if (logits_a is None) != (logits_b is None):
        raise UserError("--logits-a and --logits-b go together", fix="pass both dumps, A = train side, B = infer side")
    sources = [name for name, given in (("rollouts", rollouts), ("dumps", logits_a)) if given]
    if len(sources) > 1:
        raise UserError(f"one token source at a time (got {' and '.join(sources)})",
                        fix="run verify-alignment once per source")
    if (infer_quant or per_layer or perturb) and sources:
        raise UserError("--infer-quant and --per-layer apply to the internal check only",
                        fix="drop them, or drop --rollouts/--logits-a")
    token_source = _token_source(rollouts, logits_a, logits_b, run, prompts_file, adapter, infer_quant, per_layer)
    if token_source in ("internal", "rollouts") and profile is None:
        raise UserError(f"the {token_source} check needs a PROFILE (the model to run)",
                        fix="orbitctl verify-alignment PROFILE ...")
    report = AlignmentReport(source={}, gates=[])
    if token_source == "internal":
        prompts = None
        if prompts_file:
            from orbitctl.data.prompts import read_jsonl

            prompts = [item.prompt for item in read_jsonl(prompts_file)][:alignment.num_prompts]
        from orbitctl.align.selfcheck import compare_internal

        result = compare_internal(profile, adapter=adapter, prompts=prompts, infer_quant=infer_quant,
                                  per_layer=per_layer, perturb=perturb,
                                  on_progress=(lambda d, t: on_progress("compare", d, t)) if on_progress else None)
        report.source, report.table, report.notes = result.describe(), result.table, list(result.notes)
        report.infer_token_logp, report.layers, report.floor = result.infer_token_logp, result.layers, result.floor
    elif token_source == "rollouts":
        temperature = DEFAULT_ENGINE_TEMPERATURE if engine_temperature is None else engine_temperature
        _from_rollouts(report, profile, rollouts, temperature, on_progress)
    elif token_source == "dumps":
        _from_dumps(report, alignment, logits_a, logits_b, on_progress)
    if report.table is not None:
        if report.table.n_tokens == 0:
            raise UserError("no tokens were compared", fix="check the prompts produce completions (rollout.max_new_tokens)")
        report.tokens = report.table.n_tokens
        report.summary = report.table.summary()
        report.gates += judge_tokens(report.summary, alignment)
    if run:
        _from_run(report, run, alignment)
    return report


def _from_run(report: AlignmentReport, run: str, alignment) -> None:
    from orbitctl.align.trends import entropy_stability, mismatch_trends
    from orbitctl.rundir import read_metrics

    records = read_metrics(run)
    source = str(RunDir(run).metrics)
    stability = entropy_stability(records, alignment.entropy_window, source=source)
    trends = mismatch_trends(records, source=source)
    report.run = {"dir": str(run), "steps": stability.steps, "entropy_window": stability.window,
                  "entropy_fluctuation": stability.worst_fluctuation, "worst_window": list(stability.worst_window),
                  "full_windows": stability.full_windows,
                  "mismatch_trends": [vars(t) for t in trends]}
    if not stability.full_windows:
        report.notes.append(f"the run logged {stability.steps} steps, fewer than alignment.entropy_window="
                            f"{stability.window}: entropy stability is judged on all of them")
    report.gates += judge_run(stability.worst_fluctuation, {t.metric: t.last for t in trends}, alignment)


def _from_dumps(report: AlignmentReport, alignment, path_a: str, path_b: str, on_progress) -> None:
    import torch

    from orbitctl.align.dumps import check_pair, iter_rows, open_dump
    from orbitctl.align.metrics import rows_per_chunk
    from orbitctl.align.tokens import TokenTable

    a, b = open_dump(path_a), open_dump(path_b)
    check_pair(a, b)
    table = TokenTable(k=min(alignment.top_k, a.vocab))
    rows = rows_per_chunk(a.vocab)
    infer_logp = []
    for (start, la, ids_a), (_, lb, ids_b) in zip(iter_rows(a, rows), iter_rows(b, rows)):
        ids = ids_a if ids_a is not None else ids_b
        table.add(la, lb, None if ids is None else ids.long())
        if ids is not None:
            infer_logp.append(torch.log_softmax(lb.double(), -1).gather(-1, ids.long()[:, None]).squeeze(-1))
        if on_progress:
            on_progress("compare", start + la.shape[0], a.n_tokens)
    report.source = {"source": "dumps", "train_side": str(a.path), "infer_side": str(b.path), "vocab": a.vocab,
                     "dtypes": [a.dtype, b.dtype], "token_ids": a.has_token_ids or b.has_token_ids}
    if not (a.has_token_ids or b.has_token_ids):
        report.notes.append("no token_ids in either dump: the sampled-token metrics (|dp|, |dlog p|, k3) are not computed")
    report.notes.append("logit dumps carry no model: the kernel floor is not measured (run the internal check on "
                        "the same machine for it)")
    report.table = table
    report.infer_token_logp = torch.cat(infer_logp) if infer_logp else None


def _from_rollouts(report: AlignmentReport, profile, path: str, temperature: float, on_progress) -> None:
    import torch

    from orbitctl.align.floor import floor_from_table
    from orbitctl.align.selfcheck import load_adapter_into, resolve_adapter
    from orbitctl.align.metrics import COARSE_GRAIN_NOTE
    from orbitctl.align.rollouts import read_rollouts, resolve_ids
    from orbitctl.align.tokens import TokenTable
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    completions = read_rollouts(path)  # a bad file fails before any model work
    split = load_prompts(profile.data, profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    adapter_dir = resolve_adapter(profile, None)
    if adapter_dir is not None:
        load_adapter_into(policy, adapter_dir, profile.adapter.kind)
    resolved = resolve_ids(completions, policy.tokenizer)
    sizes = [len(ids) for r in resolved for ids in r.top_ids]
    k_engine = min((n for n in sizes if n), default=0)
    if k_engine == 0:
        raise UserError(f"{path}: the engine returned no top_logprobs", fix="request top_logprobs (K >= 1)")
    skipped = sum(1 for n in sizes if n == 0)
    if skipped:
        report.notes.append(f"{skipped} of {len(sizes)} positions have no top_logprobs and are not compared")
    k = min(profile.alignment.top_k, k_engine)
    table, floor_table, infer_logp = TokenTable(k=k), TokenTable(k=k), []
    logit_absmax, compute_dtype = 0.0, "bfloat16"
    for i, r in enumerate(resolved):
        rows = [j for j, ids in enumerate(r.top_ids) if ids]
        if rows:
            prompt = torch.tensor([r.prompt_ids])
            completion = torch.tensor([r.completion_ids])
            with torch.no_grad():
                raw = policy.completion_logits(prompt, torch.ones_like(prompt), completion,
                                               torch.ones_like(completion), train=True)[0]
            compute_dtype = str(raw.dtype).removeprefix("torch.")
            logits = raw.float().cpu() / temperature
            # the floor: the trainer's own KV-cache decode (in the compute dtype, whatever rollout.kv_dtype says)
            # of the engine's tokens against its full forward
            own = policy.sample(prompt, torch.ones_like(prompt), max_new_tokens=0, temperature=temperature, top_p=1.0,
                                generator=None, keep_logits=True, forced=(completion, torch.ones_like(completion)),
                                kv_dtype="bf16")
            floor_table.add(logits[rows], own.logits[0, rows], completion[0, rows])
            logit_absmax = max(logit_absmax, float(logits[rows].abs().max()))
            width = max(len(r.top_ids[j]) for j in rows)
            top_ids = torch.full((len(rows), width), -1, dtype=torch.long)
            top_logp = torch.full((len(rows), width), float("-inf"), dtype=torch.float64)
            for n, j in enumerate(rows):
                top_ids[n, :len(r.top_ids[j])] = torch.tensor(r.top_ids[j], dtype=torch.long)
                top_logp[n, :len(r.top_logp[j])] = torch.tensor(r.top_logp[j], dtype=torch.float64)
            sampled_logp = torch.tensor([r.sampled_logp[j] for j in rows], dtype=torch.float64)
            table.add_topk(logits[rows], top_ids, top_logp, completion[0, rows], sampled_logp)
            infer_logp.append(sampled_logp)
        report.notes += r.notes
        if on_progress:
            on_progress("compare", i + 1, len(resolved))
    report.source = {"source": "rollouts", "file": str(path), "completions": len(resolved),
                     "engine_top_k": k_engine, "adapter": str(adapter_dir) if adapter_dir else "fresh (untrained)",
                     "engine_temperature": temperature}
    report.notes.append(COARSE_GRAIN_NOTE)
    report.table = table
    report.floor = floor_from_table(floor_table, compute_dtype=compute_dtype, logit_absmax=logit_absmax,
                                    measured_as="the trainer's weights decoded through the KV cache on the engine's "
                                                "tokens vs its full-sequence forward")
    report.infer_token_logp = torch.cat(infer_logp) if infer_logp else None
