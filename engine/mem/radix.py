"""Radix-tree prefix cache over token ids, at page granularity, with LRU eviction.

Every edge holds a whole number of pages: `key` is page_size * len(pages) token ids, `pages`
the KV pages holding them. A request that matches a prefix locks the path (lock_ref > 0 on every
node from the match up to the root) so it cannot be evicted while the request reads it; only
unlocked leaves are evicted, least recently used first. Invariant:
    evictable_pages == sum(len(n.pages) for n in nodes if n.lock_ref == 0)
"""

from __future__ import annotations

import heapq
import itertools

from engine.mem.pool import PageAllocator


class RadixNode:
    __slots__ = ("children", "parent", "key", "pages", "lock_ref", "last_access")

    def __init__(self, parent: RadixNode | None, key: list[int], pages: list[int], tick: int) -> None:
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = tick


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self._tick = itertools.count(1)
        self.root = RadixNode(None, [], [], 0)
        self.root.lock_ref = 1  # never evicted
        self.evictable_pages = 0
        self.cached_pages = 0

    def _first(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Common prefix length of a and b in whole pages."""
        P, n = self.page_size, 0
        limit = min(len(a), len(b))
        while n + P <= limit and a[n : n + P] == b[n : n + P]:
            n += P
        return n // P

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Split `node` after its first k pages; return the new upper node."""
        P = self.page_size
        upper = RadixNode(node.parent, node.key[: k * P], node.pages[:k], node.last_access)
        upper.lock_ref = node.lock_ref
        upper.parent.children[self._first(upper.key)] = upper
        node.key, node.pages, node.parent = node.key[k * P :], node.pages[k:], upper
        upper.children[self._first(node.key)] = node
        return upper

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], RadixNode]:
        """Longest cached page-aligned prefix of `tokens`: (its pages, the deepest node)."""
        node, pages, pos = self.root, [], 0
        tick = next(self._tick)
        while pos < len(tokens):
            child = node.children.get(self._first(tokens[pos:]))
            if child is None:
                break
            k = self._match_len(child.key, tokens[pos:])
            if k == 0:
                break
            if k < len(child.pages):
                child = self._split(child, k)
            child.last_access = tick
            pages.extend(child.pages)
            pos += k * self.page_size
            node = child
        return pages, node

    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Cache `pages` holding `tokens` (len(tokens) == len(pages) * page_size).

        Returns the caller's pages that duplicate ones already cached (to be freed by the caller);
        pages the caller got from this cache come back as themselves and are not returned.
        """
        assert len(tokens) == len(pages) * self.page_size
        P, node, pos, dup = self.page_size, self.root, 0, []
        tick = next(self._tick)
        while pos < len(tokens):
            child = node.children.get(self._first(tokens[pos:]))
            if child is None:
                new = RadixNode(node, tokens[pos:], pages[pos // P :], tick)
                node.children[self._first(new.key)] = new
                self.evictable_pages += len(new.pages)
                self.cached_pages += len(new.pages)
                return dup
            k = self._match_len(child.key, tokens[pos:])
            if k < len(child.pages):
                child = self._split(child, k)
            child.last_access = tick
            mine = pages[pos // P : pos // P + k]
            dup.extend(p for p, theirs in zip(mine, child.pages) if p != theirs)
            pos += k * P
            node = child
        return dup

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, LRU first. Returns pages freed."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heap = [(n.last_access, id(n), n) for n in leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            self.allocator.free(node.pages)
            freed += len(node.pages)
            self.evictable_pages -= len(node.pages)
            self.cached_pages -= len(node.pages)
            parent = node.parent
            del parent.children[self._first(node.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
