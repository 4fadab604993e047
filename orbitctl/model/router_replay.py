"""Routing replay (R3) on an MoE: the infer path records each sampled token's experts, the train path reuses them.

On a mixture-of-experts model a tiny numeric difference between the two paths can flip one of a
token's top-k experts, and the paths then run different weights: the largest part of their
mismatch. A :class:`RouterTape` sits on every router of a model (a forward hook on each MoE layer's
``gate``) and has three modes:

* ``record`` (the infer path's decode steps): the experts each fed token is routed to, per layer;
* ``replay`` (the train path with ``rl.router_replay: true``): the completion's tokens run exactly
  the recorded experts; the gate weights are recomputed from this path's own router logits over
  the replayed set, the router's own formula (sigmoid or softmax scores, renormalised when the
  model does, scaled), so a trained router still gets a gradient; the prompt's tokens are routed
  as this path decides;
* ``compare`` (the train path without replay): routing as computed, and the router's own choice
  kept beside the recorded one, which is how routing agreement is measured.

A routing is ``[B, T, L, k]`` integers: row ``b``, completion token ``t`` (the token fed at decode
step ``t``), MoE layer ``l`` (in the model's order), slot ``k``; ``-1`` where nothing was recorded
(a token never fed back, padding), which the train path routes itself. The same shape comes back
from an http engine (SGLang's ``meta_info.routed_experts``, reshaped) and from ``orbitctl serve``.

The mode and the replayed routing stay set until the next forward chooses again, so the
recomputation of a checkpointed layer during backward replays the same experts as its forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

NOT_RECORDED = -1
ROUTE_DTYPE = torch.int16
"""How a routing is kept between rollout and update (expert indices below 32,768: Kimi-K2 has 384)."""


def routers_of(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of ``model``'s MoE layers, in layer order: modules named ``gate``/``router`` whose forward
    returns ``(router_logits, weights, indices)`` (transformers 5's DeepSeek-V3/Kimi-K2 and Qwen3-MoE routers)."""
    found = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("gate", "router") and hasattr(module, "top_k") and isinstance(getattr(module, "weight", None),
                                                                                   torch.Tensor):
            found.append(module)
    return found


def gate_weights(router: nn.Module, router_logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The weights ``router`` gives the experts ``indices`` [N, k] from its logits [N, E]: its own formula over
    another set. A router with a score-correction bias (DeepSeek-V3, Kimi-K2) scores by sigmoid, the bias choosing
    only; the others (Qwen3-MoE) by softmax. Renormalised over the k where the router does, and scaled."""
    if hasattr(router, "e_score_correction_bias"):
        weights = router_logits.sigmoid().gather(1, indices)
        if getattr(router, "norm_topk_prob", False):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * getattr(router, "routed_scaling_factor", 1.0)
    weights = torch.softmax(router_logits, dim=-1, dtype=torch.float).gather(1, indices)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


@dataclass
class Agreement:
    """Per MoE layer: tokens whose top-k set is the same on both paths, of those compared."""

    same: list[int]
    compared: list[int]

    @property
    def overall(self) -> float | None:
        total = sum(self.compared)
        return sum(self.same) / total if total else None

    def per_layer(self) -> list[float | None]:
        return [s / c if c else None for s, c in zip(self.same, self.compared)]

    def __add__(self, other: "Agreement") -> "Agreement":
        return Agreement([a + b for a, b in zip(self.same, other.same)],
                         [a + b for a, b in zip(self.compared, other.compared)])


def same_set(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[...]`` True where the k experts of ``a`` and ``b`` [..., k] are the same set, whatever their order."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


class RouterTape:
    """Records and replays the routing of every MoE router of one model (see the module docstring)."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.routers = routers
        self.top_k = int(routers[0].top_k)
        self.mode = "off"
        self._recorded: list[list[torch.Tensor]] = [[] for _ in routers]
        self._replay: list[torch.Tensor] | None = None
        self.own: list[torch.Tensor | None] = [None] * len(routers)
        """The router's own choice [N, k] at the last forward in ``replay``/``compare`` mode, per layer."""
        self.replayed: list[torch.Tensor | None] = [None] * len(routers)
        """The experts each layer ran at the last forward in ``replay`` mode, [N, k]."""
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(routers)]

    @classmethod
    def attach(cls, model: nn.Module) -> "RouterTape | None":
        routers = routers_of(model)
        return cls(routers) if routers else None

    @property
    def layers(self) -> int:
        return len(self.routers)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()

    # -- modes ---------------------------------------------------------------------------
    def off(self) -> None:
        self.mode, self._replay = "off", None

    def record(self) -> None:
        """Start recording: every forward from now on appends its tokens' experts."""
        self.mode, self._replay = "record", None
        self._recorded = [[] for _ in self.routers]

    def pop_last(self) -> list[torch.Tensor]:
        """Remove and return each layer's last recorded forward: what a CUDA-graph capture recorded, the tensors
        each replay rewrites (:class:`~orbitctl.model.graph_decode.StaticDecode` appends their copies)."""
        return [calls.pop() for calls in self._recorded]

    def truncate(self, forwards: int) -> None:
        """Keep each layer's first ``forwards`` recorded forwards (a failed graph capture's hooks may have run)."""
        self._recorded = [calls[:forwards] for calls in self._recorded]

    def append(self, indices: list[torch.Tensor]) -> None:
        """Record one forward's experts per layer, as the hooks do (a replayed graph runs no hook)."""
        for calls, chosen in zip(self._recorded, indices):
            calls.append(chosen)

    def take(self, batch: int, tokens: int, alive: torch.Tensor | None = None) -> torch.Tensor:
        """The recording of ``batch`` rows as ``[batch, tokens, L, k]`` (:data:`ROUTE_DTYPE`, on the CPU): forward
        ``t`` fed token ``t`` of each row; tokens never fed and where ``alive`` [batch, tokens] is 0 are
        :data:`NOT_RECORDED`. Stops recording."""
        fed = min(len(calls) for calls in self._recorded)  # every layer sees every forward
        routes = torch.full((batch, tokens, self.layers, self.top_k), NOT_RECORDED, dtype=ROUTE_DTYPE)
        if fed:
            recorded = torch.stack([torch.stack([c.reshape(batch, self.top_k) for c in calls[:fed]], dim=1)
                                    for calls in self._recorded], dim=2)  # [batch, fed, L, k]
            routes[:, :min(fed, tokens)] = recorded[:, :tokens].to("cpu", ROUTE_DTYPE)
        self.off()
        if alive is not None:
            routes = routes.masked_fill(~alive.bool().cpu()[:, :, None, None], NOT_RECORDED)
        return routes

    def take_prompt(self, mask: torch.Tensor) -> torch.Tensor:
        """The recording of one prefill over ``[B, P]`` tokens as ``[B, P, L, k]``, :data:`NOT_RECORDED` where ``mask``
        is 0 (left padding). Stops recording."""
        batch, width = mask.shape
        routes = torch.stack([calls[0].reshape(batch, width, self.top_k) for calls in self._recorded], dim=2)
        self.off()
        return routes.to("cpu", ROUTE_DTYPE).masked_fill(~mask.bool().cpu()[:, :, None, None], NOT_RECORDED)

    def follow(self, routes: torch.Tensor | None, prompt_width: int, *, replay: bool) -> None:
        """Set up the train path's next forward over ``[B, prompt_width + T]`` tokens: replay ``routes`` [B, T, L, k]
        on the completion (``replay``), or only keep the router's own choice beside them (``compare``). ``None``:
        route as computed, nothing kept."""
        if routes is None:
            self.off()
            return
        batch, width, layers, k = routes.shape
        if layers != self.layers or k != self.top_k:
            raise ValueError(f"a routing of {layers} MoE layers x top-{k} for a model of {self.layers} x "
                             f"top-{self.top_k}")
        full = routes.new_full((batch, prompt_width + width, layers, k), NOT_RECORDED)
        full[:, prompt_width:] = routes
        self._replay = [full[:, :, i].reshape(-1, k).long() for i in range(layers)]
        self.mode = "replay" if replay else "compare"
        self.own = [None] * self.layers
        self.replayed = [None] * self.layers

    def agreement(self, routes: torch.Tensor, prompt_width: int, mask: torch.Tensor | None = None) -> Agreement:
        """Per layer, how many completion tokens the last ``replay``/``compare`` forward's router chose the same
        top-k set for as ``routes`` records (tokens with a recording and, when given, ``mask`` [B, T] set)."""
        import torch

        batch, width = routes.shape[:2]
        counts = []
        for i, own in enumerate(self.own):
            if own is None:
                raise RuntimeError("no train-path routing to compare: run a forward after follow()")
            # counted where the router ran (the recording and the mask may be on the host or on the device)
            mine = own.reshape(batch, -1, self.top_k)[:, prompt_width:prompt_width + width]
            theirs = routes[:, :, i].long().to(mine.device)
            valid = (theirs >= 0).all(-1)
            if mask is not None:
                valid &= mask.bool().to(mine.device)
            counts.append(torch.stack([(same_set(mine, theirs) & valid).sum(), valid.sum()]))
        same, compared = zip(*torch.stack(counts).tolist()) if counts else ((), ())  # one read for every layer
        return Agreement(list(same), list(compared))

    # -- the hook --------------------------------------------------------------------------
    def _hook(self, layer: int):
        def hook(router, args, output):
            if self.mode == "off":
                return None
            logits, weights, indices = output
            if self.mode == "record":
                self._recorded[layer].append(indices.detach())
                return None
            wanted = self._replay[layer].to(indices.device)
            if wanted.shape != indices.shape:
                raise RuntimeError(f"router replay: MoE layer {layer} routes {tuple(indices.shape)} slots, the "
                                   f"routing to replay has {tuple(wanted.shape)}")
            self.own[layer] = indices.detach()
            if self.mode == "compare":
                return None
            chosen = (wanted >= 0).all(-1, keepdim=True)
            experts = torch.where(chosen, wanted, indices)
            replayed = gate_weights(router, logits, experts).to(weights.dtype)
            self.replayed[layer] = experts
            return logits, torch.where(chosen, replayed, weights), experts
        return hook
