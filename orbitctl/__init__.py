"""orbitctl: plan, quantize, train, verify and diagnose adapter-first RL post-training.

On a machine with no NVIDIA or AMD GPU device, DeepSpeed is told its accelerator is the CPU
(``DS_ACCELERATOR=cpu``, unless set): its own probe logs "Setting accelerator to CPU" to stdout on
first import, which would break a command's ``--json`` output and a library caller's. The ranks a
command starts inherit it.
"""

import os as _os

__version__ = "0.1.0"

if not any(_os.path.exists(_dev) for _dev in ("/dev/nvidiactl", "/dev/kfd")):
    _os.environ.setdefault("DS_ACCELERATOR", "cpu")
