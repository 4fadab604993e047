"""The RL stack's own failures: engine start-up, LoRA, ZeRO-3, Ray, loss scale, checkpoint I/O, weight sync, launchers.

Logs come from tests/doctor/fixtures/real (copied from public threads); the composites below join
lines of those logs to test one rule at a time.
"""

from pathlib import Path

import pytest

from orbitctl.doctor import FAIL, INFO, WARN, triage_log
from orbitctl.doctor.engine import lora_rank_setting
from orbitctl.doctor.logscan import split_lines, unwrap

REAL = Path(__file__).parent / "fixtures" / "real"
PROFILE = Path(__file__).parent / "fixtures" / "profiles" / "llama8b_h100.yaml"


def real(name: str) -> str:
    return (REAL / name).read_text(encoding="utf-8")


def by_id(result) -> dict:
    return {f.id: f for f in result.findings}


def test_free_memory_below_utilization_names_the_value_that_fits():
    root = triage_log(real("club-3090-535-free-memory-below-utilization.log")).root_cause
    assert root.id == "log.kv.util"
    assert root.data["max_utilization"] == 0.92  # 22.35 / 23.56 = 0.949, less a 0.02 margin
    assert root.fix.startswith("set gpu_memory_utilization <= 0.92")


def test_max_model_len_above_the_cache_names_the_length_that_fits():
    v0 = triage_log(real("vllm-6746-kv-max-seq-len-worker-process.log")).root_cause
    assert (v0.id, v0.data["max_model_len"], v0.data["fits_tokens"]) == ("log.kv.len", 131072, 79392)
    assert v0.fix.startswith("set max_model_len <= 79392")
    v1 = triage_log(real("vllm-27508-kv-v1-max-seq-len.log")).root_cause  # the estimate itself was cut off
    assert v1.id == "log.kv.len" and "needs 4.54 GiB of KV cache; 1.71 GiB available" in " ".join(v1.evidence)


def test_a_hard_wrapped_kv_message_is_rejoined():
    lines = unwrap(split_lines(real("intel-arc-b70-4-kv-max-seq-len-wrapped.log")))
    assert any("4.26 GiB KV cache is needed" in ln for ln in lines)


def test_every_engine_rank_printing_the_budget_is_one_finding():
    root = triage_log(real("sglang-7691-negative-profiled-tokens-every-rank.log")).root_cause
    assert root.id == "log.oom.kv" and root.data["ranks"] == list(range(8)) and root.data["count"] == 8
    assert any("-561981 tokens" in e for e in root.evidence)


def test_engine_failure_with_a_profile_gets_the_planned_settings():
    from orbitctl.profile import load_profile

    profile = load_profile(PROFILE)
    root = triage_log(real("vllm-6746-kv-max-seq-len-worker-process.log"), profile=profile).root_cause
    plan = root.data["plan"]
    assert plan["max_model_len"] == 4096  # max(memory.seq_len, rollout.max_new_tokens)
    assert 0 < plan["gpu_memory_utilization"] <= plan["max_utilization"] <= 1
    assert root.fix.startswith("plan: the engine needs")
    assert f"set gpu_memory_utilization={plan['gpu_memory_utilization']:.2f} and max_model_len=4096" in root.fix
    # the 23.56 GiB GPU in this message is planned as it is: the profile's rollout does not fit it
    small = triage_log(real("club-3090-535-free-memory-below-utilization.log"), profile=profile).root_cause
    assert small.data["plan"]["gpu_memory_bytes"] == int(23.56 * 2**30)
    assert "does not fit this GPU" in small.fix and small.fix.startswith("plan: the engine needs")


def test_lora_rank_gets_the_engine_setting_from_the_message_and_the_profile():
    from orbitctl.profile import load_profile

    root = triage_log(real("llamafactory-9512-worker-failed-lora-rank.log")).root_cause
    assert (root.id, root.data["adapter_rank"], root.data["max_lora_rank"]) == ("log.lora.rank", 32, 16)
    assert root.fix.startswith("set max_lora_rank=32")
    planned = triage_log(real("vllm-2847-lora-rank-above-max.log"), profile=load_profile(PROFILE)).root_cause
    assert planned.fix.startswith("profile adapter.rank=64: set max_lora_rank=64")
    assert [lora_rank_setting(r) for r in (1, 16, 17, 300, 600)] == [8, 16, 32, 320, 600]


def test_zero_size_adapter_shapes_are_zero3_and_real_shapes_are_another_base():
    assert triage_log(real("peft-1710-zero3-adapter-saved-empty.log")).root_cause.id == "log.zero3.ckpt"
    assert triage_log(real("autotrain-advanced-487-adapter-base-mismatch.log")).root_cause.id == "log.lora.mismatch"


def test_trace_invalidation_alone_is_a_warning_and_with_timeouts_a_hang():
    log = real("deepspeed-pr5008-zero3-trace-invalidated-then-allgather-timeouts.log")
    alone = triage_log(log.splitlines()[0])
    assert alone.root_cause.id == "log.zero3.trace" and alone.root_cause.status == WARN
    found = by_id(triage_log(log))
    assert found["log.zero3.hang"].status == FAIL
    assert found["log.nccl.timeout"].status == WARN  # a consequence of the hang
    assert any("prefetch trace changed at line 1" in e for e in found["log.zero3.hang"].evidence)


def test_ray_thread_limit_is_named_instead_of_the_oom_hint():
    found = by_id(triage_log(real("verl-472-actor-died-thread-resource-unavailable.log")))
    assert found["log.ray.threads"].status == FAIL and "log.host.oom" not in found
    assert found["log.ray.died"].status == WARN
    alone = triage_log(real("recall-62-verl-actor-died-cause-not-in-log.log"))
    assert alone.root_cause.id == "log.ray.died" and alone.root_cause.status == WARN
    assert "worker-*-<pid>.err" in alone.root_cause.fix


def test_loss_scale_is_a_failure_only_when_it_collapses():
    settled = triage_log(real("cogvideo-233-clean-loss-scale-settles.log"))
    assert by_id(settled)["log.train.scale"].status == INFO and settled.root_cause is None
    collapsed = triage_log(real("apex-834-loss-scale-halved-below-one.log")).root_cause
    assert (collapsed.id, collapsed.status, collapsed.data["lowest"]) == ("log.train.scale", FAIL, 0.5)
    assert "loss scale down to 0.5 after 17 overflow(s)" in collapsed.evidence
    # bf16 Megatron prints "loss scale: 1.0" on every step: not an overflow
    assert triage_log(" | lm loss: 1.420515E+00 | loss scale: 1.0 | grad norm: 13.636 |").root_cause is None


def test_weight_sync_failure_is_told_apart_from_the_fabric():
    sync = by_id(triage_log(real("openrlhf-pr335-update-weight-ibv-modify-qp-timeout.log")))
    assert sync["log.sync.weights"].status == FAIL
    assert sync["log.nccl.ib"].status == WARN and "seen during the weight sync" in sync["log.nccl.ib"].evidence[-1]
    fabric = real("nccl-928-net-ib-error4-multinode.log")
    assert triage_log(fabric).root_cause.id == "log.nccl.ib"
    # weight-sync lines far (> 40 lines) before the first fabric error do not explain it
    ctx = real("openrlhf-621-update-weight-mlx5-completion-error.log").splitlines()[4:7]
    far = "\n".join(ctx + ["step ok"] * 60) + "\n" + fabric
    assert triage_log(far).root_cause.id == "log.nccl.ib"


def test_a_store_timeout_inside_the_sync_is_not_a_rendezvous_failure():
    root = triage_log(real("ms-swift-4906-move-model-to-vllm-barrier-timeout.log")).root_cause
    assert (root.id, root.rank) == ("log.sync.weights", 0)
    assert any("update_named_param" in e or "_move_model_to_vllm" in e for e in root.evidence)


def test_launcher_summary_alone_is_a_warning_naming_rank_and_exit_code():
    root = triage_log(real("x-r1-23-launcher-summary-only-rank1.log")).root_cause
    assert (root.id, root.status, root.rank) == ("log.launcher", WARN, 1)
    assert "exit code 1: a Python exception in that rank" in root.evidence


def test_the_error_before_the_launcher_summary_is_the_cause_with_the_launchers_rank():
    result = triage_log(real("open-r1-410-argparse-error-then-launcher.log"))
    assert (result.root_cause.id, result.root_cause.rank) == ("log.exception", 0)
    assert "the following arguments are required" in result.root_cause.evidence[0]
    launcher = by_id(result)["log.launcher"]
    assert launcher.status == WARN and launcher.data["exit_codes"] == [2]


def test_a_rank_exception_outranks_the_summary_of_another_rank():
    # rank 5's error is earlier in the log; the launcher then reports local rank 0
    text = ("[rank5]: Traceback (most recent call last):\n[rank5]:   File \"train.py\", line 9, in <module>\n"
            "[rank5]: KeyError: 'answer'\n" + real("x-r1-23-launcher-summary-only-rank1.log").replace("local_rank: 1", "local_rank: 0"))
    root = triage_log(text).root_cause
    assert (root.id, root.rank) == ("log.exception", 5)


@pytest.mark.parametrize("name", ["openrlhf-336-kv-max-seq-len-llmrayactor.log", "vllm-21500-unsupported-lora-weight-cut.log"])
def test_a_cut_traceback_is_a_warning_saying_what_is_missing(name):
    root = triage_log(real(name)).root_cause
    assert (root.id, root.status) == ("log.cut", WARN)
    assert "no exception line follows it" in root.evidence[0]


def test_a_complete_traceback_is_not_called_cut():
    assert "log.cut" not in by_id(triage_log(real("sparse-autoencoder-204-checkpoint-dir-permission-denied.log")))


@pytest.mark.parametrize("name, root_id", [
    ("dolly-139-no-space-left-saving.log", "log.ckpt.nospace"),
    ("comfyui-nf4-34-safetensors-header-incomplete.log", "log.ckpt.corrupt"),
    ("rn-4-makedirs-data-permission-denied.log", "log.ckpt.perm"),
    ("nccl-290-posix-fallocate-horovod.log", "log.nccl.shm"),  # "No space left" in /dev/shm is shared memory
])
def test_disk_full_corrupt_file_and_permissions(name, root_id):
    assert triage_log(real(name)).root_cause.id == root_id


def test_startup_advice_that_mentions_out_of_memory_is_clean():
    for name in ("vllm-pr11349-clean-cudagraph-capture-advice.log", "easydistill-4-clean-advice-flagged-as-error.log",
                 "vllm-15340-clean-memory-profiling.log"):
        result = triage_log(real(name))
        assert result.root_cause is None and all(f.status != FAIL for f in result.findings), name
