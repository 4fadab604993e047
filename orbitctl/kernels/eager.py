"""Whether a tensor is a real one in eager mode: the condition under which orbitctl's kernels (and the buffers they
write into) run instead of plain torch ops.

Fake tensors (the planner's shadow runs, the CUDA rehearsal), meta tensors, tensor subclasses and traced or
compiled code take the plain-torch path; other dispatch modes (an op counter, a memory tracker) see what runs on
real tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def real_eager(x: torch.Tensor) -> bool:
    """A real tensor in eager mode: not traced or compiled, not a subclass, no fake-tensor mode active (the planner's
    shadow runs); other dispatch modes (an op counter, a memory tracker) see what runs on real tensors."""
    if torch.compiler.is_compiling() or type(x) not in (torch.Tensor, nn.Parameter):
        return False
    return not any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack())
