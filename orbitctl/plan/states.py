"""Trainable model states under DeepSpeed ZeRO: weights, gradients, FP32 master, Adam.

Per trainable parameter with BF16 weights: 2 B weight, 4 B gradient (the FP32 partition
BF16 gradients are reduced into; stages 0-2 also keep a 2 B BF16 gradient), 4 B FP32
master, 8 B Adam m and v. Stage 1 partitions the optimizer, 2 also gradients, 3 also
weights, which then adds a gathered unit (weights + grads of the largest layer, 4 B per
parameter). With ``zero_stage 3`` and no offload this is DeepSpeed's own
``estimate_zero3_model_states_mem_needs``: ``4 * largest_layer + 18 * P / G`` on the GPU;
host memory uses DeepSpeed's 1.5 buffer factor.
"""

from __future__ import annotations

from dataclasses import dataclass

HOST_BUFFER_FACTOR = 1.5


@dataclass(frozen=True)
class ModelStates:
    """Bytes of the trainable parameters' states on each GPU (weights, gradients, master copy, Adam moments,
    ZeRO-3's gathered unit) and in host RAM per node."""

    weights: float
    grads: float
    master: float
    adam: float
    gathered: float
    """ZeRO-3: the largest unit's gathered 16-bit weights and gradients."""
    host: float
    """Host RAM per node for offloaded states."""

    @property
    def gpu_total(self) -> float:
        return self.weights + self.grads + self.master + self.adam + self.gathered


def model_states(trainable: int, largest_unit: int, *, zero_stage: int, gpus_per_node: int, nodes: int = 1,
                 offload_optimizer: bool = False, offload_params: bool = False, persistent: int = 0,
                 weight_bytes: int = 2) -> ModelStates:
    """GPU bytes per rank and host bytes per node of ``trainable`` parameters' states.

    ``persistent`` parameters (tiny matrices under ZeRO-3's persistence threshold) stay whole
    on every rank. ``weight_bytes`` 4 means FP32 adapters: the weight is its own master copy.
    """
    world = gpus_per_node * nodes
    p = float(trainable)
    fp32 = weight_bytes == 4
    master_b = 0.0 if fp32 else 4.0
    grad16_b = 0.0 if fp32 else 2.0  # the 16-bit gradient stages 0-2 keep before reduction
    if zero_stage == 3:
        sharded_w = (p - persistent) / world + persistent
        weights = 0.0 if offload_params else weight_bytes * sharded_w
        grads, master, adam = 4.0 * p / world, master_b * p / world, 8.0 * p / world
        gathered = 2.0 * weight_bytes * largest_unit
    else:
        gathered = 0.0
        weights = weight_bytes * p
        shard = world if zero_stage >= 1 else 1
        grad_shard = world if zero_stage >= 2 else 1
        grads = grad16_b * p / grad_shard + 4.0 * p / shard
        master, adam = master_b * p / shard, 8.0 * p / shard
    host = 0.0
    if offload_optimizer:
        # fp32 gradient partition, master and Adam move to host RAM; DeepSpeed's zero_init=1 form
        host = (grads + master + adam) * gpus_per_node * HOST_BUFFER_FACTOR
        grads = master = adam = 0.0
        if offload_params:
            host += weight_bytes * p / nodes * HOST_BUFFER_FACTOR
    return ModelStates(weights, grads, master, adam, gathered, host)
