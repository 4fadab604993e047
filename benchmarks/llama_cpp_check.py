"""llama.cpp reading `orbitctl export --format gguf` output, against orbitctl's train path; and the ISA of its build.

    make setup                                  # builds llama-cpp-python for the portable baseline (docs/export.md)
    .venv/bin/python benchmarks/llama_cpp_check.py [--prompts 16]
    .venv/bin/python benchmarks/llama_cpp_check.py --profile profiles/smollm2-135m-cpu.yaml \
        --adapter runs/smollm2-135m-cpu/adapter    # a real model and the adapter a run trained
    .venv/bin/python benchmarks/llama_cpp_check.py --isa [WHEEL|DIR|LIB.so]   # instructions beyond the baseline

With --profile and --adapter: that profile's base and that trained adapter, the same comparison. Without them:
builds the demo model with an INT4 g32 base (cached in ORBITCTL_CACHE), gives its LoRA seeded random
non-zero weights, saves that adapter, exports both to GGUF, and prints next-token distances
(log-softmax L1, JS, max |dlogit|, top-1) between llama.cpp and the train path: with the adapter
(llama.cpp's unmerged LoRA) and without it (the base alone, against the adapted train path), and the
floor they are judged against: llama.cpp's base against the train path with its adapters off.
llama.cpp runs in a child process: a llama.cpp that dies (SIGILL: a build for another CPU) is one
`Error:` line naming the signal and its cause, exit 2 (other signals: exit 1).

--isa disassembles llama.cpp's shared libraries (`objdump -d`, binutils) and counts, per library, the
instructions beyond the portable baseline the Makefile builds for (x86-64 with SSE4.2, AVX, AVX2, FMA,
F16C): AMX (tile instructions, %tmm), AVX-512 (EVEX-encoded, %zmm, %k mask registers), AVX-VNNI, BMI2;
and the baseline's own AVX2/FMA/F16C instructions, to show it was built for it. It prints JSON and exits 1
when a beyond-baseline instruction lies outside a function run-time dispatch guards (none here). Default
target: the installed llama_cpp package's lib/ (found without importing it); `make setup` runs it on
the freshly built wheel before it enters the wheelhouse (tests/test_native_isolation.py on the installed one).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

import yaml

from orbitctl.errors import EXIT_FAILED, OrbitError

ROOT = Path(__file__).resolve().parents[1]

# Instruction classes beyond the baseline. A build with GGML_NATIVE=OFF and no GGML_CPU_ALL_VARIANTS has no
# run-time dispatch in ggml-cpu (one variant, compiled for the flags; llama.cpp 0.3.36's sources carry no
# __attribute__((target)) / target_clones), so every class below must count 0.
BEYOND = ("amx", "avx512_evex", "avx512_zmm", "avx512_mask", "avx_vnni", "bmi2")
BASELINE = ("avx2_ymm", "fma", "f16c")
# functions allowed to hold beyond-baseline instructions because they run only after a run-time CPU check
# (function multiversioning, a cpuid-guarded kernel): none in this build. An entry: symbol -> why it is safe.
DISPATCHED: dict[str, str] = {}
AMX = re.compile(r"^(ldtilecfg|sttilecfg|tilerelease|tilezero|tileload\w*|tilestore\w*|tdp\w+|tcmm\w+|ttdp\w+|t2rpn\w*)$")
BMI2 = {"pdep", "pext", "shlx", "shrx", "sarx", "rorx", "bzhi", "mulx"}
VNNI = re.compile(r"^vpdp[bw]\w+$")  # vpdpbusd(s), vpdpwssd(s), AVX-VNNI-INT8/16: VEX-encoded
MASK = re.compile(r"%k[0-7]\b")
LEGACY_PREFIXES = {0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x66, 0x67, 0xF0, 0xF2, 0xF3}
SKIP_TOKENS = {"lock", "rep", "repz", "repe", "repnz", "repne", "notrack", "bnd", "data16", "data32", "addr32", "cs",
               "ds", "es", "ss", "fs", "gs", "xacquire", "xrelease"}
FUNCTION = re.compile(r"^[0-9a-f]+ <(?P<name>[^>@]+)(@[^>]*)?>:$")  # "<ggml_gemm_q4_K_8x8_q8_K@@Base>:"


def classify(raw: str, insn: str) -> set[str]:
    """The classes of one disassembled instruction: its encoding bytes (hex) and its AT&T text."""
    found = set()
    tokens = [t for t in insn.split() if t not in SKIP_TOKENS and not t.startswith(("{vex", "{evex", "rex"))]
    if not tokens:
        return found
    mnemonic, operands = tokens[0], " ".join(tokens[1:])
    codes = [int(b, 16) for b in raw.split()]
    while codes and codes[0] in LEGACY_PREFIXES:
        codes.pop(0)
    evex = bool(codes) and codes[0] == 0x62  # 0x62 opens an EVEX prefix in 64-bit mode (BOUND does not exist there)
    if AMX.match(mnemonic) or "%tmm" in operands:
        found.add("amx")
    if evex:
        found.add("avx512_evex")
    if "%zmm" in operands:
        found.add("avx512_zmm")
    if MASK.search(operands) or (mnemonic.startswith("k") and "%k" in operands):
        found.add("avx512_mask")
    if not evex and VNNI.match(mnemonic):
        found.add("avx_vnni")
    if mnemonic in BMI2:
        found.add("bmi2")
    if not evex:
        if "%ymm" in operands:
            found.add("avx2_ymm")
        if mnemonic.startswith(("vfmadd", "vfmsub", "vfnmadd", "vfnmsub")):
            found.add("fma")
        if mnemonic in ("vcvtph2ps", "vcvtps2ph"):
            found.add("f16c")
    return found


def scan_library(path: Path) -> dict:
    """Counts of each class in one shared library's code, and the functions holding beyond-baseline ones."""
    objdump = shutil.which("objdump")
    if objdump is None:
        raise OrbitError("objdump not found: the ISA check disassembles llama.cpp's libraries",
                         fix="install binutils (apt-get install binutils); a machine that compiles llama.cpp has it")
    proc = subprocess.run([objdump, "-d", "--insn-width=16", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise OrbitError(f"objdump could not read {path}: {proc.stderr.strip()[:300]}")
    counts: Counter = Counter()
    functions: dict[str, Counter] = {}
    current = "?"
    for line in proc.stdout.splitlines():
        head = FUNCTION.match(line)
        if head:
            current = head["name"]
            continue
        parts = line.split("\t")
        if len(parts) < 3 or not parts[0].strip().endswith(":"):
            continue
        counts["instructions"] += 1
        if parts[2].strip() == "(bad)":
            counts["undecoded"] += 1
        for cls in classify(parts[1], parts[2]):
            counts[cls] += 1
            if cls in BEYOND:
                functions.setdefault(current, Counter())[cls] += 1
    return {"counts": {k: counts[k] for k in ("instructions", *BEYOND, *BASELINE, "undecoded")},
            "functions": {name: dict(c) for name, c in sorted(functions.items(), key=lambda kv: -sum(kv[1].values()))}}


def llama_cpp_lib_dir() -> Path | None:
    """The installed llama_cpp package's lib/ directory, found without importing the package (its import loads it)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def _libraries(target: Path, work: Path) -> list[Path]:
    if target.suffix == ".whl":
        with zipfile.ZipFile(target) as wheel:
            names = [n for n in wheel.namelist() if re.search(r"/lib[^/]*\.so(\.[\d.]+)?$", n)]
            for name in names:
                wheel.extract(name, work)
        return sorted(work / n for n in names)
    if target.is_dir():
        return sorted(p for p in target.rglob("lib*.so*") if p.is_file() and re.search(r"\.so(\.[\d.]+)?$", p.name))
    return [target]


def scan(target: Path) -> dict:
    """Every distinct shared library under ``target`` (a wheel, a directory, one library): its classes' counts,
    the beyond-baseline instructions outside :data:`DISPATCHED` functions (``forbidden``), and the totals."""
    if not target.exists():
        raise OrbitError(f"{target}: no such wheel, directory or library")
    with tempfile.TemporaryDirectory(prefix="llama-isa-") as work:
        libs = _libraries(target, Path(work))
        if not libs:
            raise OrbitError(f"{target}: no shared library (lib*.so) in it")
        seen: dict[str, str] = {}
        result: dict = {"target": str(target), "libraries": {}, "total": Counter(), "forbidden": {}}
        for lib in sorted(libs, key=lambda p: (len(p.name), p.name)):
            digest = hashlib.sha256(lib.read_bytes()).hexdigest()
            if digest in seen:  # libggml-cpu.so, .so.0 and .so.0.x.y are copies of one file in the wheel
                continue
            seen[digest] = lib.name
            one = scan_library(lib)
            result["libraries"][lib.name] = one
            result["total"].update(one["counts"])
            for function, classes in one["functions"].items():
                if function not in DISPATCHED:
                    result["forbidden"].setdefault(lib.name, {})[function] = classes
        result["total"] = dict(result["total"])
    return result


def isa_main(target: str | None) -> int:
    path = Path(target) if target else llama_cpp_lib_dir()
    if path is None:
        raise OrbitError("llama_cpp is not installed: nothing to check", fix="`make setup` builds and installs it")
    result = scan(path)
    for one in result["libraries"].values():  # the JSON stays short: the first functions of each library
        one["functions"] = dict(list(one["functions"].items())[:12])
    print(json.dumps(result, indent=2))
    if result["forbidden"]:
        where = "; ".join(f"{lib}: {', '.join(list(fns)[:5])}" for lib, fns in result["forbidden"].items())
        print(f"Error: instructions beyond the baseline (x86-64 + AVX2, FMA, F16C) in {path}: {where}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--isa", nargs="?", const="", metavar="WHEEL|DIR|LIB",
                        help="disassemble llama.cpp's libraries and count instructions beyond the baseline (default: "
                             "the installed llama_cpp)")
    parser.add_argument("--profile", help="a profile whose base to export (default: the demo with an INT4 base)")
    parser.add_argument("--adapter", help="with --profile: the trained adapter directory to export and compare")
    args = parser.parse_args()
    if args.isa is not None:
        return isa_main(args.isa or None)
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
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OrbitError as exc:  # a crashed llama.cpp (NativeCrash), a missing objdump: one line, the CLI's exit codes
        if os.environ.get("ORBITCTL_DEBUG", "") not in ("", "0"):
            raise
        print(f"Error: {exc.render()}", file=sys.stderr)
        sys.exit(exc.exit_code)
