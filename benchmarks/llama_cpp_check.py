"""llama.cpp reading `orbitctl export --format gguf` output, against orbitctl's train path.

    .venv/bin/pip install llama-cpp-python      # builds llama.cpp from source (CMake)
    .venv/bin/python benchmarks/llama_cpp_check.py [--prompts 16]
    .venv/bin/python benchmarks/llama_cpp_check.py --profile profiles/smollm2-135m-cpu.yaml \
        --adapter runs/smollm2-135m-cpu/adapter    # a real model and the adapter a run trained

With --profile and --adapter: that profile's base and that trained adapter, the same comparison. Without them:
builds the demo model with an INT4 g32 base (cached in ORBITCTL_CACHE), gives its LoRA seeded random
non-zero weights, saves that adapter, exports both to GGUF, and prints next-token distances
(log-softmax L1, JS, max |dlogit|, top-1) between llama.cpp and the train path: with the adapter
(llama.cpp's unmerged LoRA) and without it (the base alone, against the adapted train path), and the
floor they are judged against: llama.cpp's base against the train path with its adapters off.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--profile", help="a profile whose base to export (default: the demo with an INT4 base)")
    parser.add_argument("--adapter", help="with --profile: the trained adapter directory to export and compare")
    args = parser.parse_args()
    if bool(args.profile) != bool(args.adapter):
        parser.error("--profile and --adapter go together")
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.export.api import export
    from orbitctl.export.compare import held_out_sequences
    from orbitctl.export.llamacpp import llama_cpp_agreement
    from orbitctl.model.adapters import load_adapter_weights, randomize_adapters, save_adapter
    from orbitctl.profile import load_profile

    work = Path(tempfile.mkdtemp(prefix="llama-cpp-check-"))
    if args.profile:
        profile_path, adapter = Path(args.profile), Path(args.adapter)
    else:
        data = yaml.safe_load((ROOT / "profiles" / "tiny-cpu.yaml").read_text())
        data["quant"].update({"format": "int4", "group_size": 32, "compute_dtype": "fp32"})
        profile_path, adapter = work / "tiny-int4.yaml", work / "adapter"
        profile_path.write_text(yaml.safe_dump(data))
    profile = load_profile(str(profile_path))
    policy = load_policy(profile, prepare_frozen_base(profile, load_prompts(profile.data, profile.run.seed).warm_task),
                         device="cpu")
    if args.adapter:
        load_adapter_weights(policy.model, adapter, "lora")
    else:
        randomize_adapters(policy.model, seed=7, std=0.15)
        save_adapter(policy.model, adapter, "lora", policy.hidden_size)
    result = export(str(profile_path), str(work / "gguf"), "gguf", adapter=str(adapter))
    seqs = held_out_sequences(profile, policy, args.prompts)
    agreement = llama_cpp_agreement(policy, seqs, work / "gguf" / "model.gguf", work / "gguf" / "adapter.gguf")
    # the floor: the same integers on both sides, adapters off; only the kernels differ
    figures = {"floor_base_vs_base": agreement["floor"], "with_adapter": agreement["with_adapter"],
               "without_adapter": agreement["without_adapter"], "counts": result.counts}
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
