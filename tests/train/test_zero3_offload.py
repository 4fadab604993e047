"""ZeRO-3 in `orbitctl train`: the frozen base's parameter offload (`memory.offload_params: cpu`) and the
prefetch depth (`memory.prefetch_layers`), as the DeepSpeed config gives them to DeepSpeed and as the run
directory records them.

The 2-rank runs start through the command line, which launches both CPU ranks itself (as
tests/train/test_launch.py does).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ZERO3 = {"memory.zero_stage": 3}
OFFLOAD = {"memory.offload_params": "cpu", "memory.offload_optimizer": "cpu"}  # the schema asks for both


def _zero(config: dict) -> dict:
    return config["zero_optimization"]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_prefetch_layers_set_deepspeeds_gather_limits_to_the_plans_window(small_profile, prefetch):
    from orbitctl.plan.layout import gather_window
    from orbitctl.rl.engine import deepspeed_config

    layer, hidden = 12_345, 64
    profile = small_profile(**ZERO3, **{"memory.prefetch_layers": prefetch})
    zero = _zero(deepspeed_config(profile, 1, False, layer_elements=layer, hidden_size=hidden))
    assert zero["stage3_prefetch_bucket_size"] == prefetch * layer
    assert zero["stage3_max_live_parameters"] == (1 + prefetch) * layer
    assert zero["stage3_max_reuse_distance"] == prefetch * layer  # nothing kept for a reuse beyond the window
    assert zero["stage3_param_persistence_threshold"] == 10 * hidden  # what plan/adapters.py assumes
    # the plan's gather window over equal layers is the live limit train gives DeepSpeed
    assert gather_window([float(layer)] * 5, prefetch) == zero["stage3_max_live_parameters"]
    assert "offload_param" not in zero


def test_offload_params_is_deepspeeds_parameter_offload_and_only_under_zero3(small_profile):
    from orbitctl.rl.engine import deepspeed_config

    config = deepspeed_config(small_profile(**ZERO3, **OFFLOAD), 1, False, layer_elements=100, hidden_size=8)
    assert _zero(config)["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert _zero(config)["offload_optimizer"] == {"device": "cpu"}
    assert config["zero_force_ds_cpu_optimizer"] is False  # torch's AdamW steps the host partitions
    plain = _zero(deepspeed_config(small_profile(), 1, False))  # the demo's ZeRO-2: nothing is gathered
    assert plain == {"stage": 2}


def test_prefetch_below_zero3_is_refused_and_zero3_values_are_built(small_profile):
    from orbitctl.profile.support import unsupported_for

    keys = lambda **o: [u.key for u in unsupported_for("train", small_profile(**o))]  # noqa: E731
    assert keys(**{"memory.prefetch_layers": 2}) == ["memory.prefetch_layers"]  # zero_stage 2
    assert keys(**ZERO3, **OFFLOAD, **{"memory.prefetch_layers": 2}) == []
    assert keys(**ZERO3, **{"memory.prefetch_layers": 0}) == []


def test_stage_2_with_prefetch_exits_2_naming_the_key(profile_yaml, one_error_line):
    profile = profile_yaml("refused", **{"memory.prefetch_layers": 0})
    done = _train(profile)
    assert done.returncode == 2, done.stderr
    one_error_line(done.stderr, "memory.prefetch_layers: 0", "memory.zero_stage")


def test_zero3_partitions_and_offloads_the_frozen_packed_base(small_profile):
    """One rank, the engine only: every frozen packed weight of the NF4 base (bf16 storage) above the
    persistence threshold is a ZeRO-3 parameter that is partitioned, not kept whole, and so lives where
    ``offload_param`` puts partitions; the layer size train measured is what those parameters add up to, and
    the dry run's estimate from the architecture agrees with it."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.rl.engine import build_engine, close_process_group, deepspeed_config, engine_config, \
        ensure_process_group
    from orbitctl.rl.trainer import _accumulation

    profile = small_profile(**ZERO3, **OFFLOAD, **{"memory.prefetch_layers": 2})
    split = load_prompts(profile.data, profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    gas = _accumulation(profile, 1)
    config = engine_config(policy, profile, gas)
    zero = _zero(config)
    threshold = zero["stage3_param_persistence_threshold"]
    layers = policy.model.get_base_model().model.layers
    packed = [p for p in layers.parameters() if not p.requires_grad and p.numel() > threshold]
    assert packed and all(type(p).__name__ == "Params4bit" for p in packed)  # the packed NF4 codes
    per_layer = [sum(p.numel() for p in layer.parameters() if p.numel() > threshold) for layer in layers]
    assert zero["stage3_max_live_parameters"] == 3 * max(per_layer)
    planned = _zero(deepspeed_config(profile, gas, config["bf16"]["enabled"]))
    assert planned == zero  # --dry-run's config, worked out without the model
    ensure_process_group()
    try:
        engine, _ = build_engine(policy, profile, gas, 1, config)
        assert engine.zero_optimization_partition_weights() and engine.zero_offload_param() is not None
        for p in packed:
            assert p.ds_persist is False and p.ds_tensor.numel() == p.ds_numel  # one rank: its partition is all
            assert p.numel() == 0  # released: only the partition remains until a gather
            assert str(p.ds_tensor.device) == "cpu"
    finally:
        close_process_group()


def _train(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=900)


def _adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _rewards(run: Path) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_with_the_base_offloaded_train_the_adapter_of_the_plain_zero3_run(tmp_path, profile_yaml):
    """3 steps on 2 CPU ranks under ZeRO-3 with the frozen base's partitions offloaded end at the adapter the
    same run without the offload reaches, within the floor; the run directory records the DeepSpeed config
    with the offload and the prefetch limits.

    The floor is measured here: the plain run again with no prefetch (one layer gathered at a time, each
    released as soon as it has run) instead of one layer ahead, which changes only when DeepSpeed gathers the
    partitions, never what they hold (as the offload must not). It is at least a
    dtype-derived bound, a few float32 ulps of the largest adapter value per step, for CPUs where the two
    happen to agree bitwise. The draws are keyed by sequence, so all three runs sample the same tokens.
    """
    import torch

    common = {**ZERO3, "memory.offload_optimizer": "cpu", "hardware.gpus_per_node": 2, "rl.steps": 3,
              "quant.compute_dtype": "fp32", "adapter.dtype": "fp32", "rl.prompts_per_step": 4, "rl.group_size": 4,
              "memory.micro_batch_size": 8, "rollout.batch_size": 8, "data.eval_size": 4, "rollout.temperature": 1.5}
    profiles = {"plain": profile_yaml("plain", **common), "offload": profile_yaml("offload", **{**common, **OFFLOAD}),
                "prefetch0": profile_yaml("prefetch0", **common, **{"memory.prefetch_layers": 0})}
    for name, profile in profiles.items():
        done = _train(profile, "--json")
        assert done.returncode == 0, (name, done.stderr[-3000:])
        assert json.loads(done.stdout)["steps"] == 3
    runs = {name: tmp_path / name for name in profiles}
    configs = {name: json.loads((run / "deepspeed_config.json").read_text()) for name, run in runs.items()}
    zero = {name: _zero(c) for name, c in configs.items()}
    assert zero["offload"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero["plain"]
    layer = zero["plain"]["stage3_prefetch_bucket_size"]  # one layer's gathered elements, measured by train
    assert layer > 0 and zero["offload"]["stage3_prefetch_bucket_size"] == layer
    assert zero["plain"]["stage3_max_live_parameters"] == 2 * layer
    assert zero["prefetch0"]["stage3_prefetch_bucket_size"] == 0 == zero["prefetch0"]["stage3_max_reuse_distance"]
    assert zero["prefetch0"]["stage3_max_live_parameters"] == layer
    # `train --dry-run` works out the same config from the architecture, without loading the model
    from orbitctl.launch.dryrun import dry_run
    from orbitctl.profile import load_profile

    for name in ("offload", "prefetch0"):
        assert dry_run(load_profile(str(profiles[name]))).deepspeed_config == configs[name], name

    assert _rewards(runs["plain"]) == _rewards(runs["offload"]) == _rewards(runs["prefetch0"])
    adapters = {name: _adapter(run) for name, run in runs.items()}
    assert adapters["plain"].keys() == adapters["offload"].keys() and len(adapters["plain"]) > 0
    # saved whole: a factor ZeRO-3 partitioned is gathered for the save, not written as its empty stub
    assert all(v.numel() > 0 and v.shape == adapters["offload"][k].shape for k, v in adapters["plain"].items())
    assert max(float(v.abs().max()) for k, v in adapters["plain"].items() if "lora_B" in k) > 0  # B starts at 0

    def gap(a: str, b: str) -> float:
        return max(float((adapters[a][k] - adapters[b][k]).abs().max()) for k in adapters[a])

    largest = max(float(v.abs().max()) for v in adapters["plain"].values())
    ulps = 3 * 4 * torch.finfo(torch.float32).eps * largest
    floor = gap("plain", "prefetch0")
    assert gap("offload", "plain") <= max(floor, ulps), (gap("offload", "plain"), floor, ulps)
