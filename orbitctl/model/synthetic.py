"""A large INT4 MoE checkpoint written tensor by tensor, never built in memory: for loading and memory checks.

    from orbitctl.model.synthetic import write_int4_moe
    path = write_int4_moe("artifacts/moe-2g", hidden=2048, experts=128, expert_width=1024, moe_layers=5)

The checkpoint is what ``orbitctl quantize --format int4 --modules experts`` writes for a
DeepSeek-V3-type model (config.json with its compressed-tensors ``quantization_config``, sharded
safetensors with an index): the routed experts as packed INT4 with bf16 group scales, everything
else in bf16. The values are seeded random (the packed codes uniform, the scales and dense weights
small), so a model loaded from it computes finite numbers but has learned nothing. Nothing larger
than one tensor is ever held in memory, so a checkpoint bigger than the machine's RAM can be made.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from orbitctl.procmem import reset_high_water, status_bytes
from orbitctl.units import MiB


def _moe_config(hidden: int, experts: int, expert_width: int, moe_layers: int, vocab: int, top_k: int) -> dict:
    from orbitctl.model.tiny import TINY_ARCHS

    return {**TINY_ARCHS["deepseek_v3"], "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": moe_layers + 1, "first_k_dense_replace": 1, "n_routed_experts": experts,
            "num_experts_per_tok": top_k, "moe_intermediate_size": expert_width, "n_shared_experts": 1,
            "vocab_size": vocab, "q_lora_rank": hidden // 4, "kv_lora_rank": hidden // 8, "num_attention_heads": 8,
            "num_key_value_heads": 8, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32}


def write_int4_moe(out_dir: str | Path, *, hidden: int = 512, experts: int = 16, expert_width: int = 256,
                   moe_layers: int = 2, vocab: int = 1024, top_k: int = 2, group_size: int = 32, seed: int = 0,
                   shard_bytes: int = 512 * MiB, config: dict | None = None, header_only: bool = False) -> Path:
    """Write the checkpoint into ``out_dir`` (created) and return it. ``config``: a whole DeepSeek-V3-type config
    instead of the one the sizes make (an architecture's own, at reduced depth). ``header_only``: each shard holds
    its safetensors header and no data, a sparse file of the full length (a checkpoint of any width in no disk
    space; the CUDA rehearsal reads no value of it, :mod:`orbitctl.dist.rehearsal`)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from orbitctl.codec.formats import FormatSpec
    from orbitctl.codec.qconfig import quantization_config
    from orbitctl.rundir import atomic_write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(config) if config is not None else _moe_config(hidden, experts, expert_width, moe_layers, vocab,
                                                                    top_k)
    settings.pop("quantization_config", None)
    settings["model_type"] = "deepseek_v3"
    config = AutoConfig.for_model(**settings)
    experts, hidden = int(config.n_routed_experts), int(config.hidden_size)
    expert_width, moe_layers = int(config.moe_intermediate_size), int(config.num_hidden_layers) - 1
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed)
    tensors: list[tuple[str, torch.Size, str]] = []
    for name, param in model.state_dict().items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            continue  # fused in memory; written per expert below, as the converter does
        tensors.append((name, param.shape, "bf16"))
    del model
    kept = sorted({n.rsplit(".", 1)[0] for n, _, _ in tensors if n.endswith(".weight")})
    for layer in range(1, moe_layers + 1):
        for e in range(experts):
            for proj, rows, cols in (("gate_proj", expert_width, hidden), ("up_proj", expert_width, hidden),
                                     ("down_proj", hidden, expert_width)):
                tensors.append((f"model.layers.{layer}.mlp.experts.{e}.{proj}", torch.Size([rows, cols]), "int4"))

    def parts(name: str, shape: torch.Size, kind: str):
        if kind == "bf16":
            if header_only:
                yield name, _Absent(shape, torch.bfloat16)
                return
            scale = 1.0 if name.endswith("norm.weight") or "layernorm" in name else 0.02
            value = torch.randn(shape, generator=g) * scale if "norm" not in name else torch.ones(shape)
            yield name, value.to(torch.bfloat16)
            return
        rows, cols = shape
        if header_only:
            yield f"{name}.weight_packed", _Absent((rows, cols // 8), torch.int32)
            yield f"{name}.weight_scale", _Absent((rows, cols // group_size), torch.bfloat16)
            yield f"{name}.weight_shape", torch.tensor([rows, cols], dtype=torch.int64)
            return
        yield f"{name}.weight_packed", torch.randint(-2**31, 2**31 - 1, (rows, cols // 8), generator=g, dtype=torch.int64).to(torch.int32)
        yield f"{name}.weight_scale", (torch.rand(rows, cols // group_size, generator=g) * 0.01 + 0.001).to(torch.bfloat16)
        yield f"{name}.weight_shape", torch.tensor([rows, cols], dtype=torch.int64)

    weight_map: dict[str, str] = {}
    shard, writer, written, total = 0, None, 0, 0
    files = []
    for name, shape, kind in tensors:
        for key, value in parts(name, shape, kind):
            size = value.numel() * value.element_size()
            if writer is None or written + size > shard_bytes:
                if writer is not None:
                    writer.close()
                shard += 1
                files.append(out / f"model-{shard:05d}.safetensors")
                writer = _HeaderOnlyWriter(files[-1]) if header_only else _shard_writer(files[-1])
                written = 0
            writer.add(key, value)
            weight_map[key] = files[-1].name
            written += size
            total += size
    writer.close()
    count = len(files)
    for i, file in enumerate(files, start=1):  # the names save_pretrained uses: model-00001-of-00003
        final = out / f"model-{i:05d}-of-{count:05d}.safetensors"
        file.rename(final)
        for key, value in list(weight_map.items()):
            if value == file.name:
                weight_map[key] = final.name
    atomic_write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    document = config.to_dict()
    document["architectures"] = ["DeepseekV3ForCausalLM"]
    document["quantization_config"] = quantization_config(FormatSpec("int4", group_size), kept)
    (out / "config.json").write_text(json.dumps(document, indent=2) + "\n")
    return out


def _shard_writer(path: Path):
    from orbitctl.codec.safetensors_io import ShardWriter

    return ShardWriter(path, reserve=1 << 20)


class _Absent:
    """A tensor's shape and dtype with no data: what a header-only shard lists."""

    def __init__(self, shape, dtype: torch.dtype) -> None:
        self.shape, self.dtype = torch.Size(shape), dtype

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


class _HeaderOnlyWriter:
    """A safetensors shard whose header lists every tensor and whose data region is a hole of the full length."""

    def __init__(self, path: Path) -> None:
        self.path, self.entries, self.offset, self.small = path, {}, 0, []

    def add(self, name: str, value) -> None:
        from orbitctl.codec.safetensors_io import DTYPE_NAMES

        if isinstance(value, torch.Tensor):  # a small real tensor (an INT4 weight's shape): written as it is
            self.small.append((self.offset, value.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()))
        end = self.offset + value.numel() * value.element_size()
        self.entries[name] = {"dtype": DTYPE_NAMES[value.dtype], "shape": list(value.shape),
                              "data_offsets": [self.offset, end]}
        self.offset = end

    def close(self) -> None:
        import struct

        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * ((-(8 + len(header))) % 8)
        with self.path.open("wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            start = f.tell()
            for offset, data in self.small:
                f.seek(start + offset)
                f.write(data)
            f.truncate(start + self.offset)


def checkpoint_bytes(path: str | Path) -> tuple[int, int]:
    """(all safetensors bytes, routed-expert tensor bytes) of a checkpoint directory."""
    from orbitctl.codec.source import open_checkpoint

    ckpt = open_checkpoint(Path(path))
    total = sum(e.nbytes for e in ckpt.entries.values())
    experts = sum(e.nbytes for n, e in ckpt.entries.items() if ".mlp.experts." in n)
    return total, experts


def _load_and_measure(rank: int, path: str, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from orbitctl.dist.collectives import barrier
    from orbitctl.model.expert_parallel import ExpertGroup
    from orbitctl.model.frozen_base import load_frozen_base, model_memory_bytes

    import accelerate  # noqa: F401  (libraries the loader imports are not what it loads)
    import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401

    torch.set_num_threads(1)
    experts = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        experts = ExpertGroup.of_world(world)
    reset_high_water()
    before = status_bytes("VmRSS")
    model = load_frozen_base(path, compute_dtype=torch.bfloat16, experts=experts)
    rise = status_bytes("VmHWM") - before
    held = model_memory_bytes(model)["total"]
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rss_rise": rise, "model_bytes": held}))
    if world > 1:
        barrier()
        dist.destroy_process_group()


def load_rss(path: str | Path, world: int = 1) -> list[dict]:
    """Load the checkpoint in ``world`` fresh processes (expert parallel over all of them when > 1); each
    rank's peak resident-set rise during the load and the bytes its model holds."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_load_and_measure, args=(str(path), world, f"{tmp}/store", tmp), nprocs=world,
                           start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
