"""Each phase's measured memory against the plan, on a generated INT4 MoE large enough for the weights to dominate.

    python benchmarks/phase_memory.py                     # ~1 GB MoE, 1 CPU rank, 2 train steps
    python benchmarks/phase_memory.py --gb 1.2 --ranks 2  # 2 CPU ranks, expert parallelism 2
    python benchmarks/phase_memory.py --gb 1.5            # 4 MoE layers, 1.5 GB (--steps N: more steps)

The checkpoint is DeepSeek-V3-shaped (orbitctl.model.synthetic: INT4 routed experts, bf16 dense
part, random weights) with the demo's character tokenizer; the profile is profiles/tiny-moe-cpu.yaml
pointed at it. `orbitctl train` runs two steps and every rank records its peak per phase (the rise
of its resident set on the CPU, torch.cuda.max_memory_allocated on a GPU); printed beside what
`orbitctl plan` predicts for the same profile; on a GPU with DeepSpeed installed it runs the same there.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def profile_file(out: Path, sets: dict) -> Path:
    """profiles/tiny-moe-cpu.yaml with dotted-key ``sets`` applied, written to ``out``."""
    data = yaml.safe_load((ROOT / "profiles" / "tiny-moe-cpu.yaml").read_text())
    for key, value in sets.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = out / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def write_slice(out: Path, **width) -> tuple[Path, int, int]:
    """A generated INT4 MoE with the character tokenizer; returns (path, bytes, routed-expert bytes)."""
    from orbitctl.model.charset import VOCAB_SIZE, save_char_tokenizer
    from orbitctl.model.synthetic import checkpoint_bytes, write_int4_moe

    path = write_int4_moe(out, vocab=VOCAB_SIZE, **width)
    save_char_tokenizer(path)
    return (path, *checkpoint_bytes(path))


def slice_sets(path: Path, run_dir: Path, gpu: str, ranks: int, seq: int, new_tokens: int) -> dict:
    """The profile values that train a slice for memory: one prompt pair per rank, no evaluation, no checkpoints."""
    return {"name": "memory-slice", "model": {"config": str(path / "config.json"), "quantized_path": str(path)},
            "hardware.gpu": gpu, "hardware.gpus_per_node": ranks, "memory.expert_parallel": ranks,
            "memory.micro_batch_size": 2, "memory.seq_len": seq, "rollout.batch_size": 2,
            "rollout.max_new_tokens": new_tokens, "rl.prompts_per_step": ranks, "rl.group_size": 2,
            "data.eval_size": 2, "run.dir": str(run_dir), "run.eval_every": 10**6, "run.save_every": 10**6}


def train(path: Path, steps: int) -> tuple[dict, float]:
    from orbitctl.launch import api

    profile = api.load_train_profile(str(path))
    start = time.perf_counter()
    result = api.train(profile, fresh=True, steps=steps)
    return result.to_dict(), time.perf_counter() - start


def memory_rows(label: str, metrics: dict) -> list[tuple[str, str, str]]:
    """(check, figure, measured/predicted) per phase, the largest rank."""
    rows = []
    for phase, p in (metrics.get("phase_memory") or {}).items():
        measured = max((m for m in p["measured_bytes"] if m is not None), default=None)
        used = max((u for u in p.get("device_used_bytes", []) if u is not None), default=None)
        predicted = p["predicted_bytes"]
        text = ("measured " + ", ".join("-" if m is None else f"{m / 2**30:.2f}" for m in p["measured_bytes"])
                + " GiB" + (f", device used {used / 2**30:.2f} GiB" if used is not None else "")
                + (f", plan {predicted / 2**30:.2f} GiB" if predicted else ""))
        ratio = f"{measured / predicted:.2f}" if measured is not None and predicted else "-"
        rows.append((f"{label}: {phase}", text, ratio))
    return rows


def print_rows(rows: list[tuple[str, str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    print()
    for check, figure, verdict in rows:
        print(f"{check:<{width}}  {figure}  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.1, help="checkpoint size, GB")
    parser.add_argument("--ranks", type=int, default=1, help="CPU ranks (expert parallel over all of them)")
    parser.add_argument("--steps", type=int, default=2, help="train steps")
    parser.add_argument("--work", default="/tmp/orbitctl-phase-memory")
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work / "run", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    experts = 96
    layers = max(1, round(args.gb * 1e9 * 0.95 / (experts * 3 * 2048 * 1024 * (0.5 + 2 / 32))))
    out = work / f"h2048-e{experts}-l{layers}"
    if (out / "config.json").exists():
        from orbitctl.model.synthetic import checkpoint_bytes

        path, total, routed = (out, *checkpoint_bytes(out))
    else:
        path, total, routed = write_slice(out, hidden=2048, expert_width=1024, experts=experts, moe_layers=layers)
    rows = [("checkpoint", f"{total / 1e9:.2f} GB, routed experts {routed / total:.0%}", "")]
    profile = profile_file(work, slice_sets(path, work / "run", "cpu", args.ranks, 64, 8))
    result, seconds = train(profile, args.steps)
    rows.append(("train", f"{result['steps']} steps on {args.ranks} CPU rank(s) in {seconds:.0f} s", ""))
    print_rows(rows + memory_rows("memory", result["last_metrics"]))


if __name__ == "__main__":
    main()
