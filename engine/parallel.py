"""Where a rank stands in its expert-parallel group. Built by `cluster/` (or trivially for one rank).

The engine never creates process groups itself: whoever starts the rank (the cluster layer's rank
class, under Serve or offline) forms them after rendezvous and passes them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    # torch.distributed group for the MoE all-to-all (NCCL on CUDA, gloo on CPU); None for one rank.
    ep_group: Any = None
    # gloo group for the per-step lockstep header, kept apart so it never interleaves with the
    # in-flight MoE collectives of a launched forward (overlap scheduler). None for one rank.
    control_group: Any = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


SINGLE_RANK = ParallelContext()
