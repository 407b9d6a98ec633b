"""Fixed-shape passes over a static cache: the runner on CUDA, replayed as CUDA graphs.

On a GPU a decoding step of a small model is bound by kernel launches, not by memory: a pass
of the 1.5B is about 1,300 small kernels, each launched from Python. A CUDA graph
records them once and replays them with one launch. A graph fixes every shape and address,
so this runner makes every pass after prefill look the same:

- it runs exactly ``PASS_ROWS`` token rows: a draft step is row 0 of 16, a verify pass over
  k+1 tokens rows 0..k. Unused rows continue the positions; the keys and values they write lie
  beyond the committed length, where later passes overwrite them before anything reads them
  (the cache invariant of ``selfspec.runtime.runner``). Longer passes run as consecutive 16-row
  passes.
- positions live in a device tensor: keys and values are written with ``index_copy_`` and
  attention reads the whole buffer through a mask built from the positions, so one graph
  serves every position of a generation.

Fixed shapes also keep greedy speculation identical to plain decoding. cuBLAS and SDPA pick
their kernels (and so their summation order) by shape: with a row count that follows the
draft length, a verify pass's rows differ from one-token passes in the last bits, enough in
bfloat16 to change a token now and then. With one shape, a row's result does not depend on
the pass it is in (tested on the GPU, and bit for bit on the CPU with the packed kernels).

Prefill runs once, eagerly and unpadded: every method prefills the same prompt the same way.
Graphs are captured on first use of each kind of pass (the draft step, the verify pass, with
or without the draft's hidden states) and dropped when the cache has to grow.
"""

from __future__ import annotations

import torch

from selfspec.runtime.runner import KVCache, ModelRunner, Resume, attention_mask

PASS_ROWS = 16  # rows of every pass after prefill: max_draft_tokens + 1 up to 16 fit in one
_CACHE_ROUNDING = 256  # cache lengths are rounded up so a longer prompt rarely forces new graphs
# a search tries a new skip set per trial: keep the most recent kinds only (each holds memory)
MAX_GRAPHS = 8


class StaticKVCache(KVCache):
    """Keys/values written at the positions in ``positions`` (a device tensor); reads return the
    whole buffer."""

    positions: torch.Tensor | None = None  # [rows], set by the runner for each pass

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]  # [1, kv_heads, max_len, hd]
        keys.index_copy_(2, self.positions, key_states)
        values.index_copy_(2, self.positions, value_states)
        return keys, values


class StaticRunner(ModelRunner):
    """``ModelRunner`` with fixed-shape passes; ``graphs``: replay them as CUDA graphs (CUDA only);
    ``compile``: pass them through torch.compile first (with graphs only)."""

    def __init__(self, loaded, graphs: bool = True, compile: bool = False):
        super().__init__(loaded)
        # Fixed-shape passes address the cache through position tensors and whole-cache masks,
        # which the fused native sublayers do not take: this runner calls the model's modules.
        self.adapter.fused = None
        self.use_graphs = graphs and self.device.type == "cuda"
        # torch.compile (speed mode cuda-compiled) fuses the small ops between the matmuls (norms,
        # rope, activations): 1338 kernels per pass of the 1.5B become 564. Fusion may keep a value
        # in float32 that the eager pass rounds to bfloat16, so a compiled draft's hidden states
        # need not be the bits a compiled full pass has inside: with compile, verify passes never
        # resume from the draft's.
        self.compiled = bool(compile) and self.use_graphs
        self._pass_fn = torch.compile(self._pass, dynamic=False) if self.compiled else self._pass
        hidden_size = self.model.config.hidden_size
        # The static inputs every graph reads; a pass copies its tokens, positions and hidden states
        # in.
        self.ids = torch.zeros(PASS_ROWS, dtype=torch.long, device=self.device)
        self.positions = torch.arange(PASS_ROWS, device=self.device)
        self.hidden_in = torch.zeros(
            1, PASS_ROWS, hidden_size, dtype=self.dtype, device=self.device
        )
        self.key_positions: torch.Tensor | None = None  # [max_len]: 0, 1, ...
        self.graphs: dict[tuple, tuple] = {}  # pass kind -> (CUDA graph, its output tensors)

    def reset(self, max_len: int) -> None:
        needed = max_len + PASS_ROWS  # the last pass's unused rows write past the last token
        if self.cache is None or self.cache.max_len < needed:
            size = -(-needed // _CACHE_ROUNDING) * _CACHE_ROUNDING
            self.graphs.clear()  # they read and write the old buffers
            self.cache = None  # free the old cache before making the new one
            a = self.adapter
            self.cache = StaticKVCache(
                a.num_layers, a.num_kv_heads, a.head_dim, size, self.dtype, self.device
            )
            self.key_positions = torch.arange(size, device=self.device)

    def _static_masks(self, positions: torch.Tensor) -> dict:
        """Boolean masks [1, 1, rows, max_len] per attention window, over the whole cache."""
        return {
            window: attention_mask(positions[:, None], self.key_positions[None, :], window)
            for window in self.windows
        }

    def _pass(
        self,
        ids,
        positions,
        hidden,
        first,
        skip_attention,
        skip_mlp,
        capture_at,
        vocab,
        last_only=False,
    ):
        """One pass from sublayer ``first`` to the logits: (logits, hidden entering ``capture_at``,
        final hidden states [1, rows, hidden]); every shape is that of the inputs."""
        a = self.adapter
        if first == 0:
            hidden = a.embed(ids[None])
        rope = a.position_embeddings(hidden, positions[None])
        self.cache.positions = positions
        hidden, captured = self._sublayers(
            hidden,
            rope,
            self._static_masks(positions),
            first,
            self.num_sublayers,
            skip_attention,
            skip_mlp,
            capture_at,
        )
        if last_only:
            hidden = hidden[:, -1:]
        return a.logits(hidden, vocab)[0].float(), captured, hidden

    @torch.inference_mode()
    def forward(
        self,
        input_ids,
        start,
        skip_attention=frozenset(),
        skip_mlp=frozenset(),
        resume=None,
        capture_at=None,
        last_logits_only=False,
        vocab=None,
        tree=None,
    ):
        """As ``ModelRunner.forward``. ``last_logits_only`` (prefill) runs one eager pass over every
        token; anything else runs in passes of ``PASS_ROWS`` rows. Chains only (``trees`` is
        False here): a ``tree`` is refused."""
        if tree is not None:
            raise ValueError("tree drafts need the kernel's layer stack (ModelRunner.trees)")
        ids = input_ids.reshape(-1).to(self.device)
        n = ids.shape[0]
        if last_logits_only:
            hidden, first = (
                (resume.hidden, resume.sublayer)
                if resume is not None and resume.hidden.shape[1] == n
                else (None, 0)
            )
            positions = torch.arange(start, start + n, device=self.device)
            logits, captured, final = self._pass(
                ids,
                positions,
                hidden,
                first,
                skip_attention,
                skip_mlp,
                capture_at,
                vocab,
                last_only=True,
            )
            self.last_hidden = final[0]  # what draft heads read (drafters.heads)
            self.keep_scored(ids, start, logits, vocab)
            return logits, captured
        logits, captured, final = [], [], []
        for offset in range(0, n, PASS_ROWS):
            rows = min(PASS_ROWS, n - offset)
            part = None
            if resume is not None and resume.hidden.shape[1] >= offset + rows:
                part = Resume(resume.sublayer, resume.hidden[:, offset : offset + rows])
            part_logits, part_captured, part_final = self._fixed_pass(
                ids[offset : offset + rows],
                start + offset,
                skip_attention,
                skip_mlp,
                part,
                capture_at,
                vocab,
            )
            logits.append(part_logits)
            captured.append(part_captured)
            final.append(part_final)
        self.last_hidden = (final[0] if len(final) == 1 else torch.cat(final, dim=1))[0]
        logits = logits[0] if len(logits) == 1 else torch.cat(logits)
        self.keep_scored(ids, start, logits, vocab)
        if capture_at is None:
            return logits, None
        return logits, captured[0] if len(captured) == 1 else torch.cat(captured, dim=1)

    def _fixed_pass(self, ids, start, skip_attention, skip_mlp, resume, capture_at, vocab):
        """Rows ``ids`` (at most PASS_ROWS) at positions start.. as one PASS_ROWS-row pass.

        With ``resume`` covering every row, the pass starts at its sublayer; otherwise it starts
        from the embedding (the rows a resume covers come out the same either way, and rerunning
        them costs nothing extra in a fixed-shape pass).
        """
        rows = ids.shape[0]
        # rows past ``rows`` keep old tokens: their outputs are never read
        self.ids[:rows].copy_(ids)
        self.positions.copy_(torch.arange(start, start + PASS_ROWS))
        first = 0
        if resume is not None and not self.compiled:
            first = resume.sublayer
            self.hidden_in[:, :rows].copy_(resume.hidden)
        kind = (first, skip_attention, skip_mlp, capture_at, vocab)
        if self.use_graphs:
            logits, captured, final = self._replay(kind)
        else:
            logits, captured, final = self._pass(self.ids, self.positions, self.hidden_in, *kind)
        # Graph outputs are overwritten by the next replay: hand out copies of the real rows.
        captured = captured[:, :rows].clone() if captured is not None else None
        return logits[:rows].clone(), captured, final[:, :rows].clone()

    def _replay(self, kind: tuple):
        """Replay the graph of this kind of pass, capturing it first if it is new."""
        entry = self.graphs.get(kind)
        if entry is None:

            def run():
                return self._pass_fn(self.ids, self.positions, self.hidden_in, *kind)

            # Warm up outside the capture (kernel choice, cuBLAS workspaces), on a side stream as
            # torch.cuda.graph asks. It computes the same pass as the replay below, so its cache
            # writes are the ones the replay makes again.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream(self.device).wait_stream(side)
            if len(self.graphs) >= MAX_GRAPHS:
                self.graphs.pop(next(iter(self.graphs)))  # the oldest
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = run()
            entry = self.graphs[kind] = (graph, outputs)
        else:
            self.graphs[kind] = self.graphs.pop(kind)  # most recently used last
        entry[0].replay()
        return entry[1]
