"""Fitting a chain of draft heads (``selfspec.drafters.heads``) to the target's hidden states.

The training arithmetic alone, on whatever device the rows are: ``selfspec.training.heads`` (the
CPU recipe behind ``selfspec train-heads``) and ``selfspec.training.gpu`` (on a GPU) both call
``fit_rows`` on the rows they gathered, and ``chain_top1`` measures heads on held-out rows.

    heads = fit_rows(hidden, tokens, test_hidden, test_tokens, out, embed, epochs)
    heads.info["heldout_top1_by_head"]   # share of held-out rows where heads 1..j all guess right
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from selfspec.drafters.heads import FREQUENT_IDS, DraftHeads, token_input
from selfspec.errors import SelfSpecError
from selfspec.loading.fetch import progress_bar
from selfspec.training.ranks import Ranks


def fit_rows(
    hidden,
    tokens,
    test_hidden,
    test_tokens,
    out,
    embed,
    epochs,
    batch=256,
    lr=1e-3,
    init=None,
    layers=2,
    soft=0.5,
    owner=None,
    deadline=None,
    ranks=Ranks(),
    ids=None,
):
    """A chain of heads from normed final hidden states [n, hidden] and ``chain_tokens``
    [heads + 1, n], on the device ``out`` (the output head's rows [scored, hidden]) is on: the
    rows of the token ``ids`` (most frequent first: the heads' ``frequent``), or with None of the
    first ids; the heads learn to tell those ids apart. ``embed``
    holds every token's input embedding [vocab, hidden]; ``init``: ``DraftHeads`` to start from
    (default: zeros); ``layers``: 1 or 2 per head (one-layer ``init`` made two-layer).
    ``soft`` > 0 mixes in that share of cross-entropy against the model's own distribution of the
    token over ``out``'s ids (its logits from the row that produced it: row i + 1 + j for head j,
    a row of the same answer by ``owner`` [n]; also where the token itself is past ``out``). The
    held-out rows give ``info["heldout_top1_by_head"]``: the share of rows where heads 1..j all
    guess right. No batch begins past ``deadline`` (a ``time.monotonic()`` value), but the first.
    ``ranks``: each batch split over several processes (``selfspec.training.ranks``), each
    holding all the rows; their gradients summed.
    """
    count, device = len(tokens) - 1, out.device
    if soft > 0 and owner is None:
        raise ValueError("a soft loss needs owner: the answer each row belongs to")
    owner = None if owner is None else owner.to(device)
    heads = initial_heads(init, count, hidden.shape[1], device, layers)
    rows = (tokens[1] >= 0).nonzero()[:, 0]
    place = row_places(ids, len(out), embed.shape[0], device)
    _train(
        heads, hidden, tokens, rows, out, embed, epochs, batch, lr, soft, owner, deadline, ranks,
        place,
    )  # fmt: skip
    heads = heads.detached()
    top1 = chain_top1(test_hidden, test_tokens, heads.to(device), out, embed, place=place)
    heads.info = {
        "layers": layers,
        "soft": soft,
        "rows": len(rows),
        "heldout_top1_by_head": [round(t, 4) for t in top1],
        "heldout_top1": round(top1[0], 4),
    }
    if ids is None:
        heads.info["vocab_prefix"] = len(out)
        earlier = init.frequent if init is not None else None
        heads.frequent = frequent_ids(tokens[1], embed.shape[0], earlier=earlier)
    else:
        heads.info["scored_ids"] = len(out)
        heads.frequent = torch.as_tensor(ids).cpu().long().clone()
    return heads


def row_places(ids, scored: int, vocab: int, device) -> torch.Tensor:
    """[vocab]: each token id's row among the ``scored`` rows of ``out`` (those of ``ids``, or the
    first ids), -100 for ids it lacks."""
    place = torch.full((vocab,), -100, dtype=torch.long, device=device)
    ids = torch.arange(min(scored, vocab)) if ids is None else torch.as_tensor(ids).long()
    place[ids.to(device)] = torch.arange(len(ids), device=device)
    return place


def _places(tokens, place):
    """Token ids (-1: none) as rows of ``out`` (-100: none, or not scored)."""
    tokens = tokens.to(place.device)
    known = (tokens >= 0) & (tokens < len(place))
    return torch.where(known, place[tokens.clamp(0, len(place) - 1)], -100)


def _train(
    heads, hidden, tokens, rows, out, embed, epochs, batch, lr, soft, owner, deadline, ranks,
    place,
) -> None:  # fmt: skip
    """``epochs`` passes over ``rows`` in batches, updating ``heads``' tensors in place, until
    ``deadline``. Each process of ``ranks`` takes its share of every batch; a loss is its rows'
    sum over the whole batch's count, so the summed gradients are one process's. ``place``:
    ``row_places``' map from token ids to ``out``'s rows."""
    params = [*heads.weights, *heads.biases, *(heads.downs or []), *(heads.down_biases or [])]
    for t in params:
        t.requires_grad_()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    links = heads.steps()  # over the parameters themselves, which the optimizer updates in place
    steps = epochs * -(-len(rows) // batch)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - 0.9 * step / steps)
    # per head and row: a token to guess (a text's chain ends where the text leaves the model's
    # path: ``training.heads.model_chain_tokens``)
    guessing = (tokens[1:] >= 0).to(out.device)
    bar = progress_bar(steps, f"{len(tokens) - 1} chained heads", unit="batch")
    for _ in range(epochs):
        order = rows[torch.randperm(len(rows), device=rows.device)]
        for first in range(0, len(order), batch):
            if bar.n and ranks.any(deadline is not None and time.monotonic() >= deadline):
                bar.close()
                return
            whole = order[first : first + batch]
            i = whole[ranks.rank :: ranks.world]
            chain = _chain(hidden[i], tokens[:, i], links, out, embed, place)
            losses = []
            for j, (logits, target) in enumerate(chain):
                loss = _hard_loss(logits, target, _guessable(tokens[j + 1, whole], place))
                if soft > 0:
                    has = guessing[j]
                    count = int((_same_answer(whole, j, owner, len(hidden)) & has[whole]).sum())
                    soft_part = soft_loss(logits, hidden, owner, i, j, out, count, has[i])
                    loss = (1 - soft) * loss + soft * soft_part
                losses.append(loss)
            opt.zero_grad()
            sum(losses).backward()
            for t in params:  # a process whose share of a batch is empty still sends zeros
                if t.grad is None:
                    t.grad = torch.zeros_like(t)
            ranks.sum_([t.grad for t in params])
            opt.step()
            decay.step()
            bar.update()
    bar.close()


def initial_heads(init, count, size, device, layers) -> DraftHeads:
    """Trainable float32 copies of ``init``'s first ``count`` heads (zeros without one)."""
    if init is None:
        weights = [torch.zeros(size, 2 * size) for _ in range(count)]
        init = DraftHeads(weights, [torch.zeros(size) for _ in range(count)], {})
    if len(init) < count:
        raise SelfSpecError(f"the heads to start from are {len(init)}, not the {count} to train")
    if layers == 2:
        init = init.two_layers()
    elif init.layers != 1:
        raise SelfSpecError("heads of one layer cannot start from heads of two")
    two = init.downs is not None
    first = DraftHeads(
        init.weights[:count],
        init.biases[:count],
        {},
        None,
        init.downs[:count] if two else None,
        init.down_biases[:count] if two else None,
    )
    return first.mapped(lambda t: t.to(device, torch.float32).detach().clone())


def _guessable(tokens, place) -> int:
    """How many of a batch's tokens for a head are among the ids it scores."""
    return int((_places(tokens, place) >= 0).sum())


def _hard_loss(logits, target, count: int):
    """Cross-entropy summed over ``target``'s rows, over ``count`` (the whole batch's)."""
    return F.cross_entropy(logits, target, ignore_index=-100, reduction="sum") / max(1, count)


def _same_answer(rows, j, owner, total: int):
    """Whether the row that produced head j's token for each of ``rows`` is of the same answer."""
    later = (rows + 1 + j).clamp(max=total - 1)
    return (owner[later] == owner[rows]) & (rows + 1 + j < total)


def soft_loss(logits, hidden, owner, rows, j, out, count: int | None = None, has=None):
    """Cross-entropy against the model's distribution over ``out``'s ids at the rows (of
    ``hidden``) that produced head j's tokens, where that row belongs to the same answer (and
    ``has``, per row, where given: head j has a token to guess); summed over ``count`` (default:
    the mean over those rows)."""
    same = _same_answer(rows, j, owner, len(hidden))
    if has is not None:
        same = same & has
    if not bool(same.any()):
        return logits.sum() * 0
    later = (rows + 1 + j)[same]
    with torch.no_grad():
        target = torch.softmax(hidden[later].to(out.device, torch.float32) @ out.T, -1)
    total = -(target * torch.log_softmax(logits[same], -1)).sum()
    return total / (count if count is not None else int(same.sum()))


def frequent_ids(
    tokens: torch.Tensor, vocab: int, count: int = 2 * FREQUENT_IDS, earlier=None
) -> torch.Tensor:
    """Up to ``count`` token ids, those ``tokens`` (-1: none) holds most often first (ties: lower id
    first), then the lowest ids it lacks. With ``earlier`` (the ids of heads trained before), those
    ``tokens`` holds more than once, then ``earlier``'s: what the heads learned from before still
    counts when they go on learning from a little more."""
    seen = torch.bincount(tokens[tokens >= 0].cpu().long(), minlength=vocab)[:vocab]
    order = torch.sort(-seen, stable=True).indices  # by count, ids in order within a count
    if earlier is None:
        return order[:count].clone()
    order = torch.cat([order[: int((seen > 1).sum())], earlier.cpu().long(), order])
    place = torch.arange(len(order))
    first = torch.full((vocab,), len(order)).scatter_reduce(0, order, place, "amin")
    return order[first[order] == place][: max(count, len(earlier))].clone()  # each id once


def _chain(hidden, tokens, steps, out, embed, place):
    """Per head: (logits over ``out``'s ids [rows, len(out)], the row of ``out`` to guess (by
    ``row_places``' ``place``), -100 where there is none), the chain (``DraftHeads.steps``) fed the
    true tokens."""
    device = out.device
    state = hidden.to(device, torch.float32)
    tokens = tokens.to(device)
    for j, step in enumerate(steps):
        fed = token_input(embed[tokens[j].clamp(min=0).to(embed.device)].to(device))
        state = step(state, fed)
        yield state @ out.T, _places(tokens[j + 1], place)


def chain_top1(
    hidden, tokens, heads: DraftHeads, out, embed, batch=4096, place=None
) -> list[float]:
    """Per head j: the share of rows (those with a token for it) where heads 1..j all guess
    right (``out``'s rows: ``row_places``' ``place``, default the first ids)."""
    if place is None:
        place = row_places(None, len(out), embed.shape[0], out.device)
    right = torch.zeros(len(heads))
    total = torch.zeros(len(heads))
    with torch.no_grad():
        for first in range(0, hidden.shape[0], batch):
            chain = _chain(
                hidden[first : first + batch], tokens[:, first : first + batch],
                heads.steps(), out, embed, place,
            )  # fmt: skip
            so_far = None
            for j, (logits, target) in enumerate(chain):
                hit = logits.argmax(-1) == target
                so_far = hit if so_far is None else so_far & hit
                has = tokens[j + 1, first : first + batch].to(out.device) >= 0
                right[j] += float((so_far & has).sum())
                total[j] += float(has.sum())
    return (right / total.clamp(min=1)).tolist()
