"""Drafts read off the last verify pass: small chained heads on the target's final hidden state.

The verify pass that produced the pending token x (from row i) leaves the full model's final
hidden state h_i behind. A chain of heads walks on from it, each fed the token before the one it
guesses (x first, then its own guesses), and scores tokens through the model's own output head (as
in Medusa; fed the token, as in EAGLE and Hydra, which is what makes the first guess good). A
draft of k tokens costs k heads' small products and k output-head passes over the draft's ids: a
few percent of a target step each, where a layer-skip draft step costs most of one. The heads are
the only weights here that the target lacks; they are trained on the target's own answers
(``selfspec.training.heads``), never on the prompts bench measures.

    s_0 = final_norm(h_i);  y_0 = x
    s_j+1 = s_j + silu(W_j [s_j ; e(y_j)] + b_j);  y_j+1 = argmax output_head(s_j+1) (greedy)

Heads of two layers put a product after the activation: s_j+1 = s_j + D_j silu(W_j [s_j ; e] + b_j)
+ d_j (D_j = I and d_j = 0 is the one-layer head, which is how they start from one-layer heads).

e(y) is the model's input embedding of y scaled to unit RMS. A guess only counts while every guess
before it was right, and then the chain was fed the true tokens: training feeds the true tokens
(teacher forcing) and is exactly what drafting meets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from selfspec.drafters.base import (
    Draft,
    Drafter,
    DraftRequest,
    DraftSettings,
    RoundOutcome,
    tree_draft,
)
from selfspec.drafters.head_tree import grow_tree
from selfspec.errors import SelfSpecError
from selfspec.fileio import atomic_write_bytes
from selfspec.kernels import PANEL, loaded_kernel
from selfspec.memory import return_freed_memory
from selfspec.runtime.draft_vocab import DraftVocab
from selfspec.runtime.sampling import argmax_rows, sample

if TYPE_CHECKING:
    from selfspec.runtime.runner import ModelRunner

FORMAT = "selfspec-draft-heads/2"
FORMAT_TWO_LAYERS = "selfspec-draft-heads/3"  # /2's tensors plus head.j.down.weight / .bias
# Ids a head draft scores (besides the context's): in the answers the shipped heads were trained
# on, the 8192 most frequent cover 95% of a held-out half's tokens (16384: 98%); the guesses they
# lose cost less than scoring twice the rows of the output head for every guess.
FREQUENT_IDS = 8192
TREE_WIDTH = 3  # children a tree node may have: the heads' likeliest next tokens
_KEPT_INPUTS = 4096  # token inputs a drafter keeps (6 KB each at hidden size 1536)

Product = Callable[[torch.Tensor], torch.Tensor]  # x -> W x + b (a head's layer)


def token_input(embedded: torch.Tensor) -> torch.Tensor:
    """A token's input embedding [..., hidden] as the heads read it: scaled to unit RMS."""
    embedded = embedded.float()
    return embedded * torch.rsqrt(embedded.pow(2).mean(-1, keepdim=True) + 1e-6)


def head_step(
    state: torch.Tensor, token: torch.Tensor, product: Product, down: Product | None = None
) -> torch.Tensor:
    """One link of the chain: s + silu(W [s ; e] + b), [..., hidden], with ``product`` computing
    W x + b (training: the float32 weights being learned; drafting: what ``fastest_products``
    chose); heads of two layers apply ``down`` (D y + d) after the activation. ``token`` is
    ``token_input`` of the token before the guess. Training (``selfspec.training.heads``) and
    drafting both go through here."""
    both = torch.cat([state, token.to(state.device, state.dtype)], dim=-1)
    update = F.silu(product(both))
    if down is not None:
        update = down(update)
    return state + update.to(state.dtype)


@dataclass
class DraftHeads:
    """Head j: weight [width, 2 * hidden] and bias [width], float32 (width = hidden); heads of two
    layers also ``downs[j]`` [hidden, width] and ``down_biases[j]`` [hidden]. ``frequent``: token
    ids by how often the training answers used them, most first (None in files from before it):
    the ids a draft scores."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor]
    info: dict  # model, vocab_prefix, training figures: what ``describe`` and the CLI report
    frequent: torch.Tensor | None = None
    downs: list[torch.Tensor] | None = None
    down_biases: list[torch.Tensor] | None = None
    # the bundled model whose heads these are, lent to a file of its weights quantized another
    # way (Engine.default_heads); not saved with them
    borrowed_from: str | None = None

    @property
    def hidden_size(self) -> int:
        return self.weights[0].shape[1] // 2

    @property
    def layers(self) -> int:
        return 1 if self.downs is None else 2

    @property
    def vocab_prefix(self) -> int:
        return int(self.info.get("vocab_prefix", 32768))

    def __len__(self) -> int:
        return len(self.weights)

    def draft_vocab(self, size: int) -> int | torch.Tensor:
        """The base of the ids a draft scores in a ``size``-id vocabulary: the ``FREQUENT_IDS``
        most frequent ids, or (no frequencies) the first ``vocab_prefix`` ids."""
        if self.frequent is None:
            return min(self.vocab_prefix, size)
        return self.frequent[self.frequent < size][:FREQUENT_IDS]

    def mapped(self, change: Callable[[torch.Tensor], torch.Tensor]) -> DraftHeads:
        """These heads with ``change`` applied to every weight and bias (the rest kept)."""

        def changed(tensors):
            return None if tensors is None else [change(t) for t in tensors]

        return replace(
            self,
            weights=changed(self.weights),
            biases=changed(self.biases),
            downs=changed(self.downs),
            down_biases=changed(self.down_biases),
        )

    def to(self, device, dtype: torch.dtype = torch.float32) -> DraftHeads:
        return self.mapped(lambda t: t.to(device, dtype))

    def shell(self) -> DraftHeads:
        """These heads' shapes, figures and ids without their numbers (tensors on the meta
        device): what a drafter keeps once its products hold the weights they read."""
        return self.mapped(lambda t: t.to("meta"))

    def detached(self) -> DraftHeads:
        """Float32 copies on the CPU, out of any autograd graph (trained heads, kept)."""
        return self.mapped(lambda t: t.detach().float().cpu().clone())

    def two_layers(self) -> DraftHeads:
        """These heads as heads of two layers that compute the same (D = I, d = 0): a start for
        training two-layer heads."""
        if self.downs is not None:
            return self
        eye = torch.eye(self.hidden_size, device=self.weights[0].device)
        downs = [eye.clone() for _ in self.weights]
        zeros = [torch.zeros_like(b) for b in self.biases]
        return replace(self, downs=downs, down_biases=zeros)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save

        tensors = {}
        for j, (w, b) in enumerate(zip(self.weights, self.biases)):
            tensors[f"head.{j}.weight"] = w.to(torch.float16).contiguous()
            tensors[f"head.{j}.bias"] = b.to(torch.float16).contiguous()
        for j, (w, b) in enumerate(zip(self.downs or [], self.down_biases or [])):
            tensors[f"head.{j}.down.weight"] = w.to(torch.float16).contiguous()
            tensors[f"head.{j}.down.bias"] = b.to(torch.float16).contiguous()
        if self.frequent is not None:
            tensors["frequent"] = self.frequent.to(torch.int32).contiguous()
        form = FORMAT if self.downs is None else FORMAT_TWO_LAYERS
        meta = {"format": form, "info": json.dumps(self.info, sort_keys=True)}
        atomic_write_bytes(Path(path), save(tensors, metadata=meta))

    @classmethod
    def load(cls, path: str | Path, hidden_size: int | None = None) -> DraftHeads:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise SelfSpecError(f"draft heads file {path} does not exist")
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            tensors = {k: t if k == "frequent" else t.float() for k, t in tensors.items()}
        except Exception as e:
            raise SelfSpecError(
                f"cannot read draft heads {path} ({e}); train them again with selfspec train-heads"
            ) from None
        if meta.get("format") == "selfspec-draft-heads/1":
            raise SelfSpecError(
                f"{path} holds draft heads of an older selfspec (unchained); train them again "
                "with selfspec train-heads"
            )
        if meta.get("format") not in (FORMAT, FORMAT_TWO_LAYERS):
            raise SelfSpecError(
                f"{path} is not a selfspec draft heads file ({FORMAT} or {FORMAT_TWO_LAYERS})"
            )
        count = len([k for k in tensors if k.endswith(".weight") and ".down." not in k])
        frequent = tensors.get("frequent")
        two = meta["format"] == FORMAT_TWO_LAYERS
        try:
            heads = cls(
                [tensors[f"head.{j}.weight"] for j in range(count)],
                [tensors[f"head.{j}.bias"] for j in range(count)],
                json.loads(meta.get("info", "{}")),
                frequent.long() if frequent is not None else None,
                [tensors[f"head.{j}.down.weight"] for j in range(count)] if two else None,
                [tensors[f"head.{j}.down.bias"] for j in range(count)] if two else None,
            )
        except KeyError as missing:
            raise SelfSpecError(
                f"draft heads {path} lack the tensor {missing}; train them again with selfspec "
                "train-heads"
            ) from None
        for j, down in enumerate(heads.downs or []):
            if down.shape != (heads.hidden_size, heads.weights[j].shape[0]):
                raise SelfSpecError(
                    f"draft heads {path}: head {j}'s second layer has the shape "
                    f"{tuple(down.shape)}; train them again with selfspec train-heads"
                )
        if hidden_size is not None and heads.hidden_size != hidden_size:
            raise SelfSpecError(
                f"draft heads {path} were trained for hidden size {heads.hidden_size}, this model "
                f"has {hidden_size}: train heads for it with selfspec train-heads"
            )
        return heads

    def describe(self) -> str:
        top1 = self.info.get("heldout_top1")
        kept = f", first guess right on {top1:.0%} of held-out answer tokens" if top1 else ""
        layers = " of two layers" if self.downs is not None else ""
        learned = self.info.get("learned_tokens", self.info.get("rows"))
        use = self.info.get("learned_from_use")
        source = (
            f", learned from {learned:,} answer tokens" + (f" ({use:,} from use)" if use else "")
            if learned
            else ""
        )
        if self.borrowed_from:  # a file of the same weights, quantized another way
            source += f", {self.borrowed_from}'s (this file holds its weights)"
        return f"{len(self)} chained draft head(s){layers} on the final hidden state{kept}{source}"

    def steps(self) -> list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """Per head, (state, token input) -> next state in float32 (training and measuring)."""
        downs = self.downs or [None] * len(self)
        down_biases = self.down_biases or [None] * len(self)
        return [
            partial(
                head_step,
                product=partial(F.linear, weight=w, bias=b),
                down=None if d is None else partial(F.linear, weight=d, bias=c),
            )
            for w, b, d, c in zip(self.weights, self.biases, downs, down_biases)
        ]


class HeadDrafter(Drafter):
    """Drafts up to ``len(heads)`` tokens from the hidden state of the row that produced the
    pending token (the runner keeps the last pass's final hidden states)."""

    name = "heads"

    def __init__(self, runner: ModelRunner, heads: DraftHeads, stop_ids: tuple[int, ...] = ()):
        super().__init__()
        self.runner = runner
        self.products, self.down_products = fastest_products(heads.to(runner.device), runner.device)
        # the products hold what drafting reads (8-bit or bfloat16 copies, or the float32 weights
        # themselves): float32 weights beside a copy would be the heads' size again, unread
        self.heads = heads.shell()
        base = heads.draft_vocab(runner.head_rows)
        self.vocab = DraftVocab(base, runner.head_rows, always=stop_ids)
        self.vocab.prepare(runner.adapter.model.lm_head)
        # the arithmetic timed and not chosen, the rows read and decoded for the vocabulary's
        # head: together about the heads' size again
        return_freed_memory()
        self._hidden: torch.Tensor | None = None  # final hidden state of the pending token's row
        self._after_prefill = True
        self._inputs: dict[int, torch.Tensor] = {}  # token -> token_input of its embedding
        self.last_chances, self.last_steps = [], 0
        self._step_seconds = self._draft_seconds = 0.0  # the last draft's guesses, and all of it

    def begin(self, prompt_ids: list[int], max_len: int, settings: DraftSettings) -> None:
        super().begin(prompt_ids, max_len, settings)
        self.vocab.reset()
        self._hidden, self._after_prefill = None, True

    def describe(self) -> str:
        return self.heads.describe()

    def _pending_row(self) -> torch.Tensor | None:
        if self._after_prefill:  # the prefill's last row made the first token
            last = self.runner.last_hidden
            return None if last is None else last[-1:]
        return self._hidden

    def draft(self, request: DraftRequest, worth: Callable[[list[float]], bool] | None = None):
        """Up to ``request.max_tokens`` guesses. ``worth(chances)``, if given, decides whether
        guess j is proposed, from ``chances`` [j + 1]: the chance that guesses 0..i are all kept,
        per i, estimated from the heads' own confidence (their top probability); the first guess
        not worth it ends the draft, and a guess refused even at the chance of the guesses before it
        (its best) is not computed. ``last_chances`` keeps the proposed guesses' chances,
        ``last_steps`` the guesses computed, ``guess_share`` the share of the draft's time they
        took (the rest is its setup, paid once a draft: one more guess costs only its share)."""
        began = time.perf_counter()
        draft = self._guesses(request, worth)
        self._draft_seconds = time.perf_counter() - began
        return draft

    @property
    def guess_share(self) -> float:
        """The share of the last draft's time that went to its guesses."""
        return self._step_seconds / self._draft_seconds if self._draft_seconds > 0 else 1.0

    def _guesses(self, request: DraftRequest, worth: Callable[[list[float]], bool] | None):
        k = min(request.max_tokens, len(self.heads))
        hidden = self._pending_row()
        self.last_chances, self.last_steps, self._step_seconds = [], 0, 0.0
        if k <= 0 or hidden is None:
            return Draft()
        self.vocab.follow(request.committed)
        greedy = request.sampling.greedy
        normed = self.runner.adapter.final_norm(hidden)
        state, token, chance = normed.float(), request.committed[-1], 1.0
        tokens, probs = [], []
        for j in range(k):
            if j and worth is not None and not worth([*self.last_chances, chance]):
                break  # not worth it even if this guess were certain: spare its head step
            self.last_steps += 1
            began = time.perf_counter()
            state, logits = self._link(j, state, self._token_input(token), normed.dtype)
            logits = logits[0]  # the one row
            if greedy:
                best = argmax_rows(logits)[0]
                token, q = self.vocab.id_at(best), None
                confidence = float(torch.softmax(logits, -1)[best])
            else:
                q = request.sampling.probs(self.vocab.spread(logits))
                token = sample(q, request.generator)
                confidence = float(q.max())
            chance *= confidence
            self._step_seconds += time.perf_counter() - began
            if worth is not None and not worth([*self.last_chances, chance]):
                break
            self.last_chances.append(chance)
            tokens.append(token)
            if q is not None:
                probs.append(q)
        return Draft(tokens, torch.stack(probs) if probs else None, source=self.name)

    def tree(
        self, request: DraftRequest, worth: Callable[[list[float]], bool] | None = None
    ) -> Draft:
        """Up to ``request.tree_nodes`` guesses as a token tree (``selfspec.drafters.head_tree``),
        the likeliest first, proposed with certainty (greedy or sampled); ``last_chances`` holds
        each node's chance of being kept, ``last_steps`` the head steps run. A tree that is a
        chain comes back as one."""
        began = time.perf_counter()
        self.last_chances, self.last_steps, self._step_seconds = [], 0, 0.0
        hidden = self._pending_row()
        depth = min(request.max_tokens, len(self.heads))
        if request.tree_nodes <= 0 or depth <= 0 or hidden is None:
            self._draft_seconds = time.perf_counter() - began
            return Draft()
        self.vocab.follow(request.committed)
        normed = self.runner.adapter.final_norm(hidden)
        temperature = 1.0 if request.sampling.greedy else request.sampling.temperature
        expand = partial(self._expand, dtype=normed.dtype, temperature=temperature)
        tokens, parents, chances, steps = grow_tree(
            expand, normed.float(), request.committed[-1], depth, request.tree_nodes, worth
        )
        self.last_chances, self.last_steps = chances, steps
        self._draft_seconds = time.perf_counter() - began
        return tree_draft(tokens, parents, self.name)

    def _expand(
        self, j: int, states: torch.Tensor, tokens: list[int], dtype: torch.dtype, temperature
    ) -> tuple[torch.Tensor, list[list[int]], list[list[float]]]:
        """Head j over ``states`` fed ``tokens`` (``head_tree.Expand``): the next states and each
        row's ``TREE_WIDTH`` likeliest ids with their probabilities (at ``temperature``)."""
        began = time.perf_counter()
        inputs = torch.cat([self._token_input(t) for t in tokens])
        states, logits = self._link(j, states, inputs, dtype)
        probs, index = torch.softmax(logits / temperature, -1).topk(TREE_WIDTH, -1)
        ids = [[self.vocab.id_at(i) for i in row] for row in index.tolist()]
        self._step_seconds += time.perf_counter() - began
        return states, ids, probs.tolist()

    def guess_many(
        self, hidden: torch.Tensor, tokens: list[int], steps: int, going_on: float = 0.0
    ) -> list[list[tuple[int, float]]]:
        """Greedy chains for several sequences at once (a batch pass's drafts): ``hidden``
        [S, hidden] holds the final hidden state of the row that made sequence i's pending token
        ``tokens[i]``. Up to ``steps`` guesses each, with its chance (the product of the heads'
        top probabilities so far); the chains stop together once no chance reaches ``going_on``.
        Each step is one head's products and one pass of the output head over the draft's ids for
        all S rows: about one sequence's cost."""
        normed = self.runner.adapter.final_norm(hidden)
        state, current = normed.float(), list(tokens)
        chances = torch.ones(len(tokens))
        chains: list[list[tuple[int, float]]] = [[] for _ in tokens]
        for j in range(min(steps, len(self.heads))):
            inputs = torch.cat([self._token_input(t) for t in current])
            state, logits = self._link(j, state, inputs, normed.dtype)
            confidence, best = torch.softmax(logits, -1).max(-1)
            chances = chances * confidence
            current = [self.vocab.id_at(int(b)) for b in best]
            for chain, token, chance in zip(chains, current, chances.tolist()):
                chain.append((token, chance))
            if float(chances.max()) < going_on:
                break
        return chains

    def _link(self, j: int, state: torch.Tensor, inputs: torch.Tensor, dtype: torch.dtype):
        """Head j over states [S, hidden] fed ``inputs`` (``token_input`` of the tokens before the
        guesses): the next states and their logits over the draft's ids [S, ids], float32."""
        state = head_step(state, inputs, self.products[j], self.down_products[j])
        logits = self.runner.adapter.normed_logits(state.to(dtype)[None], self.vocab)[0]
        return state, logits.float()

    def _token_input(self, token: int) -> torch.Tensor:
        """``token_input`` of the token's embedding, kept: a text's tokens repeat, and the
        embedding lookup and its scaling are a few small torch calls each."""
        value = self._inputs.get(token)
        if value is None:
            if len(self._inputs) >= _KEPT_INPUTS:
                self._inputs.clear()
            ids = torch.tensor([token], device=self.runner.device)
            value = self._inputs[token] = token_input(self.runner.adapter.embed(ids))
        return value

    def learn(self, outcome: RoundOutcome) -> None:
        """After a verify pass: its row ``accepted`` made the next pending token."""
        last, m = self.runner.last_hidden, outcome.accepted
        self._after_prefill = False
        self._hidden = last[m : m + 1].clone() if last is not None and m < len(last) else None


def fastest_products(
    heads: DraftHeads, device: torch.device
) -> tuple[list[Product], list[Product | None]]:
    """Each head's product W x + b (x = [s ; e]) as drafting runs it, and its second layer's
    D y + d (None per head for one-layer heads): two lists of ``Product``, in the arithmetic this
    machine runs fastest: float32, bfloat16 (several times faster on CPUs with bfloat16
    instructions, slower on others) or, where selfspec's kernel runs 8-bit integer dot products,
    the weights rounded to 8 bits per 32 as in a Q8_0 file (read in a quarter of float32's time).
    Timed, not assumed. A head's guess is a guess: the rounding changes which drafts are kept,
    never the output."""
    make = _fastest_maker(heads, device)
    products = [make(w, b) for w, b in zip(heads.weights, heads.biases)]
    if heads.downs is None:
        return products, [None] * len(products)
    return products, [make(w, b) for w, b in zip(heads.downs, heads.down_biases)]


def _fastest_maker(heads: DraftHeads, device: torch.device) -> Callable:
    if device.type != "cpu":
        return lambda w, b: _float_product(w, b, torch.float32)
    makers = {
        "float32": lambda w, b: _float_product(w, b, torch.float32),
        "bfloat16": lambda w, b: _float_product(w, b, torch.bfloat16),
    }
    kernel = loaded_kernel()  # where the model's speed mode loaded it: not built for the heads
    shapes = [heads.weights[0].shape] + ([heads.downs[0].shape] if heads.downs else [])
    if kernel is not None and all(
        rows % (PANEL * kernel.panels_per_group()) == 0 and columns % 32 == 0
        for rows, columns in shapes
    ):
        from selfspec.speed.quantized import Q8Linear

        makers["q8"] = lambda w, b: Q8Linear.from_float(w, b, kernel)
    vector = torch.randn(1, heads.weights[0].shape[1])
    seconds = {}
    for name, make in makers.items():
        product = make(heads.weights[0], heads.biases[0])
        product(vector)  # warm-up
        times = []
        for _ in range(5):
            start = time.perf_counter()
            product(vector)
            times.append(time.perf_counter() - start)
        seconds[name] = min(times)
    return makers[min(seconds, key=seconds.get)]


def _float_product(weight: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> Product:
    weight, bias = weight.detach().to(dtype), bias.detach().to(dtype)
    return lambda x: F.linear(x.to(dtype), weight, bias)
