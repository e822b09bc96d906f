"""Everything a sequence keeps between steps: KV pages per layer kind, the block tables and the page pools.
One description of shapes (`CacheLayout`) serves the engine and `plan`.

Per kind ("full", "sliding"; config.layer_kinds) the pages of all its layers are one array
[layers, pages, page_size, kv_heads * 2 * head_dim]: per token, KV head h's key then its value (jax's
interleaved K/V layout with the last two dims merged, so a page is one contiguous [page_size, width] slab
for the kernel's DMA, and heads split evenly over a tensor-parallel mesh). Page 0 is scratch: padding
tokens write there and no live table entry points to it.

A sequence has one block-table row per kind: logical page j holds positions [j * ps, (j + 1) * ps).
Full-attention layers keep every page of a sequence. Sliding-window layers hold only the pages a query
can still see: before each step the pages wholly below (first query position - window + 1) go back to
the pool (vLLM's sliding-window manager), so their pool is sized by the window, not the model length:
per sequence ceil(window / ps) + 2 pages (the window straddles one more page boundary, plus one page
of a chunk's own tokens), plus ceil(max_num_batched_tokens / ps) for the chunks of one step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quantkit.runtime.config import ModelConfig


@dataclass(frozen=True)
class CacheLayout:
    page_size: int
    pages_per_seq: int  # logical pages of a sequence at max_model_len (the block-table width)
    pages: dict  # kind -> pages in its pool, scratch page included
    layers: dict  # kind -> layers
    width: int  # kv_heads * 2 * head_dim
    window: int | None  # sliding window of the "sliding" kind

    def shapes(self) -> dict:
        """kind -> shape of its stacked pages."""
        return {k: (self.layers[k], self.pages[k], self.page_size, self.width) for k in self.layers}


def cache_layout(cfg: ModelConfig, max_model_len: int, max_num_seqs: int, page_size: int = 16,
                 max_num_batched_tokens: int = 512) -> CacheLayout:
    ps = page_size
    per_seq = -(-max_model_len // ps)
    kinds = cfg.layer_kinds
    layers = {k: kinds.count(k) for k in cfg.kinds}
    pages = {"full": 1 + max_num_seqs * per_seq}
    window = cfg.sliding_window if "sliding" in layers else None
    if window is not None:
        pages["sliding"] = min(pages["full"], 1 + max_num_seqs * (-(-window // ps) + 2) + -(-max_num_batched_tokens // ps))
    return CacheLayout(ps, per_seq, {k: pages[k] for k in layers}, layers,
                       cfg.num_kv_heads * 2 * cfg.head_dim, window)


class PagePool:
    """Host-side page accounting: a free list and a block-table row per slot, for each kind."""

    def __init__(self, layout: CacheLayout, max_num_seqs: int):
        self.layout = layout
        self.tables = {k: np.zeros((max_num_seqs, layout.pages_per_seq), np.int32) for k in layout.layers}
        self.free = {k: list(range(n - 1, 0, -1)) for k, n in layout.pages.items()}

    def reserve(self, slot: int, first: int, last: int) -> bool:
        """Makes positions first..last of `slot`'s sequence writable and everything a query at `first` or
        later can see readable; sliding kinds drop pages out of the window. False (nothing changed) when a
        pool is out of pages."""
        ps = self.layout.page_size
        need = {}
        for kind, table in self.tables.items():
            lo = max(0, first - self.layout.window + 1) // ps if kind == "sliding" else 0
            need[kind] = [j for j in range(lo, last // ps + 1) if table[slot, j] == 0]
            if len(need[kind]) > len(self.free[kind]):
                return False
        for kind, table in self.tables.items():
            if kind == "sliding":
                lo = max(0, first - self.layout.window + 1) // ps
                self._drop(kind, slot, np.nonzero(table[slot, :lo])[0])
            for j in need[kind]:
                table[slot, j] = self.free[kind].pop()
        return True

    def release(self, slot: int) -> None:
        for kind, table in self.tables.items():
            self._drop(kind, slot, np.nonzero(table[slot])[0])

    def _drop(self, kind: str, slot: int, cols) -> None:
        table = self.tables[kind]
        self.free[kind].extend(int(p) for p in table[slot, cols][::-1])
        table[slot, cols] = 0

    @property
    def used(self) -> int:
        """Pages in use, all kinds."""
        return sum(n - 1 - len(self.free[k]) for k, n in self.layout.pages.items())

    @property
    def total(self) -> int:
        return sum(n - 1 for n in self.layout.pages.values())
