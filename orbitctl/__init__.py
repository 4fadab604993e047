"""orbitctl: plan, quantize, train, verify and diagnose adapter-first RL post-training.

On a machine with no NVIDIA or AMD GPU device, DeepSpeed is told its accelerator is the CPU
(``DS_ACCELERATOR=cpu``, unless set): its own probe logs "Setting accelerator to CPU" to stdout on
first import, which would break a command's ``--json`` output and a library caller's. The ranks a
command starts inherit it.

bitsandbytes, on a CPU with AVX512-BF16, tries at import to fetch an optional fused kernel from the
Hugging Face Hub and logs "Failed to load CPU gemm_4bit_forward from kernels-community" when it cannot;
that kernel serves only the repacked no-grad path the frozen base turns off (one kernel for both
paths, ``orbitctl.model.frozen_base``), so the line is dropped here, once, for every command.

PEFT reads a transformers model's ``is_gradient_checkpointing`` when it wraps it, which transformers 5
deprecates with a FutureWarning on every adapter load; the attribute still answers, so that one
warning is dropped too.
"""

import logging as _logging
import os as _os
import warnings as _warnings

__version__ = "0.1.0"

if not any(_os.path.exists(_dev) for _dev in ("/dev/nvidiactl", "/dev/kfd")):
    _os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _drop_unused_kernel_warning(record: _logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_drop_unused_kernel_warning)


def quiet_deprecations() -> None:
    """Drop the deprecation warnings of other libraries that every command would otherwise print (PEFT's read of
    ``is_gradient_checkpointing``); called on import."""
    _warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


quiet_deprecations()
