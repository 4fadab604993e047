"""The policy: one frozen quantized base plus unmerged adapters, seen through two paths.

* infer path (:meth:`Policy.sample`, :meth:`Policy.greedy`): eval mode, no grad, incremental
  decoding with a KV cache (in the compute dtype, or float8 with ``rollout.kv_dtype: fp8``:
  :mod:`orbitctl.kernels.kv_cache`); records each sampled token's log-prob and, when asked, the full
  log-distribution (cheap for small vocabularies, what the align loss uses).
* train path (:meth:`Policy.completion_logits`): train mode, full-sequence forward with
  gradient checkpointing, adapters active; :meth:`Policy.completion_hidden` stops before the
  output layer, for a loss that applies it a chunk of positions at a time.

Both paths number positions from the first real token, so left padding never shifts a
sequence's positions (a plain forward would count the padding and disagree with decoding).
The reference policy is :meth:`reference_logits`: the same weights with adapters disabled.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orbitctl.model.adapters import AdapterReport, adapters_disabled

if TYPE_CHECKING:
    import torch


@dataclass
class Samples:
    """A batch of completions sampled on the infer path (all tensors on the CPU, wherever the model runs)."""

    prompt_ids: "torch.Tensor"          # [B, P] left-padded
    prompt_mask: "torch.Tensor"         # [B, P]
    completion_ids: "torch.Tensor"      # [B, T] right-padded with pad
    completion_mask: "torch.Tensor"     # [B, T] 1 on sampled tokens, EOS included
    logprobs: "torch.Tensor"            # [B, T] infer-path log-prob of each sampled token
    dist: "torch.Tensor | None"         # [B, T, V] infer-path log-distribution, when kept
    logits: "torch.Tensor | None" = None  # [B, T, V] temperature-scaled logits, when kept
    hidden: "torch.Tensor | None" = None  # [B, T, L+1, H] hidden states that predicted each token, when kept
    routes: "torch.Tensor | None" = None  # [B, T, L_moe, k] each token's experts per MoE layer (MoE models)
    prompt_routes: "torch.Tensor | None" = None  # [B, P, L_moe, k] the prompt's, -1 on padding (MoE models)
    past: "Past | None" = None  # the KV cache after the decode, on the model's device (``keep_past``)


@dataclass
class Past:
    """What an infer-path call leaves for the next one to continue from: its KV ``cache``, the attention ``mask``
    over the cache's positions ``[B, T]`` (0 on padding, on finished rows' steps and on positions struck out with
    :meth:`strike`) and the token ``ids`` at those positions, on the model's device. The last drawn token of a row is
    not in it (never fed back). :meth:`held` is what a row's cache holds."""

    cache: object
    mask: "torch.Tensor"
    ids: "torch.Tensor"

    def held(self, row: int) -> list[int]:
        """The tokens the row's cache holds, in order (its open positions)."""
        return self.ids[row][self.mask[row].bool()].tolist()

    def rows(self, index: list[int]) -> "Past":
        """The cache of these rows only, in this order (the other rows' positions are dropped)."""
        import torch

        if index == list(range(self.mask.shape[0])):
            return self
        at = torch.tensor(index, dtype=torch.long, device=self.mask.device)
        self.cache.reorder_cache(at)  # every layer's keys and values, the rows taken
        return Past(self.cache, self.mask[at], self.ids[at])

    def strike(self, row: int, start: int) -> None:
        """Close the row's positions from ``start`` on: tokens that were fed but that the sequence does not keep
        (a plain-text action cut at its newline)."""
        self.mask[row, start:] = 0


def position_ids_for(mask):
    """Positions counted from each row's first real token (left padding gets position 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def shared_prompts(prompt_ids, prompt_mask):
    """``(unique, rows)`` when some rows of the batch repeat a prompt: the first row of each distinct prompt, and for
    every row the position of its prompt among those (``prompt_ids[unique][rows]`` is ``prompt_ids``).
    ``(None, None)`` when every row is distinct: nothing to share."""
    import torch

    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    # one read of the batch's ids, then a dictionary: a lexicographic sort of the rows (torch.unique with dim) costs
    # more than the prefill it saves on a small model; in the batch's own order of first appearance, so the prefill
    # sees its prompts as they came
    seen: dict[tuple, int] = {}
    first, position = [], []
    for row, key in enumerate(map(tuple, keys.tolist())):
        if key not in seen:
            seen[key] = len(first)
            first.append(row)
        position.append(seen[key])
    if len(first) == len(position):
        return None, None
    return (torch.tensor(first, dtype=torch.long, device=keys.device),
            torch.tensor(position, dtype=torch.long, device=keys.device))


def _past(cache, mask, prompt_ids, past: Past | None, tokens: list) -> Past:
    """The :class:`Past` after a decode: the ids at the cache's positions are what it continued, the prompt, and every
    drawn token but the last (the one never fed back)."""
    import torch

    parts = ([past.ids] if past is not None else []) + [prompt_ids]
    if len(tokens) > 1:
        parts.append(torch.stack(tokens[:-1], dim=1))
    ids = torch.cat(parts, dim=1)
    assert ids.shape == mask.shape, (ids.shape, mask.shape)
    return Past(cache, mask, ids)


def _top_p_filter(logits, top_p: float):
    import torch

    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the mass before it already reaches top_p (the top token always stays)
    drop = (probs.cumsum(-1) - probs) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _drawn(scaled, *, temperature: float, top_p: float, generator, draws, step):
    """Each row's next token from its scaled logits [B, V]: its keyed draw at ``step`` (an int, or one per row), else
    the generator's draw, greedy at temperature 0."""
    import torch

    if temperature > 0 and draws is not None:
        return draws.sample(torch.softmax(_top_p_filter(scaled, top_p), dim=-1), step)
    if temperature > 0:
        probs = torch.softmax(_top_p_filter(scaled, top_p), dim=-1)
        # drawn on the CPU generator wherever the model runs: one seed, one sequence of draws
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(scaled.device)
    return scaled.argmax(-1)


def _contiguous_input(module, args):
    """Forward pre-hook: the module's first input made contiguous (a no-op when it is)."""
    return (args[0].contiguous(), *args[1:]) if args and hasattr(args[0], "contiguous") else None


class Policy:
    """Frozen base + adapters; ``model`` is a PeftModel (LoRA) or the base with bottleneck layers."""

    def __init__(self, model, tokenizer, report: AdapterReport, *, hidden_size: int, adapter_kind: str,
                 gradient_checkpointing: bool = True, keep_frozen_outputs: bool = False, lockstep=None,
                 chat_template: bool = False, kv_dtype: str = "bf16", router_replay: bool = False,
                 system_prompt: str | None = None, decode_graphs: bool | str = "auto",
                 continuous_batching: bool = False) -> None:
        from orbitctl.model.expert_parallel import SOLO
        from orbitctl.model.router_replay import RouterTape

        self.model = model
        model.eval()  # every module in one mode (a fresh adapter's are in training mode): set_mode reads the top's flag
        self.chat_template = chat_template
        """Render prompts with the tokenizer's chat template (``data.chat_template``)."""
        self.system_prompt = system_prompt
        """``data.system_prompt``: a system turn before every prompt that has none of its own (chat template only)."""
        self.kv_dtype = kv_dtype
        """How the infer path keeps its KV cache (``rollout.kv_dtype``; :mod:`orbitctl.kernels.kv_cache`): ``bf16`` in
        the compute dtype, ``fp8`` in float8 e4m3 with a scale per token and KV head. The train path has no cache."""
        self.decode_graphs = decode_graphs
        """``rollout.decode_graphs``: on a CUDA GPU each decode step after the first two replays a CUDA graph over a
        static KV cache (:mod:`orbitctl.model.graph_decode`); false decodes eagerly everywhere."""
        self.continuous_batching = continuous_batching
        """``rollout.continuous_batching`` resolved: the rollout samples a step's rows with :meth:`sample_stream`, a
        finished row's slot going to a waiting one, instead of in fixed chunks (:meth:`sample`)."""
        self.lockstep = lockstep or SOLO
        self.routing = RouterTape.attach(model)
        """The MoE routers' tape (:mod:`orbitctl.model.router_replay`): the infer path records each sampled token's
        experts, the train path replays them (:attr:`router_replay`) or compares with them. None on a dense model."""
        self.router_replay = router_replay
        """``rl.router_replay``: the train path runs the experts the infer path recorded for the completion."""
        """Keeps expert-parallel ranks calling the model alike (:class:`~orbitctl.model.expert_parallel.Lockstep`)."""
        self.tokenizer = tokenizer
        self.report = report
        self.hidden_size = hidden_size
        self.adapter_kind = adapter_kind
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        if gradient_checkpointing:
            from orbitctl.plan.recompute import checkpoint_kwargs

            kwargs = checkpoint_kwargs(keep_frozen_outputs=keep_frozen_outputs)
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            # transformers also makes the embedding's output require a gradient, which only reentrant checkpointing
            # needs: with it the backward would run every frozen layer below the first adapter for nothing
            self.model.disable_input_require_grads()
        head = self.model.get_output_embeddings()
        if head is not None:
            # transformers slices the positions whose logits are kept (a strided view of the hidden states); a strided
            # 3-D input makes the output layer's matmul copy its weight once per row ([B, H, V]: 400 MB for a prefill
            # of 32 rows at vocabulary 8,192) and run a batched GEMM, in the forward and again in the backward
            head.register_forward_pre_hook(_contiguous_input)
        import inspect

        base_forward = self.model.get_base_model().forward if hasattr(self.model, "get_base_model") else self.model.forward
        # transformers 5.2x renamed past_key_values to cache; use whichever this version takes
        params = inspect.signature(base_forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # the output layer only for the positions asked for: the prompt's last on the infer path, the completion's
        # on the train path (a model that cannot restrict it computes every position's logits, sliced after)
        self._keeps_logits = "logits_to_keep" in params
        self.model.config.use_cache = True

    def _last_logits(self, count: int) -> dict:
        """The forward's keyword that computes the output layer for the last ``count`` positions only."""
        return {"logits_to_keep": count} if self._keeps_logits else {}

    # -- parameters --------------------------------------------------------------------
    @property
    def device(self):
        """Where the model's weights are (DeepSpeed may move them after construction)."""
        return next(self.model.parameters()).device

    def trainable_parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_trainable(self):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def set_mode(self, train: bool) -> None:
        """The model in training mode (``train``: dropout, gradient checkpointing) or in eval mode. Only a change walks
        the modules (``Module.train`` visits every submodule: 1.6 ms a call on the two-layer demo, a twelfth of its
        rollout); every switch goes through the top module, so its flag is the whole model's."""
        if self.model.training != train:
            self.model.train(train)

    # -- infer path ----------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str]):
        """Left-padded ids and mask of ``prompts``. With :attr:`chat_template` each goes through the tokenizer's
        chat template first: a chat record's own turns (a prompt's ``messages``), else one user turn; after
        :attr:`system_prompt` when set and the turns have no system turn of their own."""
        if not self.chat_template:
            enc = self.tokenizer(prompts, return_tensors="pt", padding=True)
            return enc["input_ids"], enc["attention_mask"]
        texts = [self.tokenizer.apply_chat_template(self.turns(p), tokenize=False, add_generation_prompt=True)
                 for p in prompts]
        # the template writes the special tokens (BOS) itself
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc["input_ids"], enc["attention_mask"]

    def turns(self, prompt) -> list[dict]:
        """The chat turns of one prompt as :meth:`encode_prompts` renders them."""
        turns = [{"role": role, "content": content}
                 for role, content in getattr(prompt, "messages", None) or (("user", prompt),)]
        if self.system_prompt is not None and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        return turns

    def sample(self, prompt_ids, prompt_mask, *, max_new_tokens: int, temperature: float, top_p: float,
               generator, keep_dist: bool = False, keep_logits: bool = False,
               keep_hidden: bool = False, forced=None, draws=None, kv_dtype: str | None = None,
               static: bool | None = None, past: Past | None = None, keep_past: bool = False) -> Samples:
        """Sample one completion per row; temperature 0 is greedy.

        ``keep_logits`` / ``keep_hidden`` record, per generated token, the scaled logits and the
        hidden state of every layer at the position that predicted it (verify-alignment).
        ``forced`` = ``(completion_ids, completion_mask)`` feeds those tokens instead of drawing
        them (teacher forcing through the same KV-cache decode): the infer path's distributions
        for tokens another sampler chose, which is how the kernel floor is measured.
        ``draws`` (:class:`~orbitctl.model.draws.KeyedDraws`, one key per row) replaces ``generator`` when
        sampling: each row's tokens then depend on its key, not on the batch it is sampled in.
        ``kv_dtype`` overrides :attr:`kv_dtype` for this call (the kernel floor decodes in the compute dtype).
        ``static`` decodes on the static step (:class:`~orbitctl.model.graph_decode.StaticDecode`: captured as a CUDA
        graph on a GPU, eager elsewhere) or not; None: where :attr:`decode_graphs` applies.
        ``past`` continues an earlier call's :class:`Past` (a multi-turn episode's next turn): ``prompt_ids`` are then
        only the tokens that follow what the cache holds (left-padded; each row's last one real), appended to it in one
        forward instead of the whole context read again. ``keep_past`` returns the cache after the decode as
        :attr:`Samples.past`. Either decodes eagerly (the static step keeps a cache of its own).
        """
        import torch

        from orbitctl.kernels.graph_capture import graphs_apply
        from orbitctl.kernels.kv_cache import new_kv_cache
        from orbitctl.model.graph_decode import StaticDecode

        if forced is not None:
            forced_ids, forced_mask = (t.to(self.device) for t in forced)
            max_new_tokens = forced_ids.shape[1]

        self.set_mode(train=False)
        batch = prompt_ids.shape[0]
        device = self.device
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        with torch.no_grad():
            kv = kv_dtype or self.kv_dtype
            if past is not None:
                if keep_hidden or self.routing is not None:
                    raise ValueError("a continued cache keeps no hidden states and records no routing")
                mask = torch.cat([past.mask, prompt_mask], dim=-1)
                out, cache, logits = self._extend(past.cache, prompt_ids, mask)
                prompt_routes = None
            else:
                mask = prompt_mask.clone()
                fresh = new_kv_cache(kv, self.model.config, max_new_tokens)  # None: the model starts its own
                out, cache, logits, prompt_routes = self._prefill(prompt_ids, mask, fresh, keep_hidden=keep_hidden)
            if self.routing is not None:
                self.routing.record()  # decode step t feeds token t-1: its experts are that token's
            next_pos = mask.sum(-1, keepdim=True)
            if past is not None or keep_past:
                static = False
            if static is None:
                static = graphs_apply(self.decode_graphs, device.type, kv_dtype=kv, keep_hidden=keep_hidden)
            stepper = None
            if static and max_new_tokens > 1:
                if keep_hidden or kv != "bf16":
                    raise ValueError("the static decode step keeps neither hidden states nor a float8 KV cache")
                stepper = StaticDecode(self.model, self._cache_kw, cache, mask, next_pos, max_new_tokens - 1,
                                       capture=device.type == "cuda", routing=self.routing)
            finished = torch.zeros(batch, dtype=torch.bool, device=device)
            tokens, logps, keep, raw, hidden = [], [], [], [], []
            dist = None  # keep_dist: [batch, max_new_tokens, V], each step written in place (no stacked copy)
            for step in range(max_new_tokens):
                scaled = logits.float() / (temperature if temperature > 0 else 1.0)
                if keep_logits:
                    raw.append(scaled)
                if keep_hidden:
                    hidden.append(torch.stack([h[:, -1, :].float() for h in out.hidden_states], dim=1))
                logdist = torch.log_softmax(scaled, dim=-1)
                token = forced_ids[:, step] if forced is not None else _drawn(
                    scaled, temperature=temperature, top_p=top_p, generator=generator, draws=draws, step=step)
                alive = forced_mask[:, step].bool() if forced is not None else ~finished
                token = torch.where(alive, token, torch.full_like(token, self.pad_id))
                tokens.append(token)
                logps.append(logdist.gather(-1, token[:, None]).squeeze(-1) * alive)
                keep.append(alive.long())
                if keep_dist:
                    if dist is None:
                        dist = logdist.new_empty(batch, max_new_tokens, logdist.shape[-1])
                    dist[:, step] = logdist
                finished = finished | (token == self.eos_id)
                if forced is not None:  # done where no forced token is left (an empty slice: all done)
                    finished = ~forced_mask[:, step + 1:].bool().any(-1)
                # the last token is never fed back (its logits would predict nothing kept); under EP every rank
                # decodes until all are done, and every rank stops at the same last step without asking
                if step == max_new_tokens - 1 or self.lockstep.all_done(bool(finished.all())):
                    break
                if stepper is not None:
                    logits = stepper(token, alive)
                    continue
                mask = torch.cat([mask, alive.long()[:, None]], dim=-1)
                out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos,
                                 use_cache=True, output_hidden_states=keep_hidden, **{self._cache_kw: cache})
                cache, logits = getattr(out, self._cache_kw), out.logits[:, -1, :]
                next_pos = next_pos + 1
        def host(parts):
            return torch.stack(parts, 1).cpu() if parts else None

        kept = host(keep)
        routes = None
        if self.routing is not None:
            routes = self.routing.take(batch, len(tokens), kept) if self.routing.mode == "record" and tokens else None
            self.routing.off()
        return Samples(prompt_ids.cpu(), prompt_mask.cpu(), host(tokens), kept, host(logps),
                       dist[:, :len(tokens)].cpu() if dist is not None else None, host(raw), host(hidden), routes,
                       prompt_routes, _past(cache, mask, prompt_ids, past, tokens) if keep_past else None)

    def _extend(self, cache, ids, mask):
        """One forward of the new tokens ``ids`` ``[B, N]`` after the positions ``cache`` holds; ``mask`` covers both.
        Positions count the open positions before each token, as the train path's full sequence numbers them."""
        if not bool(mask[:, -1].all()):
            raise ValueError("every continued row needs a real last token (left-pad the new tokens)")
        positions = position_ids_for(mask)[:, -ids.shape[1]:]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **self._last_logits(1), **{self._cache_kw: cache})
        return out, getattr(out, self._cache_kw), out.logits[:, -1, :]

    def _prefill(self, prompt_ids, mask, fresh, *, keep_hidden: bool = False):
        """One forward over left-padded prompts: ``(output, cache, last logits [B, V], prompt routes [B, P, L, k] or
        None)``. A prompt that several rows share (a GRPO group) is prefilled once; its cache is then copied to each
        row. ``fresh``: the cache to fill (None: the model's own)."""
        if self.routing is not None:
            self.routing.record()  # the prompt's routing: an engine returns it; the train path routes it itself
        unique, rows = shared_prompts(prompt_ids, mask)
        once = unique is not None
        out = self.model(input_ids=prompt_ids[unique] if once else prompt_ids,
                         attention_mask=mask[unique] if once else mask,
                         position_ids=position_ids_for(mask[unique] if once else mask),
                         use_cache=True, output_hidden_states=keep_hidden, **self._last_logits(1),
                         **({} if fresh is None else {self._cache_kw: fresh}))
        prompt_routes = None
        if self.routing is not None:
            prompt_routes = self.routing.take_prompt(mask[unique] if once else mask)
            prompt_routes = prompt_routes[rows.cpu()] if once else prompt_routes
        cache, logits = getattr(out, self._cache_kw), out.logits[:, -1, :]
        if once:
            cache.reorder_cache(rows)  # every layer's keys and values, one copy per row
            logits = logits[rows]
            if keep_hidden:
                out.hidden_states = tuple(h[rows] for h in out.hidden_states)
        return out, cache, logits, prompt_routes

    def sample_stream(self, prompt_ids, prompt_mask, *, slots: int, max_new_tokens: int, temperature: float,
                      top_p: float, generator, keep_dist: bool = False, keep_logits: bool = False, forced=None,
                      draws=None, kv_dtype: str | None = None) -> Samples:
        """:meth:`sample` with continuous batching: at most ``slots`` rows decode at once, and the slot of a row that
        finishes (EOS, its ``max_new_tokens``-th token, the end of its ``forced`` tokens) goes to a waiting row.
        Waiting rows are prefilled together once :meth:`admit_at` slots are free and appended to the running batch: their cache left-padded to the
        batch's length, the padding masked, their positions their own. With every completion full length this decodes
        what :meth:`sample` does in chunks of ``slots``; where completions end early it runs fewer decode steps.

        Each row samples as it would alone (as far as the kernels round alike): ``draws`` keys each row, and row
        ``r``'s token ``t`` takes the draw of step ``t`` whatever step of the batch that is. Eager decode only (a graph
        replays fixed rows) and no hidden states. Under expert parallelism every rank prefills when any rank admits
        rows and decodes until every rank is done (a one-token filler forward where it has nothing to run).
        """
        import torch

        from orbitctl.model.draws import KeyedDraws
        from orbitctl.kernels.kv_cache import append_rows, new_kv_cache
        from orbitctl.model.router_replay import NOT_RECORDED, ROUTE_DTYPE

        if slots < 1:
            raise ValueError(f"slots must be at least 1, not {slots}")
        if forced is not None:
            forced_ids, forced_mask = (t.cpu() for t in forced)
            max_new_tokens = forced_ids.shape[1]
        self.set_mode(train=False)
        device, kv = self.device, kv_dtype or self.kv_dtype
        total, width = prompt_ids.shape
        routing = self.routing
        waiting, active = list(range(total)), []
        tokens: list[list[int]] = [[] for _ in range(total)]
        kept: list[list[int]] = [[] for _ in range(total)]
        logps: list[list[float]] = [[] for _ in range(total)]
        dist = raw = None  # keep_dist / keep_logits: [total, max_new_tokens, V], each row's step written in place
        fed_routes: list[list] = [[] for _ in range(total)]
        prompt_routes = None if routing is None else torch.full(
            (total, width, routing.layers, routing.top_k), NOT_RECORDED, dtype=ROUTE_DTYPE)
        cache = mask = position = logits = None
        with torch.no_grad():
            while True:
                free = slots - len(active)
                # admitted together once a share of the slots is free (each admission is one prefill forward), or
                # when the batch would otherwise run dry
                admit = waiting[:free] if free >= min(self.admit_at(slots), len(waiting)) or not active else []
                del waiting[:len(admit)]
                if self.lockstep.rounds(len(admit)):  # any rank admits: every rank prefills (a filler where none)
                    ids, m = (prompt_ids[admit], prompt_mask[admit]) if admit else self.filler()
                    ids, m = ids.to(device), m.to(device)
                    fresh = new_kv_cache(kv, self.model.config, max_new_tokens)
                    new_cache, new_logits, routes = self._prefill(ids, m, fresh)[1:]
                    if admit:
                        if routes is not None:
                            prompt_routes[admit] = routes
                        if not active:
                            cache, mask, logits = new_cache, m, new_logits
                            position = m.sum(-1, keepdim=True)
                        else:
                            length = max(mask.shape[1], m.shape[1])
                            append_rows(cache, new_cache)
                            mask = torch.cat([_pad_columns(mask, length), _pad_columns(m, length)])
                            position = torch.cat([position, m.sum(-1, keepdim=True)])
                            logits = torch.cat([logits, new_logits])
                        active += admit
                    new_logits = None  # not held through the decode steps that follow
                if self.lockstep.all_done(not active and not waiting):
                    break
                if active:
                    steps = [len(tokens[r]) for r in active]
                    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
                    logdist = torch.log_softmax(scaled, dim=-1)
                    row_draws = KeyedDraws(draws.seed, tuple(draws.keys[r] for r in active)) if draws is not None else None
                    token = forced_ids[active, steps].to(device) if forced is not None else _drawn(
                        scaled, temperature=temperature, top_p=top_p, generator=generator, draws=row_draws, step=steps)
                    alive = forced_mask[active, steps].bool() if forced is not None else torch.ones(len(active), dtype=torch.bool)
                    token = torch.where(alive.to(device), token, torch.full_like(token, self.pad_id))
                    logp = logdist.gather(-1, token[:, None]).squeeze(-1).cpu() * alive
                    chosen = token.cpu().tolist()
                    if keep_dist and dist is None:
                        dist = torch.zeros(total, max_new_tokens, logdist.shape[-1])
                    if keep_logits and raw is None:
                        raw = torch.zeros(total, max_new_tokens, scaled.shape[-1])
                    host_dist = logdist.cpu() if keep_dist else None
                    host_raw = scaled.cpu() if keep_logits else None
                    going = []
                    alive_rows, logp_rows = alive.tolist(), logp.tolist()  # one read each, not one per row
                    for i, (r, t) in enumerate(zip(active, steps)):
                        tokens[r].append(chosen[i])
                        kept[r].append(int(alive_rows[i]))
                        logps[r].append(logp_rows[i])
                        if keep_dist:
                            dist[r, t] = host_dist[i]
                        if keep_logits:
                            raw[r, t] = host_raw[i]
                        ended = t + 1 >= max_new_tokens or (
                            not forced_mask[r, t + 1:].any() if forced is not None else chosen[i] == self.eos_id)
                        if not ended:
                            going.append(i)
                    host_dist = host_raw = None  # copied into the rows: not held through the next step's sampling
                    if len(going) < len(active):  # finished rows leave the batch: their cache rows, mask, positions
                        index = torch.tensor(going, dtype=torch.long, device=device)
                        cache.batch_select_indices(index)
                        mask, position, token = mask[index], position[index], token[index]
                        active = [active[i] for i in going]
                if active:
                    mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
                    if routing is not None:
                        routing.record()
                    out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                                     use_cache=True, **{self._cache_kw: cache})
                    cache, logits = getattr(out, self._cache_kw), out.logits[:, -1, :]
                    position = position + 1
                    if routing is not None:  # the token each row fed: its experts, per MoE layer
                        chosen_experts = torch.stack([c.reshape(len(active), routing.top_k)
                                                      for c in routing.pop_last()], dim=1).cpu()
                        routing.off()
                        for i, r in enumerate(active):
                            fed_routes[r].append(chosen_experts[i])
                elif self.lockstep.shared:  # the other ranks' decode forward, matched
                    ids, m = self.filler()
                    self.model(input_ids=ids.to(device), attention_mask=m.to(device), use_cache=False)
        if routing is not None:
            routing.off()
        return _stream_samples(prompt_ids, prompt_mask, tokens, kept, logps, dist, raw,
                               fed_routes if routing is not None else None, prompt_routes, self.pad_id)

    ADMIT_SHARE = 4
    """:meth:`sample_stream` admits waiting rows once 1/ADMIT_SHARE of its slots are free."""

    def admit_at(self, slots: int) -> int:
        """Free slots :meth:`sample_stream` waits for before it prefills waiting rows (fewer when fewer wait)."""
        return max(1, slots // self.ADMIT_SHARE)

    def filler(self):
        """A one-token batch for a rank that has run out of work while others have not (see ``lockstep``)."""
        import torch

        return torch.full((1, 1), self.pad_id, dtype=torch.long), torch.ones((1, 1), dtype=torch.long)

    def decode(self, completion_ids, completion_mask) -> list[str]:
        rows = []
        for ids, m in zip(completion_ids.tolist(), completion_mask.tolist()):
            rows.append(self.tokenizer.decode([t for t, k in zip(ids, m) if k], skip_special_tokens=True))
        return rows

    # -- train path ----------------------------------------------------------------------
    def completion_logits(self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, train: bool = True,
                          with_hidden: bool = False, routes=None, replay: bool | None = None):
        """Logits that predict each completion token, [B, T, V], from one full-sequence forward.

        ``with_hidden`` also returns the hidden states at the same positions, [B, T, L+1, H].
        ``routes`` [B, T, L_moe, k] (an MoE model's recorded routing, :attr:`Samples.routes`): the completion's
        tokens run those experts when ``replay`` (default :attr:`router_replay`), else the router's own choice is
        kept beside them for :meth:`routing_agreement`.
        """
        import torch

        if self.routing is not None:
            self.routing.follow(routes, prompt_ids.shape[1], replay=self.router_replay if replay is None else replay)
        device = self.device
        ids = torch.cat([prompt_ids, completion_ids], dim=1).to(device)
        mask = torch.cat([prompt_mask, completion_mask], dim=1).to(device)
        self.set_mode(train)
        start, length = prompt_ids.shape[1] - 1, completion_ids.shape[1]
        # position start + i predicts completion token i; the last position predicts nothing kept
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=False,
                         output_hidden_states=with_hidden, **self._last_logits(length + 1))
        first = out.logits.shape[1] - (ids.shape[1] - start)  # 0 when every position's logits came back
        logits = out.logits[:, first:first + length, :]
        if not with_hidden:
            return logits
        return logits, torch.stack([h[:, start:start + length, :].float() for h in out.hidden_states], dim=2)

    @property
    def output_layer(self):
        """The output layer (lm_head) as the forward calls it: the same module, weights (tied or not) and hooks."""
        return self.model.get_output_embeddings()

    def routing_agreement(self, routes, prompt_width: int, mask=None):
        """Per MoE layer, the completion tokens whose top-k experts the last train-path forward (given ``routes``)
        chose as ``routes`` records (:class:`~orbitctl.model.router_replay.Agreement`)."""
        return self.routing.agreement(routes, prompt_width, mask)

    def completion_hidden(self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, train: bool = True,
                          routes=None):
        """The final hidden states (after the last norm) that :meth:`completion_logits` feeds the output layer,
        [B, T, H]: for a caller that applies :attr:`output_layer` itself, a chunk of positions at a time
        (``memory.loss_chunk_size``: :mod:`orbitctl.rl.chunked_loss`).

        The same forward runs, ``logits_to_keep`` included, with the output layer passing its input through, so
        whatever wraps it (DeepSpeed's hooks) sees the call as before and no [B, T, V] tensor is made.
        """
        with _passed_through(self.output_layer):
            return self.completion_logits(prompt_ids, prompt_mask, completion_ids, completion_mask, train=train,
                                          routes=routes)

    def reference_logits(self, prompt_ids, prompt_mask, completion_ids, completion_mask, routes=None):
        """The reference policy (adapters disabled, no grad): no second copy of the model; ``routes`` replayed
        like the train path's."""
        import torch

        with torch.no_grad(), adapters_disabled(self.model):
            return self.completion_logits(prompt_ids, prompt_mask, completion_ids, completion_mask, train=False,
                                          routes=routes)


def _pad_columns(mask, length: int):
    """``mask`` [B, L] left-padded with zeros to ``length`` columns."""
    import torch

    missing = length - mask.shape[1]
    return mask if missing <= 0 else torch.cat([mask.new_zeros((mask.shape[0], missing)), mask], dim=1)


def _stream_samples(prompt_ids, prompt_mask, tokens, kept, logps, dist, raw, fed_routes, prompt_routes,
                    pad_id: int) -> Samples:
    """:class:`Samples` of :meth:`Policy.sample_stream`'s per-row lists, right-padded to the longest row; ``dist`` and
    ``raw`` ([rows, max_new_tokens, V], written as the rows decoded, or None) narrowed to it."""
    import torch

    from orbitctl.model.router_replay import NOT_RECORDED, ROUTE_DTYPE

    total, width = len(tokens), max((len(t) for t in tokens), default=0)

    def padded(rows, fill, dtype):  # one tensor from the rows' lists, not one per row
        return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=dtype).reshape(total, width)

    ids, mask, logprobs = padded(tokens, pad_id, torch.long), padded(kept, 0, torch.long), padded(logps, 0.0, torch.float32)
    dist, raw = (t[:, :width] if t is not None else None for t in (dist, raw))
    routes = None
    if fed_routes is not None:
        layers, k = prompt_routes.shape[2:]
        routes = torch.full((total, width, layers, k), NOT_RECORDED, dtype=ROUTE_DTYPE)
    for r in range(total if routes is not None else 0):
        if fed_routes[r]:
            fed = torch.stack(fed_routes[r]).to(ROUTE_DTYPE)
            routes[r, :len(fed)] = fed.masked_fill(~mask[r, :len(fed)].bool()[:, None, None], NOT_RECORDED)
    return Samples(prompt_ids.cpu(), prompt_mask.cpu(), ids, mask, logprobs, dist, raw, None, routes, prompt_routes)


@contextmanager
def _passed_through(layer):
    """While active, ``layer`` returns its input: its hooks still run, its own computation does not."""
    own = layer.__dict__.get("forward")  # a hook library may have set forward on the instance
    layer.forward = lambda hidden, *args, **kwargs: hidden
    try:
        yield
    finally:
        if own is None:
            del layer.forward
        else:
            layer.forward = own
