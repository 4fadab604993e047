"""The static decode step (orbitctl.model.graph_decode): what a CUDA graph replays on a GPU, run eagerly here.

It must sample what the eager decode over a growing cache samples: the same greedy tokens, the same routing on an
MoE, log-probs within a few roundings of the compute dtype (attention over the closed slots adds exact zeros, the
sums only block differently); and every step must keep its shapes and the cache's addresses, or a replayed graph
would read stale memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from orbitctl.kernels.graph_capture import graphs_apply  # noqa: E402
from orbitctl.model.graph_decode import StaticDecode  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "tiny-moe-cpu.yaml"])
def test_the_static_step_samples_what_the_growing_cache_samples(name, profile_policy):
    policy, split, _ = profile_policy(name)
    # prompts of different lengths: left padding in the batch
    prompts = [it.prompt + " 7" * i for i, it in enumerate(split.train[:5])]
    ids, mask = policy.encode_prompts(prompts)
    assert (mask == 0).any()
    runs = {}
    for static in (False, True):
        runs[static] = policy.sample(ids, mask, max_new_tokens=7, temperature=0.0, top_p=1.0, generator=None,
                                     keep_dist=True, static=static)
    eager, fixed = runs[False], runs[True]
    assert torch.equal(fixed.completion_ids, eager.completion_ids)
    assert torch.equal(fixed.completion_mask, eager.completion_mask)
    kept = eager.completion_mask.bool()
    dtype = policy.model.get_input_embeddings().weight.dtype
    bound = 64 * torch.finfo(dtype).eps * (1 + eager.dist[kept].abs().max())
    assert (fixed.dist[kept] - eager.dist[kept]).abs().max() <= bound
    if policy.routing is not None:  # the experts each decoded token went to: recorded alike
        assert torch.equal(fixed.routes, eager.routes)


def test_the_static_step_keeps_its_shapes_and_addresses(profile_policy):
    """Every step writes into the same cache tensors at a device-side counter, opens one mask column, and feeds
    the same input buffers: what a graph captured at one step replays at every later one."""
    from transformers import DynamicCache

    policy, split, _ = profile_policy("tiny-moe-cpu.yaml")
    ids, mask = policy.encode_prompts([it.prompt + " 7" * i for i, it in enumerate(split.train[:3])])
    model = policy.model
    model.eval()
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{policy._cache_kw: DynamicCache()})
        prefilled = getattr(out, policy._cache_kw)
        step = StaticDecode(model, policy._cache_kw, prefilled, mask, mask.sum(-1, keepdim=True), 4, capture=False)
        width = ids.shape[1]
        addresses = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in step.cache.layers]
        inputs = (step.token.data_ptr(), step.position.data_ptr(), step.bias.data_ptr())
        token = out.logits[:, -1].argmax(-1)
        alive = torch.tensor([True, False, True])
        for t in range(4):
            logits = step(token, alive)
            assert logits.shape == (3, model.config.vocab_size)
            assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in step.cache.layers] == addresses
            assert (step.token.data_ptr(), step.position.data_ptr(), step.bias.data_ptr()) == inputs
            assert all(int(layer.cumulative_length) == width + t + 1 for layer in step.cache.layers)
            token = logits.argmax(-1)
        # the prompt's padding and a dead row's fed tokens stay closed; the live rows' are open
        opened = step.bias[:, 0, 0] == 0
        assert torch.equal(opened[:, :width], mask.bool())
        assert opened[[0, 2], width:].all() and not opened[1, width:].any()
        with pytest.raises(RuntimeError, match="all are written"):
            step(token, alive)


def test_graphs_apply_only_on_a_cuda_device_with_a_static_cache():
    assert graphs_apply("auto", "cuda", kv_dtype="bf16")
    assert graphs_apply(True, "cuda", kv_dtype="bf16")
    assert not graphs_apply(False, "cuda", kv_dtype="bf16")
    assert not graphs_apply("auto", "cpu", kv_dtype="bf16")
    assert not graphs_apply("auto", "cuda", kv_dtype="fp8")
    assert not graphs_apply("auto", "cuda", kv_dtype="bf16", keep_hidden=True)


@pytest.mark.parametrize("sets, needle", [
    (["rollout.decode_graphs=true"], "rollout.decode_graphs: true replays the decode step from a CUDA graph"),
    (["rollout.decode_graphs=true", "hardware.gpu=h200", "rollout.kv_dtype=fp8"], "rollout.kv_dtype fp8"),
])
def test_decode_graphs_true_is_refused_where_it_cannot_apply(sets, needle):
    from orbitctl.profile import load_profile
    from orbitctl.profile.support import unsupported_for

    profile = load_profile(ROOT / "profiles" / "tiny-cpu.yaml", sets)
    found = [u.render() for u in unsupported_for("train", profile) if u.key == "rollout.decode_graphs"]
    assert len(found) == 1 and needle in found[0], found


NO_KERNEL = {"empty", "empty_strided", "detach", "alias", "lift_fresh", "_unsafe_view"}
"""Ops that launch no kernel (besides views): allocations without a fill, autograd's and reshape's aliases."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plans_kernels_per_replayed_op_are_what_a_static_step_dispatches(int4_moe, dtype):
    """plan.ops.GRAPH_KERNELS_PER_OP: of the ops one static decode step of the tiny INT4 MoE dispatches (fused kernel),
    the share that launches a kernel (not a view, an alias or a bare allocation), within 15%."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache

    from orbitctl.model.frozen_base import load_frozen_base, use_fused_int4
    from orbitctl.plan.ops import GRAPH_KERNELS_PER_OP

    model = load_frozen_base(int4_moe, compute_dtype=dtype)
    use_fused_int4(model)
    counted = {"ops": 0, "kernels": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counted["ops"] += 1
            counted["kernels"] += not (func.is_view or func._schema.name.split("::")[1] in NO_KERNEL)
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, model.config.vocab_size, (16, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)
        step = StaticDecode(model, "past_key_values", cache, mask[:, :8], mask[:, :8].sum(-1, keepdim=True), 2,
                            capture=False)
        step(ids[:, 8], torch.ones(16, dtype=torch.bool))
        with Count():
            step._forward()
    share = counted["kernels"] / counted["ops"]
    assert abs(share - GRAPH_KERNELS_PER_OP) <= 0.15 * GRAPH_KERNELS_PER_OP, counted


def test_only_a_model_whose_experts_run_grouped_is_captured(int4_moe, profile_policy):
    """The per-expert loop reads the routing's counts on the host: a MoE layer without its grouped stack keeps the
    static step eager (capture off) even on a GPU; a dense model has nothing to read."""
    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.model.graph_decode import sync_free

    moe = load_frozen_base(int4_moe, compute_dtype=torch.float32)
    assert not sync_free(moe)
    policy, _, _ = profile_policy("tiny-cpu.yaml")
    assert sync_free(policy.model)


def test_a_failed_captures_routing_is_cut_back_to_the_steps_that_ran():
    from orbitctl.model.router_replay import RouterTape

    tape = RouterTape.__new__(RouterTape)
    tape._recorded = [[torch.zeros(2, 2)] * 3, [torch.zeros(2, 2)] * 2]  # one layer's hook ran in the capture
    tape.truncate(2)
    assert [len(calls) for calls in tape._recorded] == [2, 2]
    tape.append([torch.ones(2, 2), torch.ones(2, 2)])
    assert [len(calls) for calls in tape._recorded] == [3, 3] and tape.pop_last()[0].sum() == 4


@pytest.mark.parametrize("value, needles", [("true", ("rollout.decode_graphs", "CPU", "auto or false")),
                                            ("maybe", ("rollout.decode_graphs", "boolean", "'auto'"))])
def test_train_refuses_decode_graphs_it_cannot_run_in_one_line(value, needles, tmp_path, one_error_line):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", str(ROOT / "profiles" / "tiny-cpu.yaml"),
                           "--set", f"rollout.decode_graphs={value}", "--dry-run"], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 2
    one_error_line(done.stderr, *needles)
