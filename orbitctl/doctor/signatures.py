"""The log signature table: id, regex, cause, fix, how bad, and how likely a root cause.

``priority`` ranks root causes above their consequences: hardware and start-up faults
(Xid, ECC, fabric, driver, arch) > memory > CUDA faults > NCCL transport errors > generic
NCCL errors > peers exiting > watchdog timeouts > communicator aborts. The RL stack's own
failures (engine KV cache, LoRA, ZeRO-3, checkpoint I/O, thread limits) rank with memory faults; the
GPU paths' (a CPU tensor in an NCCL collective, CUDA-graph capture, Triton and INT4 kernels: code or versions that
fail the same way every run) rank among the memory and CUDA faults (73-78), and Triton's ptxas not knowing the
GPU with arch;
``sync.ctx`` (INFO) and ``zero3.trace`` (WARN) are context that orbitctl.doctor.rules reads to
place a transport failure or a hang, and ``launcher`` (WARN) is only the launcher's summary of
a rank that exited. ``needles`` are
lowercase substrings one of which must be in a line before its regex runs (fast, and no
regex ever sees a line that cannot match). Every regex is linear: no nested quantifiers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from orbitctl.doctor.findings import FAIL, INFO, WARN

SIZE = r"[\d.]+ ?(?:[KMGTP]i?B|bytes|B)"

FAQ_OOM = ("Out of GPU memory: lower memory.micro_batch_size (raise memory.gradient_accumulation_steps to keep the "
           "global batch), keep memory.gradient_checkpointing: true, offload (memory.offload_optimizer: cpu, "
           "memory.offload_activations: cpu), shard with memory.zero_stage: 3, chunk the loss (memory.loss_chunk_size: 1024), "
           "and export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; re-plan with `orbitctl plan PROFILE`")
FAQ_COMM = ("Communication: rerun with export NCCL_DEBUG=INFO TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
            "to get a flight-recorder dump (analyse with `torchfrtrace <dir>`), `py-spy dump -n -p <pid>` on each rank, "
            "then run `orbitctl doctor --active` on the node")
FAQ_INSTABILITY = ("Training instability: keep bf16 (not fp16), warm up the learning rate (rl.warmup_steps: 1000), lower rl.lr, "
                   "clip gradients (rl.grad_clip: 1.0), keep the train/infer KL (rl.align_loss.weight: 0.1) and truncated IS "
                   "(rl.is_correction.kind: tis), and check `orbitctl verify-alignment PROFILE`")


# vLLM's two forms of "max_model_len does not fit the KV cache" (V0 counts tokens, V1 bytes and may estimate a length)
KV_LEN_V0 = (r"max seq len \((?P<len>\d+)\) is larger than the maximum number of tokens that can be stored in KV "
             r"cache \((?P<cap>\d+)\)")
KV_LEN_V1 = (r"To serve at least one request with the models?'s max seq len \((?P<len2>\d+)\), \((?P<need>[\d.]+ ?GiB) KV "
             r"cache is needed, which is larger than the available KV cache memory \((?P<avail>-?[\d.]+ ?GiB)\)"
             r"(?:\. Based on the available memory, the estimated maximum model length is (?P<est>\d+))?")

# SIGILL in every form a log shows it: the shell's and Python's faulthandler's text, the kernel's trap line (which names
# the library: "traps: python[12345] trap invalid opcode ip:... in libggml-cpu.so.0[...]"), launchers' exit codes
# (-4, 128 + 4 = 132) and signal names
SIGILL_RE = (r"(?i:illegal (?:hardware )?instruction)|trap invalid opcode(?:[^\n]{0,200}? in (?P<lib>[\w.+-]{1,120})\[)?|"
             r"exitcode\s*:\s*-4\b|exits with return code = -4\b|[Ss]ignal 4 \(SIGILL\)|<Signals\.SIGILL: 4>|\bSIGILL\b|"
             r"exit(?:ed with)? (?:code|status):? 132\b|non-zero exit status 132\b|\b(?:code|sys)=132\b")
SIGILL_CAUSE = ("illegal instruction (SIGILL): a native build for another CPU (compiled with -march=native / GGML_NATIVE "
                "on a machine with AVX-512 or AMX, or a wheel pip's cache reused from another CPU), or AMX tile "
                "instructions without the kernel's permission")
SIGILL_FIX = ("Rebuild the library for a portable baseline on this machine: llama-cpp-python: CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" "
              "pip install --force-reinstall --no-cache-dir llama-cpp-python (pip cache remove llama_cpp_python drops "
              "the wheel built on another CPU); other native code: build without -march=native. AMX: the process must "
              "call arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) before its first tile instruction. `orbitctl "
              "doctor` on the crashing node lists the CPU's ISA features and their OS state (host.isa)")
SIGILL_FIX_AMX = ("Request the tile state before using it: the process (every process that runs tile instructions) must "
                  "call arch_prctl(ARCH_REQ_XCOMP_PERM=0x1023, XFEATURE_XTILEDATA=18) first; oneDNN and torch do, a "
                  "library calling tile intrinsics itself must too. `orbitctl doctor` on that node shows the kernel's "
                  "answer (host.isa: amx rows 'granted on request', or 'refused' with the errno) and whether the CPU has "
                  "AMX at all ('absent': rebuild the library without AMX, llama.cpp: CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" "
                  "pip install --no-cache-dir, no GGML_AMX_*)")

# The ML stack whose packages must match each other; an ImportError from another package stays an ordinary exception.
STACK_PACKAGES = ("transformers", "trl", "vllm", "peft", "torch", "accelerate", "deepspeed", "bitsandbytes", "flash_attn",
                  "huggingface_hub", "tokenizers", "safetensors", "datasets", "triton", "xformers", "sglang", "optimum",
                  "diffusers", "torchvision", "torchaudio", "auto_gptq", "awq", "compressed_tensors")
_STACK = "|".join(STACK_PACKAGES)
PKG_MISMATCH_RE = (
    rf"cannot import name '(?P<name>\w{{1,120}})' from '(?P<pkg>(?:{_STACK})(?:\.[\w.]{{1,120}})?)'|"
    # transformers' own check of its dependencies: "peft>=0.5.0 is required for a normal functioning of this module,
    # but found peft==0.4.0."
    r"(?P<req>[A-Za-z][\w.-]{0,60}?)(?P<spec>[<>=!~]=?[\w.*+-]{1,40}(?:,[<>=!~]=?[\w.*+-]{1,40}){0,4}) is required for "
    r"a normal functioning of this module, but found (?P<found>[\w.-]{1,60}==[\w.+-]{1,40})|"
    # pip's resolver: "vllm 0.7.3 requires torch==2.5.1, but you have torch 2.4.0+cu124 which is incompatible."
    rf"(?P<a>(?:{_STACK})) (?P<aver>\d[\w.+-]{{0,40}}) requires (?P<b>[A-Za-z][\w.-]{{0,60}}?)(?P<bspec>[<>=!~]=?[^,\s]{{1,40}}"
    rf"(?:,[<>=!~]=?[^,\s]{{1,40}}){{0,4}}), but you have (?P<b2>[\w.-]{{1,60}}) (?P<bver>\S{{1,40}}) which is incompatible|"
    rf"(?P<a3>[A-Za-z][\w.-]{{0,60}}) (?P<aver3>\d[\w.+-]{{0,40}}) requires (?P<b3>(?:{_STACK}))(?P<bspec3>[<>=!~]=?[^,\s]{{1,40}}"
    rf"(?:,[<>=!~]=?[^,\s]{{1,40}}){{0,4}}), but you have (?P<b4>[\w.-]{{1,60}}) (?P<bver3>\S{{1,40}}) which is incompatible")
PINS = {"torch": ">=2.6,<=2.14.1", "transformers": ">=5.20,<6", "peft": ">=0.21,<0.22", "bitsandbytes": ">=0.50,<0.51",
        "deepspeed": ">=0.19,<0.20", "accelerate": ">=1.10", "safetensors": ">=0.5", "trl": ">=1.16,<2",
        "triton": ">=3.4"}
"""orbitctl's ranges in pyproject.toml (trl: the bench extra, triton: the test extra); tests/doctor keeps them equal."""
PKG_FIX = ("Install versions that go together, in one environment: orbitctl's pins (pyproject.toml) are torch>=2.6,<=2.14.1, "
           "transformers>=5.20,<6, peft>=0.21,<0.22, trl>=1.16,<2 (the bench extra): pip install -e '.[bench]' from "
           "orbitctl's checkout, then `pip check`. vLLM is not an orbitctl dependency and each vLLM wheel requires one "
           "exact torch (torch==): install the vLLM release built for the installed torch, or that torch, in the "
           "engine's own environment")

CUDA_TOOLKIT_RE = (r"The detected CUDA version \((?P<nvcc>[\d.]{1,12})\) mismatches the version that was used to compile"
                   r"(?:\s{1,20}PyTorch \((?P<torch>[\d.]{1,12})\))?|Installed CUDA version (?P<nvcc2>[\d.]{1,12}) does not "
                   r"match the version torch was compiled with (?P<torch2>[\d.]{1,12})|Cuda extensions are being compiled "
                   r"with a version of Cuda that does not match the version used to compile Pytorch binaries")
CUDA_TOOLKIT_FIX = ("Build with the toolkit torch was built with: compare `nvcc --version` with `python -c 'import torch; "
                    "print(torch.version.cuda)'` and point CUDA_HOME (and PATH) at that CUDA (e.g. "
                    "CUDA_HOME=/usr/local/cuda-12.8), or install the torch wheel for the installed toolkit (pip install "
                    "torch --index-url https://download.pytorch.org/whl/cu128, within orbitctl's torch>=2.6,<=2.14.1); "
                    "prebuilt wheels need no nvcc (DeepSpeed: DS_BUILD_OPS=0 builds its ops at first use). A driver "
                    "older than torch's CUDA is log.cuda.drv")
FLASH_ABI_FIX = ("Reinstall flash-attn built for the installed torch: pip install flash-attn --no-build-isolation "
                 "--no-cache-dir (compiles against this torch), or the prebuilt wheel whose name matches torch's version, "
                 "CUDA and C++ ABI (cxx11abiTRUE/FALSE: python -c 'import torch; print(torch.__version__, "
                 "torch.version.cuda, torch._C._GLIBCXX_USE_CXX11_ABI)'). orbitctl itself never loads flash-attn: "
                 "memory.flash_attention: true is PyTorch SDPA and false is eager attention (docs/train.md), so that key "
                 "does not avoid it; what loaded it is another library (a model's remote code, "
                 "attn_implementation='flash_attention_2', an engine), and pip uninstall flash-attn works when nothing "
                 "needs it")
EXT_ABI_FIX = ("Reinstall the extension for the installed torch (pip install --force-reinstall --no-cache-dir "
               "--no-build-isolation <package>, or the wheel built for this torch version), or install the torch it was "
               "built for; orbitctl's range is torch>=2.6,<=2.14.1")


@dataclass(frozen=True)
class Signature:
    id: str
    pattern: re.Pattern
    needles: tuple[str, ...]
    cause: str
    fix: str
    severity: str = FAIL
    priority: int = 50
    supersedes: tuple[str, ...] = ()
    """Ids of generic signatures this one replaces when both match the same line."""


def _sig(sid: str, regex: str, needles: tuple[str, ...], cause: str, fix: str, severity: str = FAIL,
         priority: int = 50, supersedes: tuple[str, ...] = (), flags: int = 0) -> Signature:
    return Signature(sid, re.compile(regex, flags), needles, cause, fix, severity, priority, supersedes)


SIGNATURES: list[Signature] = [
    # hardware and platform
    _sig("xid", r"NVRM: Xid \((?P<dev>[^)]{1,40})\): (?P<xid>\d{1,4})\b"
         r"(?:[^\n]{0,200}?caused by previous Xid (?P<prev>\d{1,4}))?|GPU has fallen off the bus|fallen off the bus",
         ("xid", "fallen off"), "NVIDIA driver fault (Xid)", "See the Xid's own fix", priority=100),
    _sig("cuda.ecc", r"uncorrectable ECC error encountered|cudaErrorECCUncorrectable", ("ecc",),
         "double-bit (uncorrectable) ECC error", "Drain the node, reset the GPU (sudo nvidia-smi -r -i <gpu>); RMA if it repeats",
         priority=97, supersedes=("cuda.err",)),
    _sig("cuda.802", r"system not yet initialized|cudaErrorSystemNotReady|CUDA_ERROR_SYSTEM_NOT_READY",
         ("not yet initialized", "systemnotready", "system_not_ready"), "NVSwitch fabric manager not running (CUDA error 802)",
         "sudo systemctl enable --now nvidia-fabricmanager (same version as the driver); wait for `nvidia-smi -q | grep -A2 Fabric` "
         "to say Completed", priority=95, supersedes=("cuda.err",)),
    _sig("cuda.nodev", r"no CUDA-capable device is detected|[Nn]o CUDA GPUs are available|Found no NVIDIA driver on your system|"
         r"cudaErrorNoDevice|"
         r"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver|CUDA driver initialization failed",
         ("cuda-capable", "no cuda gpus are available", "no nvidia driver", "nodevice", "nvidia-smi has failed", "driver initialization failed"),
         "no GPU visible to the process (driver not loaded, or the container has no GPUs)",
         "Check `nvidia-smi`; run containers with `--gpus all`; check CUDA_VISIBLE_DEVICES is not empty", priority=93, supersedes=("cuda.err",)),
    _sig("drv.mismatch", r"Driver/library version mismatch|API mismatch: the NVIDIA kernel module", ("mismatch",),
         "the NVIDIA kernel module and the user-space driver libraries differ (driver upgraded without reboot)",
         "Reboot the node (or unload and reload the nvidia kernel modules) so both driver halves match", priority=93),
    _sig("cuda.drv", r"driver on your system is too old \(found version (?P<found>\d+)\)|CUDA driver version is insufficient "
         r"for CUDA runtime version|cudaErrorInsufficientDriver|forward compatibility was attempted on non supported HW",
         ("too old", "insufficient", "forward compatibility"), "NVIDIA driver older than the CUDA version torch was built for",
         "Upgrade the driver (nvidia-smi shows the CUDA version it supports), or install a torch wheel for that CUDA: "
         "pip install torch --index-url https://download.pytorch.org/whl/cu121", priority=92, supersedes=("cuda.err",)),
    _sig("cuda.arch", r"no kernel image is available|is not compatible with the current PyTorch installation|"
         r"cudaErrorNoKernelImageForDevice|HIP error: invalid device function|hipErrorNoBinaryForGpu",
         ("no kernel image", "not compatible with the current pytorch", "nokernelimage", "invalid device function",
          "nobinaryforgpu"),
         "the torch (or extension) build has no kernels for this GPU's architecture",
         "Install a wheel built for this GPU's sm_XX (`python -c 'import torch; print(torch.cuda.get_arch_list())'`), "
         "e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128; rebuild custom extensions with "
         "TORCH_CUDA_ARCH_LIST set", priority=90, supersedes=("cuda.err",)),
    _sig("bnb", r"CUDA Setup failed despite (?:GPU|CUDA) being available|Could not find the bitsandbytes CUDA binary|"
         r"bitsandbytes was compiled without GPU support|libbitsandbytes_cpu\.so: undefined symbol|"
         r"Required library version not found: libbitsandbytes|CUDA SETUP: CUDA detection failed|"
         r"Could not load bitsandbytes native library|libbitsandbytes_cuda\d+\S{0,20}\.so: cannot open shared object|"
         r"CUDA_SETUP: WARNING! libcudart\.so not found|bitsandbytes library load error|Configured CUDA binary not found at|"
         r"CUDA SETUP: Setup Failed!|quantization requires (?:Accelerate: `pip install accelerate` and )?the latest version of "
         r"bitsandbytes",
         ("cuda setup", "cuda_setup", "bitsandbytes", "libbitsandbytes", "configured cuda binary"),
         "bitsandbytes cannot find a CUDA build matching this torch/CUDA",
         "pip install -U bitsandbytes; then `python -m bitsandbytes`; unset BNB_CUDA_VERSION unless you mean it; make "
         "sure LD_LIBRARY_PATH holds the libcudart that torch uses", priority=74),
    _sig("nccl.ver", r"Mismatched NCCL version detected : rank (?P<r1>\d+) version (?P<v1>\d+) rank (?P<r2>\d+) version (?P<v2>\d+)|"
         r"Mismatched NCCL version detected", ("mismatched nccl",), "ranks load different NCCL libraries",
         "Run every rank from one environment (same image/venv); unset LD_LIBRARY_PATH/LD_PRELOAD entries pointing at another "
         "libnccl", priority=85),
    # memory
    _sig("oom", r"(?:CUDA|HIP) out of memory|OutOfMemoryError|would exceed allowed memory\. \(out of memory\)",
         ("out of memory", "outofmemoryerror"),
         "GPU out of memory (allocator)", FAQ_OOM, priority=80),
    _sig("oom.raw", r"CUBLAS_STATUS_ALLOC_FAILED|CUDA [Ee]rror: out of memory|Cuda failure (?:2 )?'out of memory'|"
         r"cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|Failed to CUDA calloc|"
         r"CUBLAS_STATUS_NOT_INITIALIZED when calling `?cublasCreate|OOM when allocating tensor|RESOURCE_EXHAUSTED: Out of memory",
         ("alloc_failed", "out of memory", "memoryallocation", "out_of_memory", "cuda calloc", "not_initialized",
          "oom when allocating"),
         "GPU out of memory outside the PyTorch allocator (cuBLAS, NCCL or a kernel)",
         "Leave headroom: memory.max_hbm_utilization: 0.85; " + FAQ_OOM, priority=79, supersedes=("cuda.err", "oom", "nccl.cudaf")),
    # rollout engine start-up (vLLM, SGLang): every rank prints the same line
    _sig("oom.kv", r"No available memory for the cache blocks|Available KV cache memory: -(?P<neg>[\d.]+ ?GiB)|"
         r"is larger than the profiled value -(?P<tokens>\d+)|Not enough memory\. Please try to increase "
         r"--mem-fraction-static", ("cache blocks", "available kv cache memory: -", "profiled value -",
                                     "mem-fraction-static"),
         "the rollout engine has no GPU memory left for its KV cache (the budget after its weights is zero or negative)",
         "Give the engine more memory (vLLM gpu_memory_utilization, SGLang --mem-fraction-static) or need less: a smaller "
         "engine shard (rollout.engine_tp), rollout.kv_dtype: fp8, rollout.engine_sleep: true so the trainer's memory is "
         "freed while the engine starts", priority=79),
    _sig("kv.len", f"{KV_LEN_V0}|{KV_LEN_V1}", ("stored in kv cache", "kv cache is needed"),
         "the engine's max_model_len needs more KV cache than its memory budget holds",
         "Lower the engine's max_model_len (vLLM --max-model-len, SGLang --context-length) to what the run needs, or give "
         "the KV cache more memory (gpu_memory_utilization / --mem-fraction-static)", priority=79),
    _sig("kv.util", r"Free memory on device(?: (?P<dev>\S+))? \((?P<free>[\d.]+)/(?P<total>[\d.]+) ?GiB\) on startup is "
         r"less than desired GPU memory utilization \((?P<util>[\d.]+), (?P<want>[\d.]+) ?GiB\)",
         ("free memory on device",),
         "gpu_memory_utilization asks for more than is free: something else (a colocated trainer, another engine) holds "
         "GPU memory", "Lower the engine's gpu_memory_utilization below the free share, or start the engine before the "
         "trainer allocates (rollout.engine_sleep: true; stop stray processes: nvidia-smi)", priority=79),
    # LoRA adapters an engine refuses
    _sig("lora.rank", r"LoRA rank (?P<rank>\d+) is greater than max_lora_rank (?P<max>\d+)", ("max_lora_rank",),
         "the adapter's rank is above the engine's max_lora_rank",
         "Start the engine with a max_lora_rank at least the adapter's rank (vLLM --max-lora-rank; SGLang --max-lora-rank)",
         priority=83),
    _sig("lora.modules", r"expected target modules in .{0,2000}? but received|(?<![}\w])[\w.]+ is unsupported LoRA weight",
         ("expected target modules", "unsupported lora weight"),
         "the adapter adapts modules the engine cannot (lm_head, embeddings, vision tower or a renamed module)",
         "Adapt only the engine's supported projections (q/k/v/o, gate/up/down: adapter.targets: attention+mlp) and "
         "leave lm_head, embed_tokens and vision modules frozen, or merge the adapter into the base for rollout",
         priority=83),
    _sig("lora.unsupported", r"does not support LoRA(?:, but LoRA is enabled| yet)|LoRA is not supported (?:with|for) "
         r"quantiz|Target module \S+ is not supported", ("support lora", "lora is not supported", "target module"),
         "LoRA is not supported for this model architecture or quantization in this engine/library version",
         "Use an engine version that supports LoRA for this architecture/quantization, or merge the adapter into the base "
         "weights for rollout; for quantized bases use a quantization the adapter library wraps (bitsandbytes, GPTQ with "
         "a matching auto-gptq/optimum)", priority=83),
    _sig("lora.mismatch", r"size mismatch for [\w.]*lora_[AB][\w.]*: copying a param with shape torch\.Size\(\[(?!0\])"
         r"(?P<ck>[\d, ]{1,40})\]\) from checkpoint, the shape in current model is torch\.Size\(\[(?!0\])"
         r"(?P<cur>[\d, ]{1,40})\]\)", ("lora_a", "lora_b"),
         "the adapter was trained on a different base model (its LoRA shapes do not match this base)",
         "Load the adapter on the base it was trained from (adapter_config.json: base_model_name_or_path); check "
         "model.arch and the checkpoint path", priority=82),
    # DeepSpeed ZeRO-3
    _sig("zero3.gather", r"'status': 'NOT_AVAILABLE'|ds_status == ZeroParamStatus\.AVAILABLE|'weight' must be 2-D|"
         r"The size of tensor [ab] \(0\) must match|object has no attribute 'ds_(?:tensor|id|numel)'",
         ("not_available", "zeroparamstatus", "must be 2-d", "(0) must match", "'ds_"),
         "a ZeRO-3 partitioned parameter was used outside a gather (its local shard is empty)",
         "Run the model through the DeepSpeed engine (not a submodule or an unwrapped copy); gather what is read directly "
         "with deepspeed.zero.GatheredParameters(params) (TRL: unwrap_model_for_generation); initialise reference/teacher "
         "models with deepspeed.initialize too; or use memory.zero_stage: 2", priority=77),
    _sig("zero3.ckpt", r"copying a param with shape torch\.Size\(\[0\]\) from checkpoint|the shape in current model is "
         r"torch\.Size\(\[0\]\)", ("torch.size([0])",),
         "a ZeRO-3 checkpoint mismatch: empty partitioned shards were saved, or a checkpoint was loaded into a partitioned model",
         "Save full weights under ZeRO-3 (stage3_gather_16bit_weights_on_model_save: true, accelerator.get_state_dict, or "
         "zero_to_fp32.py); load with from_pretrained under deepspeed.zero.Init or engine.load_checkpoint, not "
         "load_state_dict on the partitioned model", priority=77),
    _sig("zero3.hang", r"\b(?:all_gather_coalesced|fetch_sub_module|__all_gather_params_?) \(\S{0,200}deepspeed/runtime/zero/",
         ("deepspeed/runtime/zero/",), "a rank is stuck in a ZeRO-3 parameter all-gather (the ranks run different modules)",
         "Make every rank run the same modules in the same order (no rank-dependent generate() lengths or branches; with "
         "generate() under ZeRO-3 use synced_gpus=True); if it persists set stage3_prefetch_bucket_size: 0 or "
         "memory.zero_stage: 2; py-spy dump -n -p <pid> on every rank shows who is elsewhere", priority=25),
    _sig("zero3.trace", r"Invalidate trace cache @ step \d+: expected module \d+, but got module \d+", ("invalidate trace cache",),
         "ZeRO-3's prefetch trace changed: modules ran in a different order than the step before",
         "Harmless alone (generate/eval steps); with collective timeouts after it, the ranks diverged: see log.zero3.hang",
         severity=WARN, priority=24),
    # a bare "Killed" is the shell's report of SIGKILL, also glued to the progress bar it cut ("3/8 [00:02<...]Killed")
    _sig("host.oom", r"exits with return code = -9|exitcode\s*:\s*-9\b|Killed process \d+|Out of memory: Kill|"
         r"Signal 9 \(SIGKILL\) received by PID|terminated with signal SIGKILL|oom-kill:|^\s*Killed\s*$|\]Killed\s*$|"
         r"is killed by signal: Killed",
         ("-9", "killed process", "out of memory: kill", "sigkill", "oom-kill", "killed"),
         "host RAM exhausted: the kernel's OOM killer sent SIGKILL (exit code -9)",
         "Check `dmesg | grep -i 'killed process'`; reduce host memory: memory.offload_optimizer/offload_params: none or a "
         "smaller model shard per process, fewer dataloader workers, load checkpoints with low_cpu_mem_usage; or add RAM/swap",
         priority=78, supersedes=("oom", "launcher"), flags=re.M),
    # Ray's memory monitor (the raylet kills a worker before the kernel would): the worker's exit detail, the
    # driver's ray.exceptions.OutOfMemoryError around it, and the raylet's periodic summary. Host RAM, not GPU
    # memory; triage files it under log.host.oom with this cause and fix.
    _sig("ray.oom", r"which exceeds the memory usage threshold of (?P<thr>\d+(?:\.\d+)?)|Ray killed this worker \(ID:|"
         r"Task was killed due to the node running low on memory|killed due to memory pressure \(OOM\)|"
         r"ray\.exceptions\.OutOfMemoryError",
         ("memory usage threshold", "ray killed this worker", "running low on memory", "memory pressure (oom)",
          "ray.exceptions.outofmemoryerror"),
         "host RAM exhausted: Ray's memory monitor killed a worker (the node's memory use passed "
         "RAY_memory_usage_threshold)",
         "Need less host RAM per node: fewer Ray workers or actors per node (request more CPUs per task), "
         "memory.offload_optimizer/offload_params/offload_activations: none (offloading keeps those states in host "
         "RAM), or a node with more RAM; only when the usage is expected, raise the threshold when starting Ray "
         "(RAY_memory_usage_threshold=0.98; RAY_memory_monitor_refresh_ms=0 turns the monitor off and leaves the "
         "kernel's OOM killer); `ray logs raylet.out -ip <node>` lists the top memory users",
         priority=81, supersedes=("oom", "host.oom", "ray.died", "launcher")),
    # Ray: a worker that died, and the thread/process limit that Ray's generic hint blames on the OOM killer
    _sig("ray.threads", r"pthread_create failed|[Tt]hread creation failed: Resource temporarily unavailable|"
         r"thread: Resource temporarily unavailable|can't start new thread|Failed to create new thread|fork: retry: "
         r"(?:Resource temporarily unavailable|No child processes)|RLIMIT_NPROC",
         ("pthread_create", "thread creation failed", "thread: resource temporarily", "start new thread",
          "create new thread", "fork: retry", "rlimit_nproc"),
         "the process/thread limit was hit (Resource temporarily unavailable): not the OOM killer Ray's hint names",
         "Raise the limit: ulimit -u 65535 (and the container's --pids-limit / cgroup pids.max); create fewer threads: "
         "export OMP_NUM_THREADS=1 RAY_num_server_call_thread=1 RAY_worker_num_grpc_internal_threads=1, fewer DataLoader "
         "workers; check with `ulimit -u` and `ps -eLf | wc -l`", priority=77),
    _sig("ray.died", r"The actor died unexpectedly before finishing this task|The actor is dead because its worker "
         r"process has died|A worker died or was killed while executing (?:a )?task|Worker unexpectedly exits with a "
         r"connection error code", ("actor died", "actor is dead", "worker died", "worker unexpectedly exits"),
         "a Ray actor's worker process died; its own reason is not in this log",
         "Ray's hint (OOM killer, ray stop, SIGSEGV) lists possibilities, not the cause: read the dead worker's log "
         "(/tmp/ray/session_latest/logs/worker-*-<pid>.err, raylet.out) and `dmesg -T | tail`; rerun with "
         "RAY_DEDUP_LOGS=0", severity=WARN, priority=31),
    # checkpoint and run-directory I/O
    _sig("ckpt.nospace", r"No space left on device|\[Errno 28\]|Disk quota exceeded|\[Errno 122\]",
         ("no space left", "errno 28", "disk quota", "errno 122"), "the disk (or quota) is full",
         "Free space on the run/checkpoint filesystem (`df -h <run.dir>`, `du -sh <run.dir>/*`); keep fewer "
         "checkpoints (save_total_limit), point run.dir at a larger volume; the HF/torch caches (HF_HOME, TMPDIR) "
         "count too", priority=77),
    _sig("ckpt.write", r"PytorchStreamWriter failed writing file|write\(\): fd \d+ failed with|File \S+ cannot be opened\.",
         ("pytorchstreamwriter", "write(): fd", "cannot be opened"),
         "writing the checkpoint failed (usually a full disk or quota; else a flaky network filesystem)",
         "Check free space and quota on the checkpoint path (`df -h`, `quota -s`) and that the directory exists and is "
         "writable; save to local disk, then copy", priority=76),
    _sig("ckpt.corrupt", r"Error while deserializing header: \w+|incomplete metadata, file not fully covered|"
         r"PytorchStreamReader failed reading zip archive|invalid load key, '",
         ("deserializing header", "incomplete metadata", "pytorchstreamreader", "invalid load key"),
         "a checkpoint/weights file is truncated or corrupt (interrupted download or save)",
         "Delete and re-download the file (huggingface-cli download --force-download, or remove it from HF_HOME); for a "
         "run's own checkpoint resume from the previous one and check the disk did not fill while saving", priority=77),
    _sig("ckpt.perm", r"PermissionError: \[Errno 13\]|\[Errno 30\] Read-only file system|OSError: \[Errno 13\] "
         r"Permission denied", ("errno 13", "errno 30"), "no permission to write the run or checkpoint directory",
         "Check the owner and mode of the path (ls -ld), whether it is mounted read-only, and the user the job runs as; "
         "set run.dir to a writable directory", priority=77),
    _sig("train.nan", r"Current loss scale already at minimum|loss'?\"?(?: is|=|:)\s*(?:nan|inf)\b|non-finite loss|"
         r"Detected NaN|nan or inf (?:found|detected)|returned nan values in its \d+\w* output|"
         r"grad[_ ]norm'?\"?:\s*(?:nan|inf)\b", ("loss scale already at minimum", "nan", ": inf", ":inf", "=inf", "= inf",
                                                " is inf"),
         "training diverged (NaN/inf loss)", FAQ_INSTABILITY, priority=65, flags=re.I),
    # a scale that halves to its floor is a collapse; one that settles high is routine fp16 start-up
    _sig("train.scale", r"Attempted loss scale: (?P<from>[\d.]+(?:e[-+]?\d+)?), reducing to (?P<to>[\d.]+(?:e[-+]?\d+)?)|"
         r"reducing loss scale to (?P<to2>[\d.]+(?:e[-+]?\d+)?)", ("attempted loss scale", "reducing loss scale"),
         "the fp16 loss scale collapsed to its floor: every step overflows", "Stop fp16: train in bf16 (model.dtype: "
         "bf16); if fp16 is required, lower rl.lr, clip gradients (rl.grad_clip: 1.0) and look for the first inf/NaN "
         "(loss, logits, advantages); " + FAQ_INSTABILITY, priority=64),
    _sig("ds.flush", r"(?P<n>\d+) pytorch allocator cache flushes since last step", ("cache flushes",),
         "near-OOM: DeepSpeed ZeRO-3 had to flush the allocator cache",
         "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; lower memory.micro_batch_size or memory.prefetch_layers",
         severity=WARN, priority=40),
    _sig("host.sigbus", r"exits with return code = -7\b|exitcode\s*:\s*-7\b|Signal 7 \(SIGBUS\)|Bus error",
         ("-7", "sigbus", "bus error"), "SIGBUS: shared memory (/dev/shm) ran out under a worker or NCCL",
         "docker run --shm-size=16g ... (Kubernetes: emptyDir medium: Memory on /dev/shm); fewer DataLoader workers",
         priority=71, supersedes=("launcher",)),
    _sig("host.segv", r"exits with return code = -11\b|exitcode\s*:\s*-11\b|Signal 11 \(SIGSEGV\)|Segmentation fault",
         ("-11", "sigsegv", "segmentation fault"), "a native crash (SIGSEGV), usually a compiled extension built for another "
         "torch/CUDA", "Reinstall compiled extensions against this torch (flash-attn, DeepSpeed ops: DS_BUILD_OPS=0, "
         "bitsandbytes); run under `python -X faulthandler` to see the crashing frame", priority=62, supersedes=("launcher",)),
    # the environment's crashes: a native build for another CPU (or AMX without permission), packages that do not go
    # together, a CUDA toolkit other than torch's, an extension built against another torch
    _sig("host.sigill", SIGILL_RE, ("illegal", "invalid opcode", "-4", "sigill", "132"), SIGILL_CAUSE, SIGILL_FIX,
         priority=88, supersedes=("launcher",)),
    _sig("pkg.mismatch", PKG_MISMATCH_RE, ("cannot import name", "normal functioning", "but you have"),
         "two installed packages do not go together (one was built for another version of the other)", PKG_FIX,
         priority=87),
    _sig("cuda.toolkit", CUDA_TOOLKIT_RE, ("detected cuda version", "installed cuda version",
                                           "cuda extensions are being compiled"),
         "the CUDA toolkit (nvcc) that builds an extension differs from the CUDA torch was built with", CUDA_TOOLKIT_FIX,
         priority=91),
    _sig("flash.abi", r"(?<![\w.+-])(?P<lib>flash_attn[\w-]{0,40})[\w.-]{0,80}\.so: undefined symbol: (?P<sym>\w{1,300})",
         ("undefined symbol",), "flash-attn was built against another torch (or C++ ABI) than the one installed",
         FLASH_ABI_FIX, priority=88, supersedes=("ext.abi",)),
    _sig("ext.abi", r"(?<![\w.+-])(?P<lib>[\w.+-]{1,120}\.so(?:\.\d+)*): undefined symbol: "
         r"(?P<sym>_ZNK?(?:3c10|2at|5torch)\w{0,300})",
         ("undefined symbol",), "a compiled extension was built against another torch than the one installed (its torch "
         "symbols are missing)", EXT_ABI_FIX, priority=86),
    _sig("cuda.ordinal", r"invalid device ordinal|cudaErrorInvalidDevice", ("invalid device ordinal", "invaliddevice"),
         "a rank asked for a GPU index that does not exist (more ranks than visible GPUs)",
         "Launch no more ranks per node than GPUs (torchrun --nproc-per-node = GPU count); check CUDA_VISIBLE_DEVICES and "
         "that each rank calls torch.cuda.set_device(local_rank)", priority=86, supersedes=("cuda.err",)),
    # CUDA faults
    _sig("cuda.assert", r"device-side assert triggered|cudaErrorAssert|block: \[\d+,\d+,\d+\], thread: \[\d+,\d+,\d+\] Assertion",
         ("device-side assert", "cudaerrorassert", "assertion"), "a device-side assert: an index or label out of range",
         "Rerun with CUDA_LAUNCH_BLOCKING=1 (or on CPU) to see the failing op; check token ids < vocab size and label ranges",
         priority=76, supersedes=("cuda.err", "nccl.cudaf",)),
    _sig("cuda.ima", r"an illegal memory access was encountered|cudaErrorIllegalAddress",
         ("illegal memory access", "illegaladdress"), "illegal memory access in a CUDA kernel (software bug or hardware fault)",
         "Rerun with CUDA_LAUNCH_BLOCKING=1 and `compute-sanitizer`; check the kernel log for Xid 13/31/48/79 "
         "(`dmesg | grep -i xid`) to rule out hardware", priority=75, supersedes=("cuda.err", "nccl.cudaf",)),
    _sig("cuda.launch", r"unspecified launch failure|cudaErrorLaunchFailure", ("unspecified launch failure", "launchfailure"),
         "a CUDA kernel crashed (unspecified launch failure)",
         "Check the kernel log for Xid 13/31/43/79 (`dmesg | grep -i xid`); rerun with CUDA_LAUNCH_BLOCKING=1",
         priority=64, supersedes=("cuda.err", "nccl.cudaf",)),
    # the GPU paths: a collective given a CPU tensor, CUDA-graph capture, Triton kernels, INT4 kernels. Each is a
    # deterministic failure of code or versions (the same run fails the same way), so each outranks what follows it
    _sig("nccl.cpu", r"No backend type associated with device type cpu\b", ("no backend type associated",),
         "a CPU tensor was passed to a collective of an NCCL-only process group (NCCL takes CUDA tensors; the group "
         "has no gloo backend for cpu)",
         "Send every collective through orbitctl/dist/collectives.py (the one helper: scalars travel on "
         "group_device(group), the device the group's backend takes, cuda for nccl) instead of calling "
         "torch.distributed on a CPU tensor; `pytest -k rehearsal` (the CUDA rehearsal on the CPU) fails on such a "
         "call, naming its file and line, before a GPU run. In other code: "
         "move the tensor to torch.cuda.current_device() first, or create the group with "
         "backend=\"cpu:gloo,cuda:nccl\"", priority=73),
    _sig("cuda.graph", r"operation not permitted when stream is capturing|cudaErrorStreamCapture\w{2,20}|"
         r"CUDA_ERROR_STREAM_CAPTURE_\w{2,20}|during CUDA graph capture|operation failed due to a previous error during "
         r"capture|capturing stream has unjoined work",
         ("stream is capturing", "streamcapture", "stream_capture", "during cuda graph capture",
          "previous error during capture", "unjoined work"),
         "CUDA-graph capture failed: an op in the captured step cannot be captured (a host sync such as .item(), "
         ".cpu() or a blocking copy, a data-dependent shape, an RNG state read, a copy from unpinned CPU memory, or an "
         "eager collective)",
         "Decode eagerly: set rollout.decode_graphs: false (an engine's own graphs: vLLM --enforce-eager, SGLang "
         "--disable-cuda-graph). The rehearsal's capturability check (Rehearsal.capturable, `pytest -k rehearsal`) "
         "names the op and its line: a host sync or a data-dependent shape in the captured decode step. 'operation "
         "failed due to a previous error during capture' (cudaErrorStreamCaptureInvalidated) follows an earlier error: "
         "read the first one above it",
         priority=76, supersedes=("cuda.err", "nccl.cudaf", "nccl.cuda")),
    _sig("triton.smem", r"(?:OutOfResources: )?out of resource: (?P<res>[a-z ]{1,30}), Required: (?P<req>\d+)"
         r"[, ]{1,4}Hardware limit(?:ation)?: (?P<limit>\d+)|OutOfResources: out of resource", ("out of resource",),
         "a Triton kernel's tile needs more shared memory than this GPU has: its block sizes and num_stages were "
         "tuned for a larger GPU",
         "orbitctl's grouped INT4 MoE kernel is a Triton kernel: set quant.kernel: dequantize to fall back from it to "
         "dequantize + matmul. An engine's kernel (vLLM/SGLang fused MoE, FP8 block matmul): the engine version with a "
         "tuned config for this GPU, or fewer num_stages / smaller BLOCK sizes in its kernel config", priority=77),
    _sig("triton.ptxas", r"ptxas(?:-blackwell)? fatal\s{0,8}: Value '(?P<arch>sm_\w{1,8})' is not defined for option "
         r"'gpu-name'", ("ptxas",),
         "Triton's ptxas does not know this GPU's architecture: the Triton (or CUDA toolkit) is older than the GPU",
         "Give Triton a ptxas that knows the GPU: export TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas from a CUDA "
         "toolkit new enough for it (sm_100 and sm_120 need CUDA 12.8+), or install a Triton (with its torch) built "
         "for it; until then quant.kernel: dequantize keeps orbitctl's grouped INT4 kernel off Triton", priority=89,
         supersedes=("triton.compile",)),
    _sig("triton.compile", r"CompilationError(?::|\(')\s?at \d+:\d+:|triton\.compiler\.errors\.CompilationError|"
         r"PTXASError: PTXAS error|Internal Triton PTX codegen error",
         ("compilationerror", "ptxaserror", "internal triton ptx codegen error"),
         "Triton could not compile a kernel (the kernel and this Triton version disagree, or the kernel does not "
         "support this dtype, shape or GPU)",
         "If it is orbitctl's grouped INT4 kernel (orbitctl/kernels/grouped_int4.py), set quant.kernel: dequantize; "
         "otherwise run the Triton this torch was built with (install torch and triton from one index; "
         "`python -c 'import torch, triton; print(torch.__version__, triton.__version__)'`) and an engine version "
         "tested with it", priority=74),
    _sig("int4.pack", r"_convert_weight_to_int4pack\w{0,12} ?: expect weight to be k\w{2,10}|"
         r"Expected in\.dtype\(\) == at::k(?:Byte|Int) to be true|_weight_int4pack_mm\w{0,12} ?: expect \w{1,20} to be|"
         r"Could not run 'aten::_(?:convert_weight_to_int4pack|weight_int4pack_mm)\w{0,12}' with arguments from the "
         r"'(?P<backend>\w{1,40})' backend|operator 'aten::_(?:convert_weight_to_int4pack|weight_int4pack_mm)\w{0,12}' "
         r"is not currently implemented for the (?P<device>\w{1,20}) device|object has no attribute "
         r"'_(?:convert_weight_to_int4pack|weight_int4pack_mm)\w{0,12}'", ("int4pack", "in.dtype() == at::k"),
         "torch's INT4 packing API changed under this code: _convert_weight_to_int4pack takes uint8 [n, k/2] since "
         "torch 2.5 (int32 [n, k] before), the CPU ops became _convert_weight_to_int4pack_for_cpu / "
         "_weight_int4pack_mm_for_cpu in 2.6, and a backend without the op (MPS, or CPU for the CUDA op) cannot run it",
         "Set quant.kernel: dequantize (no packed INT4 kernel), or install the torch orbitctl supports "
         "(pyproject.toml: torch>=2.6,<=2.14.1; orbitctl/kernels/int4_kernel.py packs for that torch's layout); a library "
         "built against another torch's packing (torchao, optimum-quanto, hqq, gpt-fast) needs the torch it was built "
         "for", priority=77),
    _sig("int4.marlin", r"(?:size|prob)_[mnk] = (?P<size>\d+) is not divisible by (?P<by>tile_[nk]_size|thread_[mnk]) = "
         r"(?P<div>\d+)|Weight (?:in|out)put_size_per_partition = (?P<size2>\d+) is not divisible by "
         r"(?P<by2>min_thread_[nk]|min_[nk]_threads) = (?P<div2>\d+)|Invalid thread config: thread_m_blocks",
         ("is not divisible by tile_", "is not divisible by thread_", "is not divisible by min_", "invalid thread config"),
         "the Marlin kernel (GPTQ/AWQ INT4, and FP8 on GPUs before Hopper) cannot take this weight's per-rank shape: "
         "the tensor-parallel slice is not a multiple of its tile",
         "Use a rollout.engine_tp whose slices divide (Marlin needs a rank's N divisible by 64 and K by 128; usually a "
         "smaller engine_tp), or start the engine without Marlin (vLLM --quantization gptq or awq instead of "
         "gptq_marlin / awq_marlin); orbitctl's own INT4 path has no Marlin (quant.kernel: dequantize is its "
         "fallback)", priority=78),
    # NCCL transport and setup
    _sig("nccl.shm", r"(?:creating|attaching to) shared memory segment|failed to extend /dev/shm|posix_fallocate failed|"
         r"shm_open failed|ncclShmOpen|insufficient shared memory \(shm\)",
         ("shared memory segment", "/dev/shm", "posix_fallocate", "shm_open", "shmopen", "shared memory (shm)"),
         "/dev/shm too small or full", "docker run --shm-size=16g ... (Kubernetes: emptyDir medium: Memory on /dev/shm); "
         "rm -f /dev/shm/nccl-*; or export NCCL_SHM_DISABLE=1", priority=72, supersedes=("nccl.cudaf", "ckpt.nospace")),
    _sig("nccl.if", r"no socket interface found|No usable listening interface|Bootstrap : no \S+ interface found|"
         r"NCCL_SOCKET_IFNAME\S* \S* ?not found|is neither AF_INET|[Nn]o (?:usable )?(?:socket |listening )?interface found|"
         r"Socket creation failed : Address family not supported", ("interface", "af_inet", "address family not supported"),
         "NCCL found no usable network interface (NCCL_SOCKET_IFNAME wrong)",
         "List interfaces with `ip -br addr`; export NCCL_SOCKET_IFNAME=<iface> (one node: export NCCL_SOCKET_IFNAME=lo)",
         priority=72),
    _sig("nccl.p2p", r"peer access is not supported between these two devices", ("peer access",),
         "GPU peer-to-peer blocked (ACS/IOMMU, consumer GPUs, or each rank sees one GPU)",
         "export NCCL_P2P_DISABLE=1 (or disable ACS / boot with iommu=pt); if it comes from transport/shm.cc: "
         "export NCCL_SHM_DISABLE=1 or NCCL_CUMEM_ENABLE=0", priority=71, supersedes=("cuda.err", "nccl.cudaf",)),
    _sig("port", r"failed to (?:listen on|bind to) \S{1,80} \(errno: 98|EADDRINUSE|[Aa]ddress already in use",
         ("errno: 98", "eaddrinuse", "address already in use"), "MASTER_PORT already in use (a stale job still listens)",
         "ss -ltnp 'sport = :29500' and kill the stale job; or pick another port: torchrun --master_port 29501 "
         "(export MASTER_PORT=29501)", priority=70),
    _sig("nccl.ib", r"NET/IB\w* ?: ?Got completion|NCCL WARN NET/IB\w* ?: (?P<detail>.{1,200})|Call to ibv_\w+ failed|"
         r"mlx5: \S{1,80}: got completion with error", ("net/ib", "ibv_", "got completion with error"), "InfiniBand/RoCE transport error",
         "Check the fabric: `ibstat`, `ibv_devinfo`, cables and switch ports; on one node: export NCCL_IB_DISABLE=1", priority=68),
    _sig("ddp.unused", r"Expected to have finished reduction in the prior iteration|"
         r"parameters that were not used in producing loss", ("finished reduction", "not used in producing loss"),
         "DDP: some parameters got no gradient in this step",
         "Make every trainable parameter take part in the loss, or wrap with find_unused_parameters=True "
         "(static_graph=True when the set never changes)", priority=56),
    _sig("nccl.desync", r"Detected mismatch between collectives on ranks|collective sequence number mismatch|"
         r"CollectiveFingerPrint\(.{0,200}?\) mismatch", ("mismatch between collectives", "sequence number mismatch",
                                                           "fingerprint"),
         "ranks called different collectives (desynchronised code paths)",
         "Make every rank run the same collectives in the same order (no rank-dependent branches around all_reduce/"
         "barrier); debug with TORCH_DISTRIBUTED_DEBUG=DETAIL", priority=57),
    _sig("dist.store", r"Timed out after \d+ seconds waiting for clients|Timed out initializing process group in store based "
         r"barrier|wait timeout after \d+ms, keys|DistStoreError|Socket Timeout|The client socket has timed out|"
         r"RendezvousTimeoutError|retrieving ncclUniqueId from \[\d+\] via c10d key-value store",
         ("timed out", "wait timeout", "diststoreerror", "socket timeout", "rendezvoustimeouterror", "nccluniqueid"),
         "rendezvous timed out: not every rank reached init_process_group",
         "Check MASTER_ADDR/MASTER_PORT are reachable from every node and that all ranks started; see the first error of the "
         "rank that did not join", priority=55),
    _sig("nccl.dupgpu", r"Duplicate GPU detected", ("duplicate gpu",), "two ranks use the same GPU",
         "Give each rank its own GPU: torch.cuda.set_device(local_rank) before init_process_group; launch no more ranks "
         "than GPUs", priority=84),
    _sig("cuda.err", r"CUDA error: (?P<err>[^\n.]{1,120})", ("cuda error:",),
         "a CUDA error (see its text)", "Check the kernel log for Xid (`dmesg | grep -i xid`); rerun with "
         "CUDA_LAUNCH_BLOCKING=1 to find the failing kernel", priority=58),
    _sig("nccl.usage", r"ncclInvalidUsage|invalid usage \(run with", ("invalidusage", "invalid usage"),
         "NCCL invalid usage (mismatched collective arguments, or a rank/GPU mapping error)",
         "Check that every rank calls the same collectives with the same shapes and dtypes, and that each rank has its own "
         "GPU; rerun with NCCL_DEBUG=WARN", priority=46, supersedes=("nccl.err",)),
    _sig("nccl.cudaf", r"NCCL WARN Cuda failure (?:\d+ )?'(?P<err>[^']{1,200})'", ("cuda failure",),
         "a CUDA call inside NCCL failed", "Read the CUDA error named in the line; check `dmesg | grep -i xid`", priority=60),
    _sig("nccl.sys", r"unhandled system error|ncclSystemError", ("system error", "ncclsystemerror"),
         "NCCL system error (socket, shared memory or a peer that exited)",
         "Read the `Last error:` line; " + FAQ_COMM, priority=48, supersedes=("nccl.err",)),
    _sig("nccl.cuda", r"unhandled cuda error|ncclUnhandledCudaError", ("unhandled cuda error", "ncclunhandledcudaerror"),
         "a CUDA failure inside NCCL", "Read the `Last error:` / `Cuda failure` line; check `dmesg | grep -i xid`",
         priority=48, supersedes=("nccl.err",)),
    _sig("nccl.int", r"ncclInternalError|internal error - please report", ("internalerror", "internal error - please report"),
         "NCCL internal error (often bootstrap or interface selection)",
         "export NCCL_SOCKET_IFNAME=<iface> (one node: lo); rerun with NCCL_DEBUG=INFO", priority=47, supersedes=("nccl.err",)),
    _sig("nccl.err", r"NCCL error(?: in: (?P<file>\S+),|:) (?P<err>[^,\n]{1,200})(?:, NCCL version (?P<ver>\S+))?",
         ("nccl error",), "an NCCL call failed", "Read the lines after it (`Last error:`); " + FAQ_COMM, priority=45),
    _sig("nccl.sock", r"Connect to \S+ failed|Call to connect failed|Connection closed by remote peer|Connection reset by peer|"
         r"socketProgress(?:Opt)?: Call to recv|Connection closed by peer", ("connect to", "call to connect", "connection closed", "connection reset",
                                                                            "socketprogress"),
         "a socket to a peer rank broke (the peer died or the network dropped)",
         "Find the first error of the peer rank; check the network and NCCL_SOCKET_IFNAME", priority=30),
    _sig("nccl.remote", r"ncclRemoteError|remote process exited", ("ncclremoteerror", "remote process exited"),
         "a peer rank exited or its network failed", "Find the first error of the rank that exited (it is the cause)",
         priority=32, supersedes=("nccl.err",)),
    _sig("nccl.stuck", r"watchdog got stuck for (?P<s>\d+) seconds|Heartbeat monitor timed out",
         ("got stuck", "heartbeat monitor timed out"), "the NCCL watchdog itself hung (a CUDA/NCCL API call blocked)",
         "Check the kernel log for Xid; py-spy dump -n -p <pid>; raise TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC only if it is a "
         "false alarm", priority=18),
    # a pasted line cut before "ran for" still names the timed-out work
    _sig("nccl.timeout", r"Watchdog caught collective operation timeout: WorkNCCL\((?P<a>.{0,400}?)"
         r"(?:\) ran for (?P<ms>\d+) milliseconds|$)|Work WorkNCCL\((?P<a2>.{0,400}?)\) timed out in blocking wait",
         ("watchdog caught", "blocking wait"),
         "a collective timed out: one rank did not join it (crashed, hung, or desynchronised)", FAQ_COMM, priority=20),
    _sig("nccl.pg", r"[Ll]ast enqueued (?:NCCL )?work: (?P<enq>-?\d+), last completed (?:NCCL )?work: (?P<done>-?\d+)",
         ("last enqueued",), "per-rank progress of the process group", "The rank with the lowest completed work is the straggler",
         severity=WARN, priority=19),
    _sig("nccl.abort", r"NCCL communicator was aborted on rank (?P<r>\d+)|communicator was aborted|"
         r"Some NCCL operations have failed or timed out|we are taking the entire process down",
         ("communicator was aborted", "some nccl operations", "entire process down"), "communicator aborted after an earlier failure", "Find the first failure", priority=10),
    # context lines: the trainer pushing weights or adapters to a rollout engine (used to place a transport failure)
    _sig("sync.ctx", r"update weight: |\bupdate_weights?\b|_broadcast_to_vllm|_model_update_group|model_update_group|"
         r"update_named_param|_move_model_to_vllm|update_weights_from_(?:distributed|tensor|disk)|sync_model_weights|"
         r"\bsync_weights\b|init_weight_update_group|sync_model_from_actor|broadcast_weights",
         ("update weight", "update_weight", "broadcast_to_vllm", "model_update_group", "update_named_param",
          "move_model_to_vllm", "update_weights_from", "sync_model", "sync_weights", "weight_update_group",
          "broadcast_weights"),
         "the trainer is syncing weights to the rollout engine", "Context for log.sync.weights", severity=INFO, priority=0),
    # a launcher's summary of a child that exited: never the cause itself (-9/-7/-11 have their own signatures)
    _sig("launcher", r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: \d+|exits with return code = (?P<code2>-?\d+)|"
         r"^\s*exitcode\s*: (?P<code3>-?\d+) \(pid", ("exitcode", "exits with return code"),
         "the launcher reports a rank exited with an error; that rank's own error is not in this log",
         "Find that rank's own output (torchrun --redirect 3 --log-dir DIR, or TORCHELASTIC_ERROR_FILE with @record on "
         "main; DeepSpeed: the rank's stderr); exit code 1 is a Python exception, 2 a usage error, -6 an abort, -15 a "
         "SIGTERM from the launcher after another rank failed", severity=WARN, priority=9, flags=re.M),
    _sig("nccl.depr", r"NCCL_ASYNC_ERROR_HANDLING is deprecated", ("nccl_async_error_handling is deprecated",),
         "deprecated variable name (harmless)", "unset NCCL_ASYNC_ERROR_HANDLING; export TORCH_NCCL_ASYNC_ERROR_HANDLING=3",
         severity=INFO, priority=0),
]

# The node's memory in Ray's memory-monitor message ("... was 27.71GB / 28.80GB (0.962273), which exceeds the memory
# usage threshold of 0.95"), read into the host OOM finding's evidence.
RAY_NODE_MEMORY = re.compile(r"was (?P<used>[\d.]+ ?[KMGT]i?B) / (?P<total>[\d.]+ ?[KMGT]i?B) \((?P<frac>\d+(?:\.\d+)?)\), "
                             r"which exceeds the memory usage threshold of (?P<thr>\d+(?:\.\d+)?)")

# Sub-rows of the OOM message, read by orbitctl.doctor.oom from the text around an `oom` match.
OOM_PARTS = {
    "oom.req": re.compile(rf"Tried to allocate (?P<req>{SIZE})"),
    "oom.cap": re.compile(rf"GPU (?P<g>\d*) ?has a total capac?i?ty of (?P<tot>{SIZE}) of which (?P<free>{SIZE}) is free"),
    "oom.allowed": re.compile(rf"is free\. (?P<allowed>{SIZE}) allowed;"),
    "oom.frag": re.compile(rf"and (?P<un>{SIZE}) is reserved by PyTorch but unallocated"),
    "oom.alloc": re.compile(rf"Of the allocated memory (?P<a>{SIZE}) is allocated by PyTorch"),
    "oom.pool": re.compile(rf"with (?P<p>{SIZE}) allocated in private pools"),
    "oom.self": re.compile(rf"this process has (?P<m>{SIZE}) memory in use"),
    "oom.peer": re.compile(rf"Process (?P<pid>\d+) has (?P<m>{SIZE}) memory in use"),
    # torch's check against the device limit: "Allocation on device 0 would exceed allowed memory. (out of memory)"
    "oom.limit": re.compile(rf"Currently allocated\s*: (?P<alloc>{SIZE})\s*Requested\s*: (?P<req>{SIZE})\s*Device limit\s*: "
                            rf"(?P<tot>{SIZE})\s*Free \(according to CUDA\)\s*: (?P<free>{SIZE})"),
    "oom.old": re.compile(rf"\(GPU (?P<g>\d+); (?P<tot>{SIZE}) total capacity; (?P<alloc>{SIZE}) already allocated; "
                          rf"(?P<free>{SIZE}) free;(?: (?P<res>{SIZE}) (?:reserved in total by PyTorch|cached))?"),
}

BY_ID = {s.id: s for s in SIGNATURES}
