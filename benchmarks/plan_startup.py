"""How long `orbitctl plan PROFILE --json` takes as a whole process, against the import floor.

    .venv/bin/python benchmarks/plan_startup.py                 # 5 runs each: median, min, max, ratio
    .venv/bin/python benchmarks/plan_startup.py --runs 9 --json
    .venv/bin/python benchmarks/plan_startup.py --where          # where the time goes
    .venv/bin/python benchmarks/plan_startup.py --bytecode       # with orbitctl's bytecode cached, as installed

The floor is ``python -c "import typer, rich, pydantic, yaml"`` with the same interpreter: what
any command of this CLI pays before it does anything. The ratio is the plan's median over the
floor's. The model floor, timed alongside, is the floor plus one one-field pydantic model built and
validated: the least a command that validates its input with pydantic models can cost (pydantic's
model machinery and its plugin scan); the plan's median over it is printed too. Without ``--bytecode`` the
orbitctl modules whose ``__pycache__`` holds current bytecode are read from it, the others compiled: a clean
clone under ``PYTHONDONTWRITEBYTECODE=1`` compiles them all on every run. ``--where`` prints the heaviest imports of the plan process
(``python -X importtime``, by cumulative time) and a cProfile top 20 of the in-process part: load
the profile, plan, render. ``--bytecode`` times them with bytecode written and read
(``PYTHONDONTWRITEBYTECODE`` unset, a temporary ``PYTHONPYCACHEPREFIX``, one warm-up run each):
where the environment sets ``PYTHONDONTWRITEBYTECODE=1``, the plan compiles every orbitctl module
it imports on every run, while the floor's site-packages come compiled. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = ROOT / "profiles" / "kimi-k2_grpo_int4_8xb200.yaml"
FLOOR_CODE = "import typer, rich, pydantic, yaml"
MODEL_FLOOR_CODE = FLOOR_CODE + "\nfrom pydantic import BaseModel\nclass M(BaseModel):\n    x: int = 1\nM(x=2)"
"""The floor and one trivial pydantic model: the lower bound of a process that validates with pydantic."""
ENV_SHOWN = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")
"""Environment variables the figures depend on (or should not), printed with them."""


def orbitctl_entry() -> str:
    """The ``orbitctl`` script next to this interpreter (the venv's), so both commands use one Python."""
    return str(Path(sys.executable).with_name("orbitctl"))


def commands(profile: Path) -> dict[str, list[str]]:
    """The timed commands: the plan, the import floor and the model floor."""
    return {"plan": [orbitctl_entry(), "plan", str(profile), "--json"],
            "floor": [sys.executable, "-c", FLOOR_CODE],
            "model": [sys.executable, "-c", MODEL_FLOOR_CODE]}


def run_once(argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one whole process, start to exit; the CPU seconds (user + system) are less
    disturbed by other work on the machine. Fails loudly unless it exits 0 or 1 (plan: fits or not)."""
    cpu_before = _children_cpu()
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return elapsed, _children_cpu() - cpu_before


def _children_cpu() -> float:
    """User + system seconds of this process's finished children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cache_bytecode(profile: Path) -> None:
    """Let the commands write and read bytecode in a fresh cache directory, filled by one run of each."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="plan_startup_pyc_")
    for argv in commands(profile).values():
        run_once(argv)


def summary(times: list[float]) -> dict[str, float]:
    """Median, min and max of one command's wall seconds."""
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def measure(profile: Path, runs: int) -> dict:
    """Every command ``runs`` times, interleaved (so a slow spell of the machine hits them alike)."""
    argvs = commands(profile)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in argvs}
    for _ in range(runs):
        for name, argv in argvs.items():
            times[name].append(run_once(argv))
    doc = {"profile": str(profile), "runs": runs, "python": sys.executable,
           "env": {k: os.environ[k] for k in ENV_SHOWN if k in os.environ}}
    for name, pairs in times.items():
        wall, cpu = [w for w, _ in pairs], [c for _, c in pairs]
        doc[name] = {**summary(wall), "times_s": wall, "cpu_median_s": statistics.median(cpu)}
    doc["ratio"] = doc["plan"]["median_s"] / doc["floor"]["median_s"]
    doc["cpu_ratio"] = doc["plan"]["cpu_median_s"] / doc["floor"]["cpu_median_s"]
    doc["model_ratio"] = doc["model"]["median_s"] / doc["floor"]["median_s"]
    doc["model_cpu_ratio"] = doc["model"]["cpu_median_s"] / doc["floor"]["cpu_median_s"]
    doc["plan_over_model"] = doc["plan"]["median_s"] / doc["model"]["median_s"]
    doc["plan_over_model_cpu"] = doc["plan"]["cpu_median_s"] / doc["model"]["cpu_median_s"]
    return doc


def print_measurement(doc: dict) -> None:
    """The figures of ``measure`` as seven lines."""
    env = ", ".join(f"{k}={v}" for k, v in doc["env"].items()) or "none of " + ", ".join(ENV_SHOWN)
    print(f"{doc['runs']} runs each, {doc['profile']} (env: {env})")
    for name in ("plan", "floor", "model"):
        s = doc[name]
        print(f"  {name:5}  median {s['median_s']:.3f} s  min {s['min_s']:.3f} s  max {s['max_s']:.3f} s"
              f"  (CPU median {s['cpu_median_s']:.3f} s)")
    print(f"  ratio plan/floor (medians): {doc['ratio']:.2f}x wall, {doc['cpu_ratio']:.2f}x CPU")
    print(f"  ratio model/floor (medians): {doc['model_ratio']:.2f}x wall, {doc['model_cpu_ratio']:.2f}x CPU")
    print(f"  ratio plan/model (medians): {doc['plan_over_model']:.2f}x wall, {doc['plan_over_model_cpu']:.2f}x CPU")


def heaviest_imports(profile: Path, top: int) -> list[tuple[int, int, str]]:
    """(cumulative us, self us, module) of the plan process's ``-X importtime`` lines, heaviest first."""
    argv = [sys.executable, "-X", "importtime", orbitctl_entry(), "plan", str(profile), "--json"]
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, cumulative, name = line.removeprefix("import time:").split("|", 2)
        rows.append((int(cumulative), int(own), name.rstrip()))
    return sorted(rows, reverse=True)[:top]


def profile_in_process(profile: Path, top: int) -> str:
    """cProfile's top ``top`` by cumulative time of the plan command run in this process, imports done first
    (they are ``-X importtime``'s part), so what remains is typer's dispatch, load, plan and render."""
    import orbitctl.plan.api  # noqa: F401
    import orbitctl.profile  # noqa: F401
    from orbitctl.cli.app import main

    pr = cProfile.Profile()
    with contextlib.redirect_stdout(io.StringIO()):
        pr.enable()
        main(["plan", str(profile), "--json"])
        pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def print_where(profile: Path) -> None:
    """The heaviest imports, then the in-process profile."""
    print("heaviest imports of the plan process (-X importtime; cumulative, self, module):")
    for cumulative, own, name in heaviest_imports(profile, 25):
        print(f"  {cumulative / 1000:8.1f} ms {own / 1000:8.1f} ms  {name}")
    print("\nin-process part (cProfile top 20 by cumulative time):")
    print(profile_in_process(profile, 20))


def main(argv: list[str] | None = None) -> None:
    """Time the commands (or, with ``--where``, show where the plan's time goes) and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", nargs="?", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--runs", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    parser.add_argument("--where", action="store_true", help="where the time goes instead of timing")
    parser.add_argument("--bytecode", action="store_true", help="cache bytecode for the commands (see above)")
    args = parser.parse_args(argv)
    if args.bytecode:
        cache_bytecode(args.profile)
    if args.where:
        print_where(args.profile)
        return
    doc = measure(args.profile, args.runs)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_measurement(doc)


if __name__ == "__main__":
    main()
