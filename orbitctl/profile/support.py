"""What each command carries out of a profile, and one refusal for what it would only pretend to.

`orbitctl plan` models every value of the schema. `train`, and the checks of `verify-alignment`
that run the profile's model, build only part of it; a value they would silently ignore is
refused here, before any data, model or process group is touched, naming the key, its value
and what to set instead. The same goes for a quant value given on the command line that the
chosen format has no use for.

    from orbitctl.profile.support import refuse_unsupported, unsupported_for
    unsupported_for("train", profile)        # [Unsupported(key, value, why, fix), ...]
    refuse_unsupported(profile, "train")     # raises UserError listing them
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from orbitctl.errors import UserError
from orbitctl.rundir import read_json_or_none

TRAIN = "train"
VERIFY_INTERNAL = "verify-alignment"
VERIFY_ROLLOUTS = "verify-alignment --rollouts"
QUANTIZE = "quantize"
EVAL = "eval"
EVAL_EPISODES = "eval --suite env:NAME"
"""eval playing an environment's held-out episodes: multi-turn by design, so the single-completion rules stay off."""
SERVE = "serve"
COMMANDS = (TRAIN, VERIFY_INTERNAL, VERIFY_ROLLOUTS, QUANTIZE, EVAL, EVAL_EPISODES, SERVE)
_MODEL_RUNNING = (TRAIN, VERIFY_INTERNAL, VERIFY_ROLLOUTS, EVAL, EVAL_EPISODES, SERVE)
_SAMPLING = (EVAL, SERVE)
"""Commands that sample from orbitctl's own infer path, one completion per prompt."""


class Unsupported(NamedTuple):
    key: str
    value: Any
    why: str
    fix: str

    def render(self) -> str:
        return f"{self.key}: {show_value(self.value)} {self.why}; {self.fix}"


class _Rule(NamedTuple):
    key: str
    commands: tuple[str, ...]
    ignored: Callable[[Any, Any], bool]
    """(value, profile) -> True when the command would not carry the value out."""
    why: str
    fix: str


_PLAN_MODELS_IT = "plan still models it"

_RULES: tuple[_Rule, ...] = (
    _Rule("rollout.engine", (TRAIN,), lambda v, p: v == "separate",
          "is not built by train: rollouts are sampled from the trainer's own weights (the shared engine)",
          f"set rollout.engine: shared for train; {_PLAN_MODELS_IT}"),
    _Rule("rollout.engine", (VERIFY_INTERNAL,), lambda v, p: v != "shared",
          "is not what the internal check compares: it runs orbitctl's own infer path, not a separate engine",
          "compare the engine's own output with --rollouts FILE, or set rollout.engine: shared"),
    _Rule("rollout.engine_tp", (TRAIN,), lambda v, p: v != 1,
          "sizes a separate rollout engine, which train does not build",
          f"set rollout.engine_tp: 1 for train; {_PLAN_MODELS_IT}"),
    _Rule("rollout.engine_sleep", (TRAIN,), lambda v, p: v is not True and p.rollout.engine != "http",
          "tells a separate rollout engine to keep its weights during updates; train has no separate engine",
          f"set rollout.engine_sleep: true for train; {_PLAN_MODELS_IT}"),
    _Rule("rollout.engine_sleep", (TRAIN,), lambda v, p: v is True and p.rollout.engine == "http",
          "asks the http engine to release its memory during updates, and train sends it no sleep call "
          "(orbitctl serve has none; an attached engine is left as it runs)",
          "set rollout.engine_sleep: false with rollout.engine: http"),
    _Rule("rollout.kv_dtype", (TRAIN,), lambda v, p: v != "bf16" and p.rollout.engine == "http"
          and p.rollout.engine_url is not None,
          "is the attached engine's own setting: train does not choose the KV cache of the engine at "
          "rollout.engine_url",
          "start that engine with its fp8 KV option (vLLM --kv-cache-dtype fp8) and set rollout.kv_dtype: bf16, "
          "or unset rollout.engine_url so train starts orbitctl serve with this profile"),
    _Rule("data.train", (TRAIN,), lambda v, p: str(v).startswith("env:") and p.rollout.engine == "http",
          "is an environment, and its episodes are played on the trainer's own infer path, not on the http engine",
          "set rollout.engine: shared for an environment, or data.train to prompts"),
    _Rule("data.train", (VERIFY_INTERNAL, *_SAMPLING), lambda v, p: str(v).startswith("env:"),
          "is an environment, and this command works on prompts, not on episodes",
          "set data.train to a prompt file or builtin:NAME for this command; "
          "verify-alignment --run RUN_DIR reads an episode run's metrics"),
    _Rule("rollout.max_turns", (VERIFY_INTERNAL, *_SAMPLING), lambda v, p: v != 1,
          "plays episodes of several turns, and this command samples single completions",
          "set rollout.max_turns: 1 for this command; verify-alignment --run RUN_DIR reads an episode run's "
          "metrics"),
    _Rule("rollout.engine", (EVAL, EVAL_EPISODES), lambda v, p: v != "shared",
          "is not what this command samples from: it runs orbitctl's own infer path",
          "set rollout.engine: shared, or grade the engine's own output with orbitctl eval --completions FILE"),
    _Rule("rollout.engine", (SERVE,), lambda v, p: v == "separate",
          "is not what this command samples from: it runs orbitctl's own infer path",
          "set rollout.engine: shared, or grade the engine's own output with orbitctl eval --completions FILE"),
    _Rule("memory.expert_parallel", (TRAIN,), lambda v, p: v != 1 and p.quant.format not in ("int4", "fp8"),
          "splits the routed experts over ranks only when orbitctl loads them: quant.format int4 or fp8 "
          "(nf4/fp4 keep transformers' fused bf16 experts)",
          "set quant.format: int4 (or fp8), or memory.expert_parallel: 1"),
    _Rule("memory.expert_parallel", (TRAIN,), lambda v, p: v != 1 and p.adapter.targets in ("all-linear", "attention+mlp"),
          "splits the routed experts over ranks, and adapters on them would be averaged across ranks that hold "
          "different experts",
          "set adapter.targets: attention+shared (or attention), or memory.expert_parallel: 1"),
    _Rule("adapter.experts", (TRAIN,), lambda v, p: v != "none" and p.quant.format not in ("int4", "fp8"),
          "adapts the routed experts orbitctl loads itself: quant.format int4 or fp8 (nf4/fp4 keep transformers' "
          "fused bf16 experts)",
          "set quant.format: int4 (or fp8), or adapter.experts: none"),
    _Rule("memory.prefetch_layers", (TRAIN,), lambda v, p: v != 1 and p.memory.zero_stage != 3,
          "sets how many layers ZeRO-3 gathers ahead, and with memory.zero_stage below 3 no parameter is gathered",
          "set memory.zero_stage: 3, or memory.prefetch_layers: 1 (the default)"),
    _Rule("quant.kernel", _MODEL_RUNNING, lambda v, p: v == "fused" and _vendor(p) not in ("cpu", "nvidia"),
          "runs PyTorch's weight-only INT4 kernels, which exist for the CPU and NVIDIA GPUs, and this profile runs on "
          "another GPU, where the INT4 layers dequantize",
          "set quant.kernel: auto or dequantize"),
    _Rule("rollout.decode_graphs", _MODEL_RUNNING, lambda v, p: v is True and _vendor(p) == "cpu",
          "replays the decode step from a CUDA graph, and this profile runs on the CPU, which decodes eagerly",
          "set rollout.decode_graphs: auto or false"),
    _Rule("rollout.decode_graphs", _MODEL_RUNNING, lambda v, p: v is True and p.rollout.kv_dtype != "bf16",
          "decodes on a static KV cache in the compute dtype, and rollout.kv_dtype fp8 grows a float8 cache per step",
          "set rollout.kv_dtype: bf16, or rollout.decode_graphs: auto (eager decode with the fp8 cache)"),
    _Rule("rollout.continuous_batching", _MODEL_RUNNING, lambda v, p: v is True and p.rollout.decode_graphs is True,
          "refills a finished sequence's slot with a waiting one, and rollout.decode_graphs true replays fixed rows "
          "from a CUDA graph",
          "set rollout.decode_graphs: auto or false (auto decodes eagerly with continuous batching), or "
          "rollout.continuous_batching: auto"),
    _Rule("rollout.continuous_batching", (TRAIN,), lambda v, p: v is True and (
        p.rollout.engine == "http" or str(p.data.train).startswith("env:")),
          "streams orbitctl's own single-turn rollout, and this profile samples through an http engine (which batches "
          "its own requests) or a multi-turn environment (turn by turn)",
          "set rollout.continuous_batching: auto"),
    _Rule("rl.router_replay", (TRAIN, VERIFY_INTERNAL), lambda v, p: v is True and not _is_moe(p),
          "replays the experts a mixture-of-experts model routed each token to, and this model has no routed experts",
          "set rl.router_replay: false"),
    _Rule("rl.router_replay", (TRAIN,), lambda v, p: v is True and p.rollout.engine == "http"
          and p.rollout.engine_api == "vllm",
          "replays the experts the rollout engine routed each token to, and vLLM's completions return none",
          "set rollout.engine_api: sglang (orbitctl serve, or SGLang started with --enable-return-routed-experts, "
          "returns them), or rl.router_replay: false"),
    _Rule("rl.router_replay", (TRAIN,), lambda v, p: v is True and (str(p.data.train).startswith("env:")
                                                                    or p.rollout.max_turns != 1),
          "replays the routing recorded for single completions, and an environment's episodes record none",
          "set rl.router_replay: false for an environment"),
    _Rule("model.dtype", (TRAIN,),
          lambda v, p: "dtype" in p.model.model_fields_set and p.quant.compute_dtype != "auto"
          and v != p.quant.compute_dtype,
          "is not what train loads: every weight that is not quantized is loaded in quant.compute_dtype",
          "set model.dtype to quant.compute_dtype's value, or drop it; plan then models what train loads"),
)

# Quant settings a format fixes whatever is asked for (None: the format uses none of them).
_FIXED_BY_FORMAT: dict[str, dict[str, Any]] = {
    "fp8": {"group_size": 128, "double_quant": False, "storage_dtype": "bf16"},
    "int4": {"double_quant": False, "storage_dtype": "bf16"},
    "none": {"group_size": None, "double_quant": None, "storage_dtype": None, "modules": None, "skip": None},
}
_WHY_FIXED = {
    "fp8": "fp8 always stores float8 weights with one fp32 scale per 128x128 block",
    "int4": "int4 packs the weights into int32 with one bf16 scale per group and quantizes nothing twice",
    "none": "format none quantizes nothing",
}
QUANT_FIELDS = ("format", "group_size", "double_quant", "compute_dtype", "storage_dtype", "modules", "skip")
LOGGER_MODULES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),
}
"""The modules each ``run.loggers`` entry imports: TensorBoard's event writer needs the tensorboard package, MLflow's
local SQLite store SQLAlchemy and Alembic beside mlflow (or mlflow-skinny)."""


def show_value(value: Any) -> str:
    """A value as it is written in YAML: true, 32, fp8, [lm_head, mtp]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    return str(value)


def given_keys(overrides: Iterable[str]) -> list[str]:
    """The dotted keys of ``KEY.PATH=VALUE`` overrides, in order."""
    return [item.split("=", 1)[0].strip() for item in overrides]


def refuse_overrides_outside(overrides: Iterable[str], allowed: Iterable[str], where: str, fix: str) -> None:
    """Refuse every ``--set`` whose key is not under one of the ``allowed`` dotted prefixes."""
    allowed = tuple(allowed)
    stray = [key for key in given_keys(overrides)
             if not any(key == a or key.startswith(a + ".") for a in allowed)]
    if stray:
        keys = ", ".join(f"--set {k}" for k in stray)
        raise UserError(f"{keys}: {where} reads only {', '.join(a + ('' if '.' in a else '.*') for a in allowed)}",
                        fix=fix)


def effective_quant(quant) -> dict[str, Any]:
    """The quant settings a conversion in ``quant.format`` actually uses (what its manifest records)."""
    values = {name: getattr(quant, name) for name in QUANT_FIELDS if name != "compute_dtype"}
    values["skip"] = list(values["skip"])
    for name, fixed in _FIXED_BY_FORMAT.get(quant.format, {}).items():
        if fixed is not None:
            values[name] = fixed
    return values


def moot_quant_keys(quant, given: Mapping[str, str]) -> list[Unsupported]:
    """Quant values given on the command line (``given``: field -> how it was given) that
    ``quant.format`` would ignore."""
    fixed = _FIXED_BY_FORMAT.get(quant.format, {})
    found = []
    for name, label in given.items():
        if name not in fixed:
            continue
        value = getattr(quant, name)
        if fixed[name] is None or _normal(value) != _normal(fixed[name]):
            found.append(Unsupported(label, value, f"is ignored with quant.format {quant.format} "
                                                   f"({_WHY_FIXED[quant.format]})", f"drop {label}"))
    return found


def _normal(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def unsupported_for(command: str, profile, given: Iterable[str] = ()) -> list[Unsupported]:
    """Every value of ``profile`` that ``command`` would silently not carry out.

    ``given``: the dotted keys set on the command line (``--set``); a quant value among them that
    the format fixes anyway is reported too.
    """
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; one of {', '.join(COMMANDS)}")
    found = [Unsupported(rule.key, _lookup(profile, rule.key), rule.why, rule.fix)
             for rule in _RULES if command in rule.commands and rule.ignored(_lookup(profile, rule.key), profile)]
    given_quant = {}
    for key in given:
        if key == "quant":  # a whole section: the keys its mapping holds
            given_quant.update({name: f"quant.{name}" for name in profile.quant.model_fields_set})
        elif key.startswith("quant."):
            name = key.split(".", 1)[1]
            given_quant[name] = key
    found += moot_quant_keys(profile.quant, given_quant)
    if command in _MODEL_RUNNING:
        found += _base_mismatch(profile)
    if command == TRAIN:
        found += _missing_loggers(profile.run.loggers)
    return found


def refuse_unsupported(profile, command: str, given: Iterable[str] = ()) -> None:
    """Raise one UserError (exit 2) naming every value ``command`` would ignore; a no-op when none."""
    found = unsupported_for(command, profile, given)
    if not found:
        return
    if len(found) == 1:
        only = found[0]
        raise UserError(f"{only.key}: {show_value(only.value)} {only.why}", fix=only.fix[:1].upper() + only.fix[1:])
    raise UserError("\n".join(item.render() for item in found))


def _vendor(p) -> str:
    from orbitctl.profile.gpus import resolve_gpu

    return resolve_gpu(p.hardware.gpu).vendor


def _is_moe(profile) -> bool:
    """Whether the profile's model has routed experts (True when its architecture cannot be read here: the command
    that loads it reports that itself)."""
    from orbitctl.arch import model_arch

    try:
        return model_arch(profile.model).is_moe
    except Exception:  # noqa: BLE001 - an unreadable model is reported by the command that loads it
        return True


def _lookup(profile, key: str) -> Any:
    node = profile
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported here, found without importing it."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _missing_loggers(loggers: list[str]) -> list[Unsupported]:
    """One refusal per ``run.loggers`` entry whose package is not installed, naming the package."""
    found = []
    for name in loggers:
        missing = [module for module in LOGGER_MODULES[name] if not _installed(module)]
        if missing:
            what = f"the package {missing[0]} is" if len(missing) == 1 else f"the packages {', '.join(missing)} are"
            pronoun = "it" if len(missing) == 1 else "them"
            found.append(Unsupported("run.loggers", loggers, f"sends the step metrics to {name}, and {what} not installed",
                                     f"install {pronoun} (pip install 'orbitctl[loggers]'), or remove {name} from "
                                     "run.loggers"))
    return found


def _base_mismatch(profile) -> list[Unsupported]:
    """Quant values that differ from how ``model.quantized_path`` was written (it is used as is)."""
    path = profile.model.quantized_path
    if not path:
        return []
    manifest = read_json_or_none(Path(path) / "quant_manifest.json")
    options = manifest.get("options") if isinstance(manifest, dict) else None
    if not isinstance(options, dict) or "fmt" not in options:
        return []
    want = effective_quant(profile.quant)
    have = {"format": options.get("fmt"), **{k: options.get(k) for k in want if k != "format"}}
    names = ["format"] if want["format"] != have["format"] or want["format"] == "none" else list(want)
    found = []
    for name in names:
        if have[name] is None and name != "format" or _normal(have[name]) == want[name]:
            continue
        found.append(Unsupported(
            f"quant.{name}", getattr(profile.quant, name),
            f"is not what model.quantized_path holds ({path} was quantized with {name} {show_value(have[name])}, "
            f"and it is used as is)",
            f"set quant.{name}: {show_value(have[name])}, or quantize into a new model.quantized_path "
            f"(orbitctl quantize PROFILE)"))
    return found
