"""Token trees from the draft heads: where the heads are unsure, several guesses at a position.

On a CPU a verify pass over two or three rows costs about what one does, so a second guess at
the first position (the heads' next likeliest token) costs little. A tree holds the guesses
likeliest to be kept, whatever their depth, verified in one pass where each row sees only its
ancestors.

    level 0: the first head from the pending token's row: its likeliest tokens are candidates,
             each with its chance of being kept (its probability)
    repeat:  the tree is the likeliest candidates, while one more is worth its verify row
             (``worth``) and the tree has room; its nodes at the newest depth whose children
             might join it are grown together in one batched head step (each fed its own
             token): their likeliest children become candidates, with chance = parent's chance
             x probability
    the tree, sorted by chance: parents come first, and every prefix of the list is a tree

A node's chance is that of the target keeping the path to it, so the chances of a tree's nodes add
up to the tokens it is expected to keep, as a chain's do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# a node to grow: its index among the candidates (-1: the pending token), its token, and the
# state [1, hidden] it was guessed from
Grown = tuple[int, int, torch.Tensor]
# (head j, the states the nodes were guessed from [S, hidden], their tokens) -> (the next states
# [S, hidden], each row's likeliest ids and their probabilities, likeliest first)
Expand = Callable[
    [int, torch.Tensor, list[int]], tuple[torch.Tensor, list[list[int]], list[list[float]]]
]
Worth = Callable[[list[float]], bool]


def grow_tree(
    expand: Expand,
    root: torch.Tensor,
    token: int,
    depth: int,
    nodes: int,
    worth: Worth | None = None,
) -> tuple[list[int], list[int], list[float], int]:
    """Up to ``nodes`` guesses, at most ``depth`` deep, from the pending ``token`` and the final
    state ``root`` [1, hidden] of the row that made it: (tokens, each one's parent's index among
    them, -1 for the pending token, each one's chance, the head steps run), the likeliest first.
    ``worth(chances)`` says whether a node of chance ``chances[-1]`` is worth adding to nodes of
    ``chances[:-1]``; the first node is always given."""
    tokens: list[int] = []
    parents: list[int] = []
    chances: list[float] = []
    depths: list[int] = []
    level: list[Grown] = [(-1, token, root)]
    steps = 0
    for j in range(depth):
        if not level:
            break
        states, ids, probs = expand(
            j, torch.cat([s for _, _, s in level]), [t for _, t, _ in level]
        )
        steps += 1
        grown = []
        for row, (index, _, _) in enumerate(level):
            base = chances[index] if index >= 0 else 1.0
            for following, p in zip(ids[row], probs[row]):
                tokens.append(following)
                parents.append(index)
                chances.append(base * p)
                depths.append(j + 1)
                grown.append(states[row : row + 1])
        taken = _taken(chances, depths, nodes, worth)
        # grow the newest nodes in the tree whose children might make it: a child's chance is at
        # most its parent's, and it must beat the tree's last node if the tree is full
        floor = chances[taken[-1]] if len(taken) >= nodes else 0.0
        first = len(tokens) - len(grown)
        level = [
            (i, tokens[i], grown[i - first])
            for i in taken
            if i >= first
            and chances[i] > floor
            and (worth is None or worth([*(chances[k] for k in taken), chances[i]]))
        ]
    taken = _taken(chances, depths, nodes, worth)
    place = {old: new for new, old in enumerate(taken)}
    return (
        [tokens[i] for i in taken],
        [place[parents[i]] if parents[i] >= 0 else -1 for i in taken],
        [chances[i] for i in taken],
        steps,
    )


def _taken(chances: list[float], depths: list[int], nodes: int, worth: Worth | None) -> list[int]:
    """The candidates a tree of at most ``nodes`` takes: the likeliest first (ties: the shallower,
    so parents precede children), while ``worth`` says so; every prefix of them is a tree."""
    order = sorted(range(len(chances)), key=lambda i: (-chances[i], depths[i], i))
    taken: list[int] = []
    for i in order[:nodes]:
        if taken and worth is not None and not worth([*(chances[k] for k in taken), chances[i]]):
            break
        taken.append(i)
    return taken
