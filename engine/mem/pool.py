"""Paged KV memory: the MLA token pool and the page allocator.

Layout (slot = page * page_size + offset):

    slot 0 .. page_size-1   page 0, reserved: padding target of every index tensor, never allocated
    page p >= 1             page_size consecutive token slots owned by one request (or the radix cache)

Each slot of the pool holds, per layer, one token's compressed MLA cache: the normalized latent
(`kv_lora_rank`) and the rotated rope key (`qk_rope_head_dim`), concatenated. Nothing is expanded.
Only the forward executor touches the pool tensor; the allocator is host-side bookkeeping owned
by the scheduler thread.
"""

from __future__ import annotations

import torch


class MLATokenPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int,
                 rope_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.kv_lora_rank = kv_lora_rank
        self.buf = torch.zeros(num_layers, self.num_slots, kv_lora_rank + rope_dim, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> int:
        return num_layers * (kv_lora_rank + rope_dim) * torch.finfo(dtype).bits // 8

    def write(self, layer: int, loc: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        if loc.numel():
            self.buf[layer, loc] = torch.cat([latent, k_pe.reshape(k_pe.shape[0], -1)], dim=-1).to(self.buf.dtype)

    def gather(self, layer: int, indices: torch.Tensor) -> torch.Tensor:
        return self.buf[layer][indices]


class PageAllocator:
    """Free list of pages 1..num_pages-1 (page 0 is the reserved padding page)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("kv_cache_tokens: the KV pool needs at least two pages")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool: {n} pages requested, {len(self._free)} free")
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)
