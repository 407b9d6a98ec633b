"""Run a model sublayer by sublayer over one preallocated KV cache.

Sublayers are numbered in execution order: sublayer 2*i is layer i's attention, 2*i+1 its
MLP. A forward pass may skip some of them (the draft), may stop to hand back the hidden
state entering a given sublayer (so the verify pass need not recompute the layers the draft
already ran exactly), and may resume from such hidden states.

Cache invariant kept by the decode loop: positions [0, committed) hold the full model's keys
and values. A pass writes positions [start, start+n) of every attention sublayer it runs;
later passes overwrite whatever drafts left beyond the committed length.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from selfspec.runtime.adapters import adapter_for

if TYPE_CHECKING:
    from selfspec.runtime.draft_vocab import DraftVocab


class KVCache:
    """Static key/value buffers for every layer, written at ``write_pos`` by HF attention
    modules."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype, device
    ):
        """``device``: one device (the buffers stacked [layers, 1, heads, max_len, head_dim]) or
        one per layer (a list of [1, heads, max_len, head_dim] buffers, for a model spread over
        devices)."""
        if isinstance(device, list):
            shape = (1, num_kv_heads, max_len, head_dim)
            self.keys = [torch.zeros(shape, dtype=dtype, device=d) for d in device]
            self.values = [torch.zeros(shape, dtype=dtype, device=d) for d in device]
        else:
            shape = (num_layers, 1, num_kv_heads, max_len, head_dim)
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.write_pos = 0
        # views made once: a batch pass asks for every sequence's, layer after layer
        self._layer_views = [(k[0], v[0]) for k, v in zip(self.keys, self.values)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's key and value buffers, [heads, max_len, head_dim] each."""
        return self._layer_views[i]

    # The only method HF attention modules call on a cache.
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        start, n = self.write_pos, key_states.shape[2]
        end = start + n
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        return keys[:, :, :end], values[:, :, :end]


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[1, 1, queries, keys] bool: key position k is seen from query position q if k <= q (and
    q - k < window). ``q_pos`` [queries, 1], ``k_pos`` [1, keys]."""
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed[None, None]


@dataclass
class ScoredRows:
    """A pass's rows scored over the whole vocabulary: row i read ``ids[i]`` at position
    ``start + i`` and its logits score the token after it (what recycled drafts learn from)."""

    start: int
    ids: list[int]
    logits: torch.Tensor


@dataclass
class Resume:
    """Hidden states entering sublayer ``sublayer`` for the first rows of the next pass's tokens."""

    sublayer: int
    hidden: torch.Tensor  # [1, rows, hidden_size]


class ModelRunner:
    """One model, its adapter and its KV cache; ``forward`` is the only way tokens go through it."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.model = loaded.model
        self.adapter = adapter_for(self.model, loaded.fused)
        self.num_layers = self.adapter.num_layers
        self.num_sublayers = 2 * self.num_layers
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.cache: KVCache | None = None
        self.last_hidden: torch.Tensor | None = None  # [rows, hidden]: the last pass's final states
        self.last_scored: ScoredRows | None = None  # the last pass's rows over the whole vocabulary
        # [scored rows, hidden]: the last forward_many's final states (what batch head drafts read)
        self.last_rows_hidden: torch.Tensor | None = None
        self.context_window = getattr(self.model.config, "max_position_embeddings", None)
        self.head_rows = self.model.get_output_embeddings().out_features  # logits per token
        self.windows = {
            self.adapter.window(i) for i in range(self.num_layers)
        }  # None: full attention
        self.layer_stack = self._layer_stack()

    def _layer_stack(self):
        """The kernel's ``LayerStack`` over the fused layers (a pass's sublayers in one native
        call), where every layer attends to the whole context and the cache lives on one device;
        else None (one call per sublayer)."""
        fused = self.adapter.fused
        if fused is None or self.windows != {None} or self.loaded.device_map is not None:
            return None
        from selfspec.kernels import load_kernel

        return load_kernel().LayerStack(fused)

    @functools.cached_property
    def head_share(self) -> float:
        """The output head's share of a scored row's multiply-adds (a prompt row that needs no
        logits skips it); 0 where the config does not say."""
        config, a = self.model.config, self.adapter
        hidden, inner = config.hidden_size, getattr(config, "intermediate_size", None)
        heads = getattr(config, "num_attention_heads", None)
        if inner is None or heads is None:
            return 0.0
        q, kv = heads * a.head_dim, a.num_kv_heads * a.head_dim
        layer = hidden * (2 * q + 2 * kv) + 3 * hidden * inner  # q, o, k, v; gate, up, down
        head = self.head_rows * hidden
        return head / (head + self.num_layers * layer)

    @property
    def trees(self) -> bool:
        """Whether ``forward`` verifies tree drafts here with each row's one-token bits: the
        kernel's layer stack, whose attention adds a hidden key's exact zero (a tree row sees
        what a one-token pass at its depth would see, in the same order)."""
        return self.layer_stack is not None and self.adapter.fused is not None

    @property
    def can_batch(self) -> bool:
        """Whether ``forward_many`` runs here: fused kernel layers and full attention only."""
        return self.adapter.fused is not None and self.windows == {None}

    def new_cache(self, max_len: int) -> KVCache:
        """A cache for ``max_len`` positions (the runner's own, or one more sequence's for
        ``forward_many`` and ``using``)."""
        a = self.adapter
        device = self.device
        if self.loaded.device_map is not None:  # each layer's cache beside its attention
            from selfspec.loading.placement import execution_device

            device = [
                execution_device(self.loaded.device_map, f".layers.{i}.self_attn")
                for i in range(a.num_layers)
            ]
        return KVCache(a.num_layers, a.num_kv_heads, a.head_dim, max_len, self.dtype, device)

    @contextlib.contextmanager
    def using(self, cache: KVCache):
        """Run passes over ``cache`` instead of the runner's own for a while."""
        own, self.cache = self.cache, cache
        try:
            yield
        finally:
            self.cache = own

    @torch.inference_mode()
    def forward_many(
        self,
        caches: list[KVCache],
        tokens: list[int],
        positions: list[int],
        scored: list[int] | None = None,
    ) -> torch.Tensor:
        """Rows of several sequences in one pass, row m's token at ``positions[m]`` of its
        sequence's cache ``caches[m]`` (a sequence's rows at consecutive positions, each seeing its
        cache up to its own position): logits [len(scored), vocab] of the rows ``scored`` (all
        rows if None). Every row gets the bits of its sequence's own one-token pass (rows never
        mix), so batching changes no token. The scored rows' final hidden states stay in
        ``last_rows_hidden``."""
        a, m = self.adapter, len(tokens)
        self.last_hidden = None  # rows of several sequences: not one sequence's to draft from
        self.last_scored = None
        hidden = a.embed(torch.tensor(tokens, device=self.device).view(1, m))
        cos, sin = a.position_embeddings(
            hidden, torch.tensor(positions, device=self.device).view(1, m)
        )[a.layer_types[0]]
        rows = hidden.reshape(m, -1)
        for i in range(self.num_layers):
            views = [c.layer(i) for c in caches]
            keys, values = [k for k, _ in views], [v for _, v in views]
            rows = a.fused[i].attention_many(rows, cos, sin, keys, values, positions)
            rows = a.fused[i].mlp(rows)
        if scored is not None:
            rows = rows[scored]
        self.last_rows_hidden = rows
        if not len(rows):  # prompt rows only, none of them a prompt's last
            return torch.empty(0, self.head_rows)
        return a.logits(rows.view(1, len(rows), -1))[0].float()

    def reset(self, max_len: int) -> None:
        """Make a cache for ``max_len`` positions, reusing the current one when it is big enough."""
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.new_cache(max_len)

    def _masks(self, start: int, n: int) -> dict:
        """Boolean masks [1, 1, n, start+n] per attention window; None where SDPA needs none."""
        masks = {}
        q_pos = torch.arange(start, start + n, device=self.device)[:, None]
        k_pos = torch.arange(start + n, device=self.device)[None, :]
        for window in self.windows:
            needs_window = window is not None and start + n > window
            if n == 1 and not needs_window:
                # one query attends to everything cached: same call as HF decoding
                masks[window] = None
            elif start == 0 and not needs_window:
                masks[window] = None  # SDPA applies is_causal itself, as in HF prefill
            else:
                masks[window] = attention_mask(q_pos, k_pos, window)
        return masks

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        start: int,
        skip_attention: frozenset = frozenset(),
        skip_mlp: frozenset = frozenset(),
        resume: Resume | None = None,
        capture_at: int | None = None,
        last_logits_only: bool = False,
        vocab: int | DraftVocab | None = None,
        tree: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Score ``input_ids`` ([n] tokens at positions start..start+n-1).

        Returns (logits [n, vocab], hidden entering sublayer ``capture_at`` [1, n, hidden] or None).
        With ``vocab``, only the first ``vocab`` token ids are scored (a cheaper draft head), or a
        ``DraftVocab``'s ids (its base ids, then its extra ids).
        With ``resume``, its rows are the first tokens' hidden states entering ``resume.sublayer``;
        only the remaining tokens run the sublayers before it.
        With ``tree`` (where ``trees``), token i + 1 follows token ``tree[i] + 1`` (0: the first),
        at the position after its parent's, and sees only the cache before ``start`` and its
        ancestors; ``keep_path`` then moves the kept rows' keys and values into place.
        """
        a = self.adapter
        n = input_ids.shape[-1]
        ids = input_ids.view(1, n).to(self.device)
        if tree is not None:
            hidden, first = self._tree_pass(ids, start, tree), self.num_sublayers
        elif resume is not None and resume.hidden.shape[1] < n:
            # Catch the rows the resume does not cover up to the resume point (one token, usually).
            k = resume.hidden.shape[1]
            tail, _ = self._run(
                ids[:, k:], start + k, 0, resume.sublayer, skip_attention, skip_mlp, None, None
            )
            hidden = torch.cat([resume.hidden, tail], dim=1)
            first = resume.sublayer
        elif resume is not None:
            hidden, first = resume.hidden, resume.sublayer
        else:
            hidden, first = a.embed(ids), 0
        captured = None
        if tree is None:
            hidden, captured = self._run(
                ids, start, first, self.num_sublayers, skip_attention, skip_mlp, hidden, capture_at
            )
        if last_logits_only:  # prefill: the head over every prompt token would be wasted work
            hidden = hidden[:, -1:]
        self.last_hidden = hidden[0]  # what draft heads read (drafters.heads)
        logits = a.logits(hidden, vocab)[0].float()
        self.keep_scored(ids[0], start, logits, vocab)
        return logits, captured

    def keep_scored(self, ids: torch.Tensor, start: int, logits: torch.Tensor, vocab) -> None:
        """Keep a pass's logits [rows, vocab] over its last rows (``last_scored``), unless they
        score a draft's ids only (``vocab``)."""
        if vocab is not None:
            self.last_scored = None
            return
        first = ids.shape[0] - logits.shape[0]
        self.last_scored = ScoredRows(start + first, ids[first:].tolist(), logits)

    def _tree_pass(self, ids: torch.Tensor, start: int, parents: list[int]) -> torch.Tensor:
        """Every sublayer over a tree's rows (``forward``'s ``tree``): the final hidden states."""
        if not self.trees:
            raise ValueError("tree drafts need the kernel's layer stack (ModelRunner.trees)")
        n = ids.shape[1]
        depth = [0] * n
        seen = torch.eye(n, dtype=torch.bool)  # row r sees row c: c is r or one of its ancestors
        for i, parent in enumerate(parents, start=1):
            depth[i] = depth[parent + 1] + 1
            seen[i] |= seen[parent + 1]
        mask = torch.ones(n, start + n, dtype=torch.bool)
        mask[:, start:] = seen
        hidden = self.adapter.embed(ids)
        positions = (start + torch.tensor(depth, device=self.device))[None]
        rope = self.adapter.position_embeddings(hidden, positions)
        self.cache.write_pos = start
        full = frozenset()
        hidden, _ = self._stacked(hidden, rope, mask, 0, self.num_sublayers, full, full, None)
        return hidden

    def keep_path(self, start: int, rows: list[int]) -> None:
        """After a tree pass from ``start``: the kept rows (0, then each kept token's row, in
        order) become positions start, start + 1, ...: their keys and values move into place,
        and the last pass's final states and scored rows are theirs, as after a chain."""
        cache = self.cache
        for i, row in enumerate(rows):
            if row != i:  # rows only grow along a path: row >= i, so nothing read is overwritten
                cache.keys[:, :, :, start + i] = cache.keys[:, :, :, start + row]
                cache.values[:, :, :, start + i] = cache.values[:, :, :, start + row]
        index = torch.tensor(rows)
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden[index]
        scored = self.last_scored
        if scored is not None and scored.start == start:
            self.last_scored = ScoredRows(
                start, [scored.ids[r] for r in rows], scored.logits[index]
            )

    def _run(self, ids, start, first, stop, skip_attention, skip_mlp, hidden, capture_at):
        """Run sublayers [first, stop) over ``hidden`` (embedding ``ids`` if None)."""
        a = self.adapter
        n = ids.shape[1]
        if hidden is None:
            hidden = a.embed(ids)
        positions = torch.arange(start, start + n, device=self.device)[None]
        rope = a.position_embeddings(hidden, positions)
        self.cache.write_pos = start
        return self._sublayers(
            hidden, rope, self._masks(start, n), first, stop, skip_attention, skip_mlp, capture_at
        )

    def _sublayers(self, hidden, rope, masks, first, stop, skip_attention, skip_mlp, capture_at):
        """The layer stack from sublayer ``first`` to ``stop``; returns (hidden, hidden entering
        ``capture_at``)."""
        # fused is checked too: StaticRunner (and tests of the module path) turn the fused
        # layers off after the stack was built
        if self.layer_stack is not None and self.adapter.fused is not None:
            return self._stacked(
                hidden, rope, masks[None], first, stop, skip_attention, skip_mlp, capture_at
            )
        a = self.adapter
        captured = None
        for sub in range(first, stop):
            if sub == capture_at:
                captured = hidden
            layer = sub // 2
            if sub % 2 == 0:
                if layer not in skip_attention:
                    hidden = a.attention(layer, hidden, rope, masks[a.window(layer)], self.cache)
            elif layer not in skip_mlp:
                hidden = a.mlp(layer, hidden)
        if capture_at is not None and capture_at >= stop:
            captured = hidden
        return hidden, captured

    def _stacked(self, hidden, rope, mask, first, stop, skip_attention, skip_mlp, capture_at):
        """``_sublayers`` through the kernel's ``LayerStack``: the same layer calls, made from
        native code (two runs when the hidden state entering ``capture_at`` is wanted)."""
        a, cache = self.adapter, self.cache
        cos, sin = rope[a.layer_types[0]]
        skips = (
            [i in skip_attention for i in range(self.num_layers)],
            [i in skip_mlp for i in range(self.num_layers)],
        )

        def run(rows, lo, hi):
            return self.layer_stack.run(
                rows, cos, sin, cache.keys, cache.values, cache.write_pos, mask, lo, hi, *skips
            )

        rows, captured = hidden.reshape(-1, hidden.shape[-1]), None
        if capture_at is not None and first <= capture_at < stop:
            rows = run(rows, first, capture_at)
            captured = rows.view(hidden.shape)
            first = capture_at
        rows = run(rows, first, stop).view(hidden.shape)
        if capture_at is not None and capture_at >= stop:
            captured = rows
        return rows, captured
