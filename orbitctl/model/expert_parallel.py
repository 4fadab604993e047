"""Expert parallelism: each rank holds 1/P of every MoE layer's routed experts and tokens travel to them.

    group = ExpertGroup.of_world(ep_size=2)           # every rank calls it, in the same order
    layer = ExpertParallelExperts(local_experts, num_experts=8, act_fn=F.silu, group=group)
    y = layer(hidden_states, top_k_index, top_k_weights)   # the fused-experts signature of transformers 5

Rank r of an EP group of size P owns experts ``[r*E/P, (r+1)*E/P)``. A forward sorts this rank's
(token, k) slots by the expert's owner, sends each owner its slots' hidden vectors with
``all_to_all_single`` (the autograd variant: gradients come back the same way), runs the local
experts on what arrived, grouped by expert, and sends the results back with a second
``all_to_all_single``; the top-k weights are applied where the token lives. The expert weights are
never gathered, in training or in rollout, and no rank holds another rank's experts.

Every rank of the group must call every MoE layer the same number of times (the exchange is a
collective): the trainer keeps ranks in lockstep (:class:`Lockstep`), a rank with no tokens still
takes part with empty splits. The local experts' quantized weights are buffers, not parameters, so
ZeRO neither partitions them nor broadcasts rank 0's copy over the others'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from orbitctl.dist import collectives as coll
from orbitctl.errors import UserError
from orbitctl.kernels.graph_capture import static_shapes_active
from orbitctl.kernels.grouped_int4 import takes_lora
from orbitctl.model.expert_lora import experts_by_row
from orbitctl.plan.layout import owned_experts


@dataclass(frozen=True)
class ExpertGroup:
    """This rank's expert-parallel group: its rank inside the group, the group's size and handle."""

    rank: int
    size: int
    group: Any = None
    """The torch.distributed process group (None: the default group, when it is exactly the EP group)."""

    @classmethod
    def of_world(cls, ep_size: int) -> "ExpertGroup":
        """Split the world into consecutive groups of ``ep_size`` ranks; collective (every rank calls it)."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        if ep_size < 1 or world % ep_size:
            raise ValueError(f"expert parallel size {ep_size} does not divide the world size {world}")
        if ep_size == world:
            return cls(rank % ep_size, ep_size, None)
        mine = None
        for start in range(0, world, ep_size):
            group = dist.new_group(list(range(start, start + ep_size)))
            if start <= rank < start + ep_size:
                mine = group
        return cls(rank % ep_size, ep_size, mine)

    def owned(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds."""
        if num_experts % self.size:
            raise UserError(f"memory.expert_parallel: {num_experts} routed experts do not split evenly over {self.size} ranks",
                            fix=f"use an expert-parallel size that divides {num_experts}")
        return owned_experts(self.rank, self.size, num_experts)


def _exchange(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group, *, grad: bool) -> torch.Tensor:
    """Rows of ``x`` split by ``send_counts`` to each rank; returns the rows received, split by ``recv_counts``."""
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    return coll.all_to_all(out, x, recv_counts, send_counts, group, grad=grad)


class ExpertParallelExperts(nn.Module):
    """Drop-in for transformers 5's fused experts module (and :class:`QuantExperts`) under expert parallelism.

    Submodules are named by the experts' global indices (``experts.12.gate_proj`` on the rank that
    owns expert 12), so checkpoint names, state dicts and adapters keep the checkpoint's layout.
    """

    def __init__(self, local_experts: dict[int, nn.Module], num_experts: int, act_fn, group: ExpertGroup) -> None:
        super().__init__()
        owned = group.owned(num_experts)
        if sorted(local_experts) != list(owned):
            raise ValueError(f"rank {group.rank} of {group.size} owns experts {owned.start}..{owned.stop - 1}, "
                             f"got {sorted(local_experts)}")
        self.num_experts, self.act_fn, self.ep = num_experts, act_fn, group
        self.per_rank, self.first = len(owned), owned.start
        for index, expert in local_experts.items():
            self.add_module(str(index), expert)
        self.held = owned
        self.expert_lora = None
        """The adapters of the experts held here (:class:`~orbitctl.model.expert_lora.ExpertLoRA`), when asked for."""
        self.stack = None
        """The held experts stacked for the grouped GPU kernel (:class:`~orbitctl.kernels.grouped_int4.ExpertStack`)."""

    def expert(self, index: int) -> nn.Module:
        return getattr(self, str(index))

    def _run_local(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The local experts on the rows that arrived, grouped by expert; the result keeps the rows' order."""
        if x.shape[0] == 0:  # an empty exchange still joins the graph on every rank, adapters included
            lora = self.expert_lora
            if lora is not None and lora.enabled and torch.is_grad_enabled():
                return x + 0.0 * sum(p.sum() for p in lora.parameters()).to(x.dtype)
            return x + 0.0
        lora = self.expert_lora.bound() if self.expert_lora is not None else None
        if self.stack is not None and takes_lora(lora):
            return self.stack.forward(x, experts - self.first, 1, self.act_fn, lora)
        return experts_by_row(self, experts, lambda order: x[order], lora)[0]

    def static_exchange(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """The forward at static shapes, with no value read by the host (a CUDA graph's decode step; no autograd):
        every rank's tokens, routing and gate weights all-gathered, this rank's experts run on the slots routed to
        them (the grouped kernel with every other slot in a skipped block; per expert off it), each token's weighted
        sum of them reduce-scattered back to the rank it came from. Every rank must pass the same number of tokens.

        At ``top_k`` = ``P`` a token's vector travels as far as by all-to-all (to P - 1 ranks, once each way); the
        sizes are known before the step, where the all-to-all needs the counts on the host."""
        tokens, k = top_k_index.shape
        size = self.ep.size
        every = coll.all_gather(hidden_states, self.ep.group)
        routes = coll.all_gather(top_k_index, self.ep.group).reshape(-1)
        weights = coll.all_gather(top_k_weights, self.ep.group).reshape(-1, 1)
        local = routes - self.first
        mine = (local >= 0) & (local < self.per_rank)
        lora = self.expert_lora.bound() if self.expert_lora is not None else None
        if self.stack is not None and takes_lora(lora):
            out = self.stack.forward(every, torch.where(mine, local, self.per_rank), k, self.act_fn, lora,
                                     skip=True)
        else:  # the per-expert loop reads the routing on the host: eager only
            count = int(mine.sum())  # one read; the slots routed here in ascending order, as nonzero gives them
            slots = torch.argsort((~mine).to(torch.int8), stable=True)[:count]
            out = every.new_zeros((routes.shape[0], every.shape[-1]))
            out[slots] = experts_by_row(self, routes[slots],
                                        lambda order: every[torch.div(slots[order], k, rounding_mode="floor")], lora)[0]
        weighted = torch.where(mine[:, None], out * weights.to(out.dtype), torch.zeros((), dtype=out.dtype,
                                                                                        device=out.device))
        partial = weighted.view(size * tokens, k, -1).sum(1).to(hidden_states.dtype)
        return coll.reduce_scatter(partial, self.ep.group)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if static_shapes_active() and not torch.is_grad_enabled():
            return self.static_exchange(hidden_states, top_k_index, top_k_weights)
        tokens, k = top_k_index.shape
        grad = torch.is_grad_enabled()
        with torch.no_grad():
            flat = top_k_index.reshape(-1)
            owner = torch.div(flat, self.per_rank, rounding_mode="floor")
            # by owner, then by expert: each owner receives its slots grouped by expert, in expert order
            order = torch.argsort(flat, stable=True)
            token_of = torch.div(order, k, rounding_mode="floor")
            # rows for each owner at a static shape (bincount's size depends on the values)
            send_counts = torch.zeros(self.ep.size, dtype=torch.long, device=owner.device).scatter_add_(
                0, owner, torch.ones_like(owner))
            send_list, recv_list = coll.exchange_counts(send_counts, flat.numel(), self.ep.group)
            recv_experts = _exchange(flat[order], send_list, recv_list, self.ep.group, grad=False)
        sent = _exchange(hidden_states[token_of], send_list, recv_list, self.ep.group, grad=grad)
        done = self._run_local(sent, recv_experts)
        back = _exchange(done, recv_list, send_list, self.ep.group, grad=grad)
        weights = top_k_weights.reshape(-1)[order]
        final = hidden_states.new_zeros(hidden_states.shape)
        return final.index_add(0, token_of, (back * weights[:, None]).to(final.dtype))


class Lockstep:
    """Keeps the ranks of an expert-parallel run calling the model the same number of times.

    ``all_done(flag)``: True once every rank is done (a sampler that finished early keeps decoding
    padding until then). ``rounds(n)``: the largest ``n`` over the ranks (a rank with fewer batches runs
    filler batches whose results it drops). Without a process group both are the identity.
    """

    def __init__(self, group: Any = None, active: bool = True) -> None:
        self.group, self.active = group, active

    def _reduce(self, value: int, op: str) -> int:
        if not self.shared:
            return value
        return coll.reduce_scalars([int(value)], op, self.group)[0]  # on the device the group's backend takes

    @property
    def shared(self) -> bool:
        """Whether other ranks take part: each call of the model must be matched on them (a filler where a rank has
        nothing to run)."""
        import torch.distributed as dist

        return self.active and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def all_done(self, done: bool) -> bool:
        return bool(self._reduce(int(done), "min"))

    def rounds(self, n: int) -> int:
        return self._reduce(int(n), "max")


SOLO = Lockstep(active=False)
"""The lockstep of a model without expert parallelism: nothing to wait for."""
