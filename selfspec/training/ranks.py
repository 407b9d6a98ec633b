"""Training draft heads on several processes: ``accelerate launch`` (GPUs, nodes, or CPU processes
on gloo) runs ``selfspec train-heads`` once per process.

Each process answers, and reads the hidden states of, every ``world``-th item; every process then
holds all of them again, in order. The fit splits each batch across the processes and sums their
gradients: the heads are one process's, up to float rounding (tested with 2 CPU processes).

    ranks = Ranks.current()              # one process unless started by a distributed launcher
    mine = ranks.share(items)            # [(index, item)] of this process: items[rank::world]
    every = ranks.gather(mine)           # [(index, item)] of all processes, by index
    ranks.sum_(tensors)                  # in place, over the processes
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ranks:
    """This process's place among the processes of one run."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"  # where the process group's collectives take their tensors

    @classmethod
    def current(cls) -> Ranks:
        """One process, or (under ``accelerate launch`` or ``torchrun``, which set WORLD_SIZE)
        this one's place, with the process group started by accelerate (nccl on GPUs, else gloo
        between CPU processes)."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls()
        from accelerate import PartialState

        state = PartialState(cpu=not torch.cuda.is_available())
        return cls(state.process_index, state.num_processes, str(state.device))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, items: list) -> list[tuple[int, object]]:
        return [(i, items[i]) for i in range(self.rank, len(items), self.world)]

    def gather(self, mine: list[tuple[int, object]]) -> list[tuple[int, object]]:
        """Every process's (index, item) pairs, on every process, by index."""
        if self.world == 1:
            return list(mine)
        from accelerate.utils import gather_object

        return sorted(gather_object(list(mine)), key=lambda pair: pair[0])

    def broadcast(self, value):
        """The main process's ``value``, on every process."""
        if self.world == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        """Each tensor replaced by its sum over the processes (one message for all of them)."""
        if self.world == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        torch.distributed.all_reduce(flat)
        at = 0
        for t in tensors:
            t.copy_(flat[at : at + t.numel()].view_as(t))
            at += t.numel()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (so that all stop together)."""
        if self.world == 1:
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return bool(value.item())

    def wait(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def prefix(pairs: list[tuple[int, object]]) -> list:
    """The items of indices 0, 1, 2, ... up to the first missing one (processes stopped at a
    deadline at different places)."""
    items = []
    for i, item in pairs:
        if i != len(items):
            break
        items.append(item)
    return items
