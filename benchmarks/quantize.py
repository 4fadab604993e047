"""NF4 quantization of a bf16 checkpoint: `orbitctl quantize` vs transformers load-in-4bit + save.

    .venv/bin/python benchmarks/quantize.py                    # ~2 GB and ~4 GB checkpoints
    .venv/bin/python benchmarks/quantize.py --sizes-gb 0.5     # a quick look

Writes synthetic llama-shaped bf16 checkpoints (hidden 2048, GQA 16/4 heads, MLP 5632,
vocab 32000; the layer count sets the size), then measures each conversion in its own fresh
subprocess: wall time and peak RSS (ru_maxrss of that process). The transformers path is
``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...),
device_map="cpu")`` followed by ``save_pretrained``. Prints one table; not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2048, 5632, 16, 4, 32000


def llama_config(layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "bfloat16", "hidden_act": "silu"}


def layers_for(size_gb: float) -> int:
    per_layer = 2 * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN // (HEADS // KV_HEADS) + 3 * HIDDEN * INTER + 2 * HIDDEN)
    fixed = 2 * (2 * VOCAB * HIDDEN + HIDDEN)
    return max(1, round((size_gb * 1e9 - fixed) / per_layer))


def write_checkpoint(path: Path, layers: int, shard_bytes: int = 1_000_000_000) -> int:
    """A random bf16 llama checkpoint written tensor by tensor (sharded, with index)."""
    import torch

    from orbitctl.codec.safetensors_io import ShardWriter, header_reserve

    path.mkdir(parents=True, exist_ok=True)
    kv = HIDDEN // (HEADS // KV_HEADS)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
                   p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                   p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTER), p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,)}
    shapes |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        if current and size + nbytes > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups.append(current)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        writer = ShardWriter(path / file, header_reserve([(n, "BF16", shapes[n]) for n in names]))
        for name in names:
            t = torch.ones(shapes[name]) if len(shapes[name]) == 1 else torch.randn(shapes[name], generator=gen) * 0.02
            writer.add(name, t.to(torch.bfloat16))
            weight_map[name] = file
            total += 2 * t.numel()
        writer.close()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(llama_config(layers)))
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def child(kind: str, src: str, out: str) -> None:
    """Run one conversion in this process and print its wall time and peak RSS as JSON."""
    started = time.monotonic()
    if kind == "orbitctl":
        from orbitctl.cli.app import main

        code = main(["quantize", src, out, "--format", "nf4", "--json"])
        assert code == 0, code
    else:
        import torch
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(src, quantization_config=q, device_map="cpu", dtype=torch.bfloat16)
        model.save_pretrained(out)
    seconds = time.monotonic() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"kind": kind, "seconds": seconds, "peak_rss": peak}), file=sys.__stderr__)


def measure(kind: str, src: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run([sys.executable, __file__, "--child", kind, str(src), str(out)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")
    result = json.loads([line for line in done.stderr.splitlines() if line.startswith('{"kind"')][-1])
    result["out_bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[2.0, 4.0])
    parser.add_argument("--workdir", default=None, help="Where the synthetic checkpoints go (default: a temp dir).")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="orbitctl-bench-"))
    rows = []
    try:
        for size in args.sizes_gb:
            src = work / f"llama-{size:g}gb"
            total = write_checkpoint(src, layers_for(size))
            for kind in ("orbitctl", "transformers"):
                r = measure(kind, src, work / f"out-{kind}")
                rows.append({"size_bytes": total, **r})
                print(f"  {total / 1e9:.2f} GB  {kind:<12} {r['seconds']:7.1f} s  peak RSS {r['peak_rss'] / 2**30:5.2f} GiB", file=sys.stderr)
            shutil.rmtree(src)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("| checkpoint (bf16) | tool | wall time | peak RSS | output |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size_bytes'] / 1e9:.2f} GB | {r['kind']} | {r['seconds']:.1f} s | {r['peak_rss'] / 2**30:.2f} GiB | {r['out_bytes'] / 1e9:.2f} GB |")
    for size in sorted({r["size_bytes"] for r in rows}):
        o = next(r for r in rows if r["size_bytes"] == size and r["kind"] == "orbitctl")
        t = next(r for r in rows if r["size_bytes"] == size and r["kind"] == "transformers")
        print(f"{size / 1e9:.2f} GB: orbitctl {t['seconds'] / o['seconds']:.2f}x faster, peak RSS {o['peak_rss'] / t['peak_rss']:.2f} of transformers'")


if __name__ == "__main__":
    main()
