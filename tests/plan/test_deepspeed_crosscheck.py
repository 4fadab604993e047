"""Model states equal DeepSpeed's own ZeRO-3 estimator for a bf16 full fine-tune."""

from __future__ import annotations

import pytest

from orbitctl.arch import builtin_arch
from orbitctl.plan.states import model_states

deepspeed_stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")


@pytest.mark.parametrize("arch", ["llama-3.1-8b", "qwen2.5-7b", "mixtral-8x7b"])
@pytest.mark.parametrize("gpus,nodes", [(8, 1), (4, 2), (1, 1)])
@pytest.mark.parametrize("offload_optimizer,offload_params", [(False, False), (True, False), (True, True)])
def test_zero3_model_states_match_deepspeed(arch, gpus, nodes, offload_optimizer, offload_params):
    spec = builtin_arch(arch)
    total, largest = spec.params_total, spec.largest_module_params
    cpu, gpu, _ = deepspeed_stage3.estimate_zero3_model_states_mem_needs(
        total, largest, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=offload_optimizer,
        cpu_offload_params=offload_params, zero_init=True)
    states = model_states(total, largest, zero_stage=3, gpus_per_node=gpus, nodes=nodes,
                          offload_optimizer=offload_optimizer, offload_params=offload_params)
    assert int(states.gpu_total) == pytest.approx(gpu, abs=2)
    if offload_optimizer:
        assert int(states.host) == pytest.approx(cpu, abs=2)


def test_zero2_model_states_match_deepspeed():
    stage12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    total = builtin_arch("llama-3.1-8b").params_total
    _, gpu = stage12.estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=8, cpu_offload=False)
    states = model_states(total, 0, zero_stage=2, gpus_per_node=8)
    assert int(states.gpu_total) == pytest.approx(gpu, abs=2)


def test_stage_semantics_shard_more_with_each_stage():
    totals = [model_states(10**9, 10**7, zero_stage=s, gpus_per_node=8).gpu_total for s in (0, 1, 2, 3)]
    assert totals[0] > totals[1] > totals[2] > totals[3]
    # stage 0 keeps everything: bf16 weight + bf16 and fp32 grads + master + Adam = 20 B per parameter
    assert totals[0] == 20 * 10**9
