"""Request slots and their page tables (the host-side `ReqToTokenPool`, at page granularity).

Row r of `table` lists the KV pages of the request in slot r, in position order; token position p
of that request lives in slot `table[r, p // page_size] * page_size + p % page_size`. Index tensors
for a forward are derived from this table on the scheduler thread at schedule time, so a launched
forward never reads it while the scheduler edits it.
"""

from __future__ import annotations

import torch


class ReqTable:
    def __init__(self, max_requests: int, max_pages_per_req: int, page_size: int) -> None:
        self.page_size = page_size
        self.table = torch.zeros(max_requests, max_pages_per_req, dtype=torch.int64)
        self._free = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def set_pages(self, slot: int, start: int, pages: list[int]) -> None:
        if pages:
            self.table[slot, start : start + len(pages)] = torch.tensor(pages, dtype=torch.int64)

    def token_slots(self, slots: torch.Tensor, max_len: int) -> torch.Tensor:
        """KV slots of positions 0..max_len-1 for request slots [B] -> [B, max_len]."""
        P = self.page_size
        n_pages = (max_len + P - 1) // P
        pages = self.table[slots, :n_pages]
        return (pages[:, :, None] * P + torch.arange(P)).reshape(len(slots), -1)[:, :max_len]
