"""How the GPU paths fail: a CPU tensor in an NCCL collective, CUDA-graph capture, Triton kernels, INT4 kernels.

Logs come from tests/doctor/fixtures/real (copied from public threads, listed in index.json). Each kind is checked
for its cause id, a fix in orbitctl's terms (the profile key, or the rehearsal that catches it) and the rank the log
shows. Where no public log of a kind carries a rank tag on its error line, the rank test prefixes that kind's real
error line with the tags the real logs use ("[rank3]: ", vLLM's "(Worker_TP7 pid=312) ERROR ... ").
"""

import json
import re
from pathlib import Path

import pytest

from orbitctl.cli.app import main
from orbitctl.doctor import FAIL, WARN, triage_log
from orbitctl.doctor.signatures import BY_ID

REAL = Path(__file__).parent / "fixtures" / "real"
ROOT = Path(__file__).parents[2]

# fixture -> (root cause, rank, what its fix must name)
CASES = {
    # 1. a CPU tensor passed to an NCCL collective
    "sglang-pr5322-verl-sglang-rollout-broadcast-cpu-tensor": ("log.nccl.cpu", None,
                                                               ("orbitctl/dist/collectives.py", "pytest -k rehearsal")),
    "unsloth-zoo-129-broadcast-object-cpu-rank2": ("log.nccl.cpu", 2, ("orbitctl/dist/collectives.py",
                                                                        "pytest -k rehearsal")),
    "cogvlm-328-deepspeed-broadcast-cpu-interleaved": ("log.nccl.cpu", None, ("pytest -k rehearsal",)),
    # 2. CUDA-graph capture
    "sglang-7918-torch-compile-graph-capture-not-permitted": ("log.cuda.graph", None,
                                                              ("rollout.decode_graphs: false", "pytest -k rehearsal")),
    "club-3090-106-vllm-nightly-capture-unsupported-tp1": ("log.cuda.graph", 1, ("rollout.decode_graphs: false",
                                                                                  "capturability check")),
    "sglang-6033-capture-current-seed-h200": ("log.cuda.graph", None, ("rollout.decode_graphs: false",)),
    "flash-attention-379-dropout-rng-during-graph-capture": ("log.cuda.graph", None, ("rollout.decode_graphs: false",)),
    # 3. Triton
    "sglang-8513-glm45-air-fp8-triton-out-of-shared-memory": ("log.triton.smem", None, ("quant.kernel: dequantize",)),
    "sglang-2384-mi300-triton-out-of-shared-memory": ("log.triton.smem", None, ("quant.kernel: dequantize",)),
    "monkeyocr-86-lmdeploy-triton-out-of-shared-memory": ("log.triton.smem", None, ("quant.kernel: dequantize",)),
    "mlcommons-training-pr826-b200-ptxas-sm100-rank6": ("log.triton.ptxas", 6, ("TRITON_PTXAS_PATH",
                                                                                 "quant.kernel: dequantize")),
    "vllm-29469-dgx-spark-ptxas-sm121a": ("log.triton.ptxas", None, ("TRITON_PTXAS_PATH",)),
    "triton-8539-dgx-spark-ptxas-sm121a": ("log.triton.ptxas", None, ("TRITON_PTXAS_PATH",)),
    "vllm-35091-spec-decode-triton-compilation-error": ("log.triton.compile", None, ("quant.kernel: dequantize",)),
    # 4. INT4 kernels
    "optimum-quanto-274-int4pack-cpu-expect-kbyte": ("log.int4.pack", None, ("quant.kernel: dequantize", "torch>=")),
    "pruna-32-flux-qint4-int4pack-kbyte": ("log.int4.pack", None, ("quant.kernel: dequantize",)),
    "torchchat-719-int4pack-not-implemented-mps": ("log.int4.pack", None, ("quant.kernel: dequantize", "torch>=")),
    "vllm-9913-awq-marlin-min-thread-k": ("log.int4.marlin", None, ("rollout.engine_tp",)),
    "llm-compressor-57-qwen2-72b-marlin-min-thread-k": ("log.int4.marlin", None, ("rollout.engine_tp",)),
    "glm45-94-marlin-size-n-tile-tp8": ("log.int4.marlin", None, ("rollout.engine_tp", "quant.kernel: dequantize")),
}
GPU_IDS = {"log.nccl.cpu", "log.cuda.graph", "log.triton.smem", "log.triton.ptxas", "log.triton.compile",
           "log.int4.pack", "log.int4.marlin"}


def real(name: str) -> str:
    return (REAL / f"{name}.log").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_kind_names_its_cause_fix_and_rank(name):
    root_id, rank, fix_names = CASES[name]
    result = triage_log(real(name))
    root = result.root_cause
    assert (root.id, root.status, root.rank) == (root_id, FAIL, rank)
    assert result.findings[0] is root
    assert all(n in root.fix for n in fix_names), root.fix
    assert root.title == BY_ID[root_id.removeprefix("log.")].cause
    # no longer "a rank raised an exception no signature knows"
    assert "log.exception" not in {f.id for f in result.findings}


def test_every_gpu_path_id_has_two_real_logs_in_the_index():
    index = json.loads((REAL / "index.json").read_text(encoding="utf-8"))["logs"]
    by_id: dict[str, set] = {}
    for entry in index:
        by_id.setdefault(entry["expected"], set()).add(entry["source"]["url"])
    kinds = {"collective": {"log.nccl.cpu"}, "cudagraph": {"log.cuda.graph"},
             "triton": {"log.triton.smem", "log.triton.ptxas", "log.triton.compile"},
             "int4": {"log.int4.pack", "log.int4.marlin"}}
    for ids in kinds.values():
        assert len(set().union(*(by_id.get(i, set()) for i in ids))) >= 2
    assert all(by_id.get(i) for i in GPU_IDS)
    assert {n for n in CASES} == {e["file"][:-4] for e in index if e["expected"] in GPU_IDS}


# The rank tags the real logs carry, on each kind's real error line
RANK_PREFIXES = [("[rank3]: ", 3), ("(Worker_TP7 pid=312) ERROR 10-17 14:02:34 [multiproc_executor.py:628] ", 7),
                 ("(Worker_TP3_EP3 pid=35672) ERROR 09-25 10:53:36 [multiproc_executor.py:585] ", 3),
                 ("(VllmWorker rank=5 pid=2421044) ERROR 07-29 14:10:52 [multiproc_executor.py:590] ", 5),
                 ("[2024-12-07 02:54:42 TP5] ", 5)]
ERROR_LINES = [
    ("RuntimeError: No backend type associated with device type cpu", "log.nccl.cpu"),
    ("RuntimeError: CUDA error: operation not permitted when stream is capturing", "log.cuda.graph"),
    ("RuntimeError: CUDA error: operation failed due to a previous error during capture", "log.cuda.graph"),
    ("triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 131072, Hardware limit: 65536. "
     "Reducing block sizes or `num_stages` may help.", "log.triton.smem"),
    ("ptxas fatal   : Value 'sm_100' is not defined for option 'gpu-name'", "log.triton.ptxas"),
    ("triton.compiler.errors.CompilationError: at 22:25:", "log.triton.compile"),
    ("RuntimeError: _convert_weight_to_int4pack_cpu : expect weight to be kByte.", "log.int4.pack"),
    ("RuntimeError: size_n = 2736 is not divisible by tile_n_size = 64", "log.int4.marlin"),
]


@pytest.mark.parametrize("prefix, rank", RANK_PREFIXES)
@pytest.mark.parametrize("line, root_id", ERROR_LINES)
def test_the_rank_on_the_error_line_is_reported(line, root_id, prefix, rank):
    root = triage_log(prefix + line).root_cause
    assert (root.id, root.rank) == (root_id, rank)
    assert f"rank(s) {rank};" in " ".join(root.evidence)


@pytest.mark.parametrize("text, root_id", [
    # the other forms, as quoted in dropbox/hqq#99, pytorch/pytorch#123997, pytorch/ao#1389, vllm-project/vllm#13640,
    # vllm-project/llm-compressor#54, state-spaces/mamba#387 and triton-inference-server/server#8632
    ("RuntimeError: Expected in.dtype() == at::kInt to be true, but got false. (Could this error message be improved? "
     "If so, please report an enhancement request to PyTorch.)", "log.int4.pack"),
    ("RuntimeError: _weight_int4pack_mm_cpu : expect A to be float16 or bfloat16 tensor.", "log.int4.pack"),
    ("Could not run 'aten::_convert_weight_to_int4pack' with arguments from the 'CPU' backend. This could be because the "
     "operator doesn't exist for this backend", "log.int4.pack"),
    ("ValueError: Weight input_size_per_partition = 14784 is not divisible by min_thread_k = 128. Consider reducing "
     "tensor_parallel_size or running with --quantization gptq.", "log.int4.marlin"),
    ("RuntimeError: prob_m = 59136 is not divisible by thread_m = 512", "log.int4.marlin"),
    ("triton.runtime.autotuner.OutOfResources: out of resource: shared memory, Required: 663808, Hardware limit: "
     "101376. Reducing block sizes or `num_stages` may help.", "log.triton.smem"),
    ("ptxas-blackwell fatal   : Value 'sm_110a' is not defined for option 'gpu-name'", "log.triton.ptxas"),
])
def test_related_forms(text, root_id):
    assert triage_log(text).root_cause.id == root_id


def test_an_oom_during_graph_capture_stays_an_oom():
    # vLLM ran out of memory while capturing its graphs: the capture is where, the memory is why
    root = triage_log(real("vllm-19186-cudagraph-capture-oom-raw")).root_cause
    assert root.id == "log.oom.raw"


def test_shared_memory_numbers_are_in_the_evidence():
    root = triage_log(real("sglang-8513-glm45-air-fp8-triton-out-of-shared-memory")).root_cause
    assert root.data["shared_memory"] == {"required": 147456, "limit": 101376}
    assert any("needs 147456 bytes of shared memory; the GPU has 101376" in e for e in root.evidence)


def test_ptxas_names_the_arch_it_did_not_know():
    result = triage_log(real("vllm-29469-dgx-spark-ptxas-sm121a"))
    assert result.root_cause.data["arch"] == "sm_121a"
    assert "this ptxas does not know sm_121a" in result.root_cause.evidence
    # the PTXASError line above it is the same failure, not a second cause
    compile_ = {f.id: f for f in result.findings}["log.triton.compile"]
    assert compile_.status == WARN and "the same failure: see log.triton.ptxas" in compile_.evidence


def test_marlin_names_the_size_and_the_tile():
    root = triage_log(real("glm45-94-marlin-size-n-tile-tp8")).root_cause
    assert root.data["marlin"] == {"size": 2736, "multiple_of": 64, "remainder": 48}


def test_fixes_name_real_profile_keys_and_values():
    from orbitctl.profile.schema import QuantSection, RolloutSection

    fixes = " ".join(BY_ID[i.removeprefix("log.")].fix for i in GPU_IDS)
    kernels = set(re.findall(r"quant\.kernel: (\w+)", fixes))
    assert kernels == {"dequantize"}
    for kernel in kernels:  # the profile takes the value the fix names ("dequantize", not a guess at its spelling)
        assert QuantSection.model_validate({"kernel": kernel}).kernel == kernel
    assert "rollout.decode_graphs: false" in fixes and "rollout.engine_tp" in fixes
    rollout = RolloutSection.model_validate({"decode_graphs": False, "engine_tp": 2})
    assert (rollout.decode_graphs, rollout.engine_tp) == (False, 2)


def test_the_torch_range_in_the_int4_fix_is_the_one_orbitctl_pins():
    pin = re.search(r'"(torch[^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert pin in BY_ID["int4.pack"].fix


@pytest.mark.parametrize("name", ["unsloth-zoo-129-broadcast-object-cpu-rank2",
                                  "club-3090-106-vllm-nightly-capture-unsupported-tp1",
                                  "mlcommons-training-pr826-b200-ptxas-sm100-rank6",
                                  "glm45-94-marlin-size-n-tile-tp8"])
def test_cli_prints_cause_and_fix(name, capsys):
    root_id, rank, _ = CASES[name]
    sig = BY_ID[root_id.removeprefix("log.")]
    path = str(REAL / f"{name}.log")
    assert main(["doctor", "--log", path]) == 1
    out = capsys.readouterr().out
    where = f" on rank {rank}" if rank is not None else ""
    assert f"Root cause: {root_id}{where}: " in out
    assert main(["doctor", "--log", path, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    rc = doc["root_cause"]
    assert (rc["id"], rc["rank"], rc["title"], rc["fix"]) == (root_id, rank, sig.cause, sig.fix)
