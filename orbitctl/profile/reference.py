"""Render the profile schema as Markdown: the schema is the documentation (docs/profiles.md).

    python -m orbitctl.profile.reference > docs/profiles.md
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from orbitctl.profile.schema import Profile, describe_fields

HEADER = """# Profile reference

Every command reads the same YAML profile. Unknown keys are errors, every value is checked
against the bounds below, and every problem in a file is reported at once as
`FILE: key.path: message (got VALUE)` (exit code 2). Override any value on the command line
with `--set key.path=value` (repeatable). `orbitctl profile show PROFILE` prints the resolved
profile with every default and the derived values (world size, global batch, usable memory).

This page is generated from `orbitctl/profile/schema.py` and `orbitctl/profile/gpus.py` by
`python -m orbitctl.profile.reference > docs/profiles.md`; a test keeps it in step.

## A profile for your model: `orbitctl profile init`

    orbitctl profile init /models/Qwen2.5-7B-Instruct --gpu h100 --gpus 8 --data data/gsm8k_train.jsonl --out qwen7b.yaml

MODEL is a local Hugging Face checkpoint directory, its `config.json`, a GGUF file or
`pkg:PACKAGE/PATH`; a Hub id (`org/name`) is refused with the `hf download` command to run first
(orbitctl does not download). The profile written is one `orbitctl plan` says fits, each chosen value
with its reason beside it (`orbitctl/plan/profile_init.py`): `adapter.rank`, the largest of 64, 32,
16, 8 whose trainable parameters stay within 1% of the model's; one GPU trains with plain AdamW, several
with ZeRO-3, a mixture-of-experts model with its routed experts split over the ranks
(`memory.expert_parallel`); `quant.format`, the first of FP8, INT4 (fused kernel), INT4 (dequantized
per matmul), NF4 whose largest fitting micro-batch reaches 4, else the one that fits most (optimizer
state and activations go to host RAM when nothing else fits one sequence); `memory.micro_batch_size`,
the plan's largest, a power of two up to 8, with the accumulation train derives from 32 prompts x 8
completions; `rollout.batch_size`, the plan's `auto` number. An existing `--out` file is refused;
`--json` prints the choices and the verdict. Then `orbitctl plan FILE` and `orbitctl train FILE
--dry-run`, which refuses a `model.path`, `model.quantized_path` or data file that is not there.

## Figures in the shipped profiles' comments

A shipped profile's comments state the plan's figures in the plan's own words, and
`tests/plan/test_profile_comments.py` recomputes each one, so a comment cannot drift from what
`orbitctl plan` prints: `peak 125.5 GiB per GPU in rollout`, `step 26 min (rollout 17 min, update 10 min)`,
`largest micro-batch that fits: 4`, a layouts row (`EP 8, dense replicated  23 TiB, >= 56 s, max mb 4,
step 26 min`), a memory component by its name in the plan's table (`routed_experts 66.4 GiB`, or
`... GiB in rollout` for another phase than the peak's), `auto: 36 sequences` (`rollout.batch_size: auto`),
`408.3 M trainable`, `4 rollout rounds`; and a what-if, ``with `--set KEY=VALUE`: ...``, whose claims (up
to the next `;` or `)`, `fits` and `does not fit` among them) are about the plan with those values set. A
figure agrees when the plan's value, rounded to the comment's decimals, is the comment's number. In the
GPU profiles every step time, link time and TiB figure is such a claim.
"""


def markdown() -> str:
    describe_fields()
    lines = [HEADER, *_gpu_catalog()]
    top = Profile.model_fields
    lines.append("## Top level\n")
    lines.append("| key | type | default | meaning |\n|---|---|---|---|")
    lines.append(_row("name", top["name"]))
    for name, field in top.items():
        model = _submodel(field.annotation)
        if model is None:
            continue
        lines.append(f"| `{name}` | section | | {field.description or ''} |")
    for name, field in top.items():
        model = _submodel(field.annotation)
        if model is not None:
            lines.extend(_section(name, model))
    return "\n".join(lines) + "\n"


def _gpu_catalog() -> list[str]:
    """The cards ``hardware.gpu`` names, with what the plan budgets and times from."""
    from orbitctl.profile.gpus import GPUS

    out = ["## GPU catalog (`hardware.gpu`)\n",
           "The memory is what the driver exposes (a little under the card's as sold); bandwidth, dense BF16 "
           "throughput and the peer link (per GPU, both directions) are the vendor datasheets', cited per entry "
           "in `orbitctl/profile/gpus.py`. A name never stands for a card with other memory (`a100` is refused: "
           "40 or 80 GB). For a card not listed, set `hardware.gpu` to the listed card closest in BF16 TFLOPS "
           "and memory bandwidth and `hardware.gpu_memory_gib` to its memory.\n",
           "| `hardware.gpu` | card | memory GiB | memory GB/s | BF16 TFLOPS | peer GB/s | also named |",
           "|---|---|---|---|---|---|---|"]
    for spec in GPUS.values():
        aliases = ", ".join(f"`{a}`" for a in spec.aliases)
        out.append(f"| `{spec.name}` | {spec.marketing} | {spec.visible_bytes / 2**30:.1f} | {spec.hbm_bandwidth_gbs:g} | "
                   f"{spec.bf16_tflops:g} | {spec.p2p_bandwidth_gbs:g} | {aliases} |")
    out.append("")
    return out


def _section(prefix: str, model: type[BaseModel]) -> list[str]:
    out = [f"\n## `{prefix}`\n", "| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is not None:
            nested.append((f"{prefix}.{name}", sub))
            out.append(f"| `{prefix}.{name}` | section | | {field.description or ''} |")
        else:
            out.append(_row(f"{prefix}.{name}", field))
    for name, sub in nested:
        out.extend(_section(name, sub))
    return out


def _row(key: str, field: Any) -> str:
    default = field.default
    if default is PydanticUndefined:
        default = field.default_factory() if field.default_factory else "required"
    bounds = [f"{m.__class__.__name__.lower()} {getattr(m, m.__class__.__name__.lower(), '')}"
              for m in field.metadata if m.__class__.__name__ in ("Ge", "Gt", "Le", "Lt")]
    kind = _type_name(field.annotation) + (f" ({', '.join(bounds)})" if bounds else "")
    doc = (field.description or "").replace("|", "\\|")
    return f"| `{key}` | {kind} | `{default!r}` | {doc} |".replace("`None`", "unset")


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation) if a is not type(None))
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    return getattr(annotation, "__name__", str(annotation))


def _submodel(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


if __name__ == "__main__":
    print(markdown(), end="")
