"""Everything a sequence keeps between steps: KV pages per layer kind, the block tables and the page pools.
One description of shapes (`CacheLayout`) serves the engine and `plan`.

Per kind ("full", "sliding"; config.layer_kinds) the pages of all its layers are one array
[layers, pages, page_size, kv_heads * 2 * head_dim] (each kind its own heads and head size: Gemma 4): per token, KV head h's key then its value (jax's
interleaved K/V layout with the last two dims merged, so a page is one contiguous [page_size, width] slab
for the kernel's DMA, and heads split evenly over a tensor-parallel mesh). Page 0 is scratch: padding
tokens write there and no live table entry points to it.

A sequence has one block-table row per kind: logical page j holds positions [j * ps, (j + 1) * ps).
Full-attention layers keep every page of a sequence. Sliding-window layers hold only the pages a query
can still see: before each step the pages wholly below (first query position - window + 1) go back to
the pool (vLLM's sliding-window manager), so their pool is sized by the window, not the model length:
per sequence ceil(window / ps) + 2 pages (the window straddles one more page boundary, plus one page
of a chunk's own tokens), plus ceil(max_num_batched_tokens / ps) for the chunks of one step.

Gated DeltaNet layers (Qwen3.5, kind "linear") keep no pages: each sequence has a state slot (its engine
slot; slot max_num_seqs is the padding rows' scratch) holding per layer the last K - 1 conv inputs
[1, (K - 1) * conv channels] and the recurrent state [Hv, dk, dv], both float32, whatever the sequence's length
(models/gdn.py). A state is not a function of a page's tokens: prefix caching for these models keeps
snapshots instead (below).

Prefix caching (vLLM's automatic prefix caching): a full page is named by a hash chained over its tokens
and its parent page's hash (`page_hashes`; the chain's root is salted with what else changes the keys,
the KV dtype). Pages are reference-counted: a sequence that starts with a cached chain shares those pages
(`match`, `share`) and prefills only the rest. A page whose last reference goes keeps its contents and hash
and waits, least recently used first, until a pool runs out of never-used pages (`_take` evicts it then).
Sliding-window layers take part: their pages are named by the same chain, and a hit of m pages needs the
full layers' pages 0..m-1 and the sliding layers' pages a query at position m * ps can still see.

Gated DeltaNet models (vLLM's "align" mode for hybrid models): `snapshots` extra state slots after the
scratch slot hold the states of prefixes that end on a page boundary, named by that page's chained hash (the
engine schedules prompt chunks to end on page boundaries and copies a row's states into a snapshot slot
after such a chunk). A hit of m pages then also needs the snapshot of page m - 1; it restores the states
and shares the KV pages together or not at all. Snapshot slots are few and evicted least recently used first;
an evicted snapshot's name is gone with it, so it is never used again.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from quantkit.errors import InvalidInput
from quantkit.runtime.config import MAX_NUM_BATCHED_TOKENS, PAGE_SIZE, ModelConfig

KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's --kv-cache-dtype names


def kv_fp8_dtype(name: str, checkpoint_scales: bool):
    """The float8 dtype of `--kv-cache-dtype name`, or None for a cache in the model's dtype. "auto"
    follows the checkpoint: FP8 (E4M3) when it has a kv_cache_scheme (and so k/v scales), else bf16."""
    import ml_dtypes

    if name not in KV_CACHE_DTYPES:
        raise InvalidInput(f"unknown KV cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        name = "fp8" if checkpoint_scales else "bf16"
    return {"bf16": None, "fp8": ml_dtypes.float8_e4m3fn, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
            "fp8_e5m2": ml_dtypes.float8_e5m2}[name]


def with_kv_scales(params: dict, cfg: ModelConfig, scales: dict | None, make=np.asarray) -> dict:
    """The weight pytree with each kind's per-layer KV scales added as `kv_scale` [layers, 2, KVH] float32
    (k then v, per KV head): the checkpoint's (`scales`, per kind) or 1.0, as vLLM does without them.
    make: turns the numpy array into the leaf (jnp.asarray; plan passes a ShapeDtypeStruct maker)."""
    layers = dict(params["layers"])
    for kind in cfg.paged_kinds:
        stack, n = layers[kind], cfg.layer_kinds.count(kind)
        s = scales[kind] if scales is not None else np.ones((n, 2, cfg.kv_shape(kind)[0]), np.float32)
        layers[kind] = {**stack, "kv_scale": make(s)}
    return {**params, "layers": layers}


@dataclass(frozen=True)
class CacheLayout:
    page_size: int
    pages_per_seq: int  # logical pages of a sequence at max_model_len (the block-table width)
    pages: dict  # kind -> pages in its pool, scratch page included
    layers: dict  # kind -> layers
    widths: dict  # kind -> kv_heads * 2 * head_dim of its layers
    window: int | None  # sliding window of the "sliding" kind
    states: tuple = ()  # Gated DeltaNet layers: (conv, recurrent[, their checkpoints]) state shapes, float32
    snapshots: int = 0  # state slots for prefix-caching snapshots, after the max_num_seqs + 1 of the sequences

    def shapes(self) -> dict:
        """kind -> shape of its stacked pages."""
        return {k: (self.layers[k], self.pages[k], self.page_size, self.widths[k]) for k in self.layers}

    def cache(self, make) -> dict:
        """The cache pytree: per paged kind make(kind, shape, None) (None: the KV dtype), and for Gated
        DeltaNet layers "linear": (make("linear", conv shape, float32), make("linear", recurrent shape, float32))."""
        out = {k: make(k, s, None) for k, s in self.shapes().items()}
        if self.states:
            out["linear"] = tuple(make("linear", s, np.float32) for s in self.states)
        return out


def cache_layout(cfg: ModelConfig, max_model_len: int, max_num_seqs: int, page_size: int = PAGE_SIZE,
                 max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS, speculative: int = 0,
                 snapshots: int = 0) -> CacheLayout:
    """speculative: drafts a row at most; Gated DeltaNet layers then also keep each slot's states after
    each of its first `speculative` tokens of a step (gdn.gdn_block), k times the state memory. snapshots:
    Gated DeltaNet models' state slots for prefix caching (none without GDN layers)."""
    ps = page_size
    per_seq = -(-max_model_len // ps)
    kinds = cfg.layer_kinds
    layers = {k: kinds.count(k) for k in cfg.paged_kinds}
    pages = {"full": 1 + max_num_seqs * per_seq}
    window = cfg.sliding_window if "sliding" in layers else None
    if window is not None:
        pages["sliding"] = min(pages["full"], 1 + max_num_seqs * (-(-window // ps) + 2) + -(-max_num_batched_tokens // ps))
    widths = {k: 2 * math.prod(cfg.kv_shape(k)) for k in layers}
    states = ()
    snapshots = snapshots if "linear" in kinds else 0
    if "linear" in kinds:  # a slot per sequence (engine slot), the scratch slot of padding rows, the snapshots
        n, slots = kinds.count("linear"), max_num_seqs + 1 + snapshots
        conv = cfg.gdn_dims[0]
        # the conv inputs flattened into one row [1, (K - 1) * C]: the layout a TPU keeps row-major, which
        # the decode kernel reads a slot of in place (as [K - 1, C], XLA:TPU orders the dims otherwise)
        states = ((n, slots, 1, (cfg.conv_kernel - 1) * conv),
                  (n, slots, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim))
        if speculative:
            states += tuple((n, slots, speculative, *shape[2:]) for shape in states)
    return CacheLayout(ps, per_seq, {k: pages[k] for k in layers}, layers, widths, window, states, snapshots)


def page_hashes(tokens, page_size: int, parent: bytes, start: int = 0) -> list[bytes]:
    """Chained hashes of the full pages start, start + 1, ... of `tokens`; `parent` is page start - 1's hash
    (the salt for page 0). blake2b, not Python's hash: crafted prompts must not collide with another
    user's pages."""
    out = []
    for j in range(start, len(tokens) // page_size):
        page = np.asarray(tokens[j * page_size:(j + 1) * page_size], np.int64).tobytes()
        parent = hashlib.blake2b(parent + page, digest_size=16).digest()
        out.append(parent)
    return out


class PagePool:
    """Host-side page accounting for each kind: a block-table row per slot, reference counts, a free list,
    and the prefix cache (page hashes, unreferenced cached pages in LRU order)."""

    def __init__(self, layout: CacheLayout, max_num_seqs: int):
        self.layout = layout
        self.tables = {k: np.zeros((max_num_seqs, layout.pages_per_seq), np.int32) for k in layout.layers}
        self.free = {k: list(range(n - 1, 0, -1)) for k, n in layout.pages.items()}  # never used or evicted
        self.refs = {k: np.zeros(n, np.int32) for k, n in layout.pages.items()}
        self.cached = {k: {} for k in layout.layers}  # hash -> page
        self.hash_of = {k: {} for k in layout.layers}  # page -> hash
        self.idle = {k: OrderedDict() for k in layout.layers}  # cached pages no table holds, LRU first
        self.snaps = OrderedDict()  # Gated DeltaNet state snapshots: page hash -> snapshot index, LRU first
        self.snap_free = list(range(layout.snapshots - 1, -1, -1))
        self.first_snapshot_slot = max_num_seqs + 1  # the state slot of snapshot index 0

    def _lo(self, kind: str, first: int) -> int:
        """First logical page a query at position `first` or later can see."""
        return max(0, first - self.layout.window + 1) // self.layout.page_size if kind == "sliding" else 0

    def _take(self, kind: str) -> int:
        if self.free[kind]:
            return self.free[kind].pop()
        page, _ = self.idle[kind].popitem(last=False)  # evict the least recently used cached page
        del self.cached[kind][self.hash_of[kind].pop(page)]
        return page

    def reserve(self, slot: int, first: int, last: int) -> bool:
        """Makes positions first..last of `slot`'s sequence writable and everything a query at `first` or
        later can see readable; sliding kinds drop pages out of the window. False (nothing changed) when a
        pool is out of pages."""
        ps = self.layout.page_size
        need = {}
        for kind, table in self.tables.items():
            need[kind] = [j for j in range(self._lo(kind, first), last // ps + 1) if table[slot, j] == 0]
            if len(need[kind]) > len(self.free[kind]) + len(self.idle[kind]):
                return False
        for kind, table in self.tables.items():
            self._drop(kind, slot, np.nonzero(table[slot, :self._lo(kind, first)])[0])
            for j in need[kind]:
                table[slot, j] = page = self._take(kind)
                self.refs[kind][page] = 1
        return True

    devices = 1  # one device's pages (DataParallelPools: several)

    def device(self, slot: int) -> int:
        """The data-parallel device of engine slot `slot` (0: one device)."""
        return 0

    def state_slot(self, slot: int) -> int:
        """The Gated DeltaNet state slot of engine slot `slot` (the same on one device)."""
        return slot

    def match(self, slot: int, hashes: list[bytes], states: bool = True) -> int:
        """Pages of the longest cached prefix of the chain `hashes` that every kind can serve (and, with
        Gated DeltaNet layers, unless not `states`, whose last page has a state snapshot), for a sequence in
        `slot` (whose device's pages it can share)."""
        m = len(hashes)
        if "full" in self.cached:
            m = next((j for j, h in enumerate(hashes) if h not in self.cached["full"]), m)
        for kind, cached in self.cached.items():
            if kind != "full":  # m pages are a hit if the pages a query at m * ps sees are cached
                while m and not all(h in cached for h in hashes[self._lo(kind, m * self.layout.page_size):m]):
                    m -= 1
        if self.layout.states and states:  # and the states after them
            while m and hashes[m - 1] not in self.snaps:
                m -= 1
        return m

    def snapshot(self, slot: int, h: bytes) -> int | None:
        """The state slot to copy the states named `h` of the sequence in `slot` into (evicting the least
        recently used snapshot when all are taken), or None when they are kept already."""
        if h in self.snaps:
            self.snaps.move_to_end(h)
            return None
        j = self.snap_free.pop() if self.snap_free else self.snaps.popitem(last=False)[1]
        self.snaps[h] = j
        return self.first_snapshot_slot + j

    def restore(self, slot: int, h: bytes) -> int:
        """The state slot of the snapshot named `h` (a `match` for `slot`), now the most recently used."""
        self.snaps.move_to_end(h)
        return self.first_snapshot_slot + self.snaps[h]

    def share(self, slot: int, hashes: list[bytes]) -> None:
        """Puts the cached pages of the chain `hashes` (a `match`) into `slot`'s empty table row."""
        n = len(hashes)
        for kind, table in self.tables.items():
            for j in range(self._lo(kind, n * self.layout.page_size), n):
                table[slot, j] = page = self.cached[kind][hashes[j]]
                self.refs[kind][page] += 1
                self.idle[kind].pop(page, None)

    def register(self, slot: int, hashes: list[bytes], start: int = 0) -> None:
        """Names `slot`'s pages start .. start + len(hashes) - 1 (written, full) for later sequences."""
        for kind, table in self.tables.items():
            for j, h in enumerate(hashes, start):
                page = int(table[slot, j])
                if page and h not in self.cached[kind] and page not in self.hash_of[kind]:
                    self.cached[kind][h], self.hash_of[kind][page] = page, h

    def release(self, slot: int) -> None:
        for kind, table in self.tables.items():
            self._drop(kind, slot, np.nonzero(table[slot])[0])

    def _drop(self, kind: str, slot: int, cols) -> None:
        """Lets go of `slot`'s pages at logical columns `cols`: cached ones wait in LRU order (the last
        column first, as it is the least likely to be shared), the rest are free."""
        table = self.tables[kind]
        for page in (int(p) for p in table[slot, cols][::-1]):
            self.refs[kind][page] -= 1
            if self.refs[kind][page] == 0:
                if page in self.hash_of[kind]:
                    self.idle[kind][page] = None
                else:
                    self.free[kind].append(page)
        table[slot, cols] = 0

    @property
    def used(self) -> int:
        """Pages some sequence holds, all kinds."""
        return sum(n - 1 - len(self.free[k]) - len(self.idle[k]) for k, n in self.layout.pages.items())

    @property
    def cached_pages(self) -> int:
        """Pages holding a named prefix, held or idle, all kinds."""
        return sum(len(c) for c in self.cached.values())

    @property
    def total(self) -> int:
        return sum(n - 1 for n in self.layout.pages.values())


class DataParallelPools:
    """The pages and state slots of a data-parallel Runner: one PagePool per device, each with its own pages,
    prefix cache and snapshots (a sequence shares only its own device's). Engine slot s is slot s % local of
    device s // local (local = max_num_seqs / devices); device d's state slots are [d * per, (d + 1) * per)
    of the stacked states (per: its local + 1 + snapshots). The methods are PagePool's, by engine slot."""

    def __init__(self, layout: CacheLayout, max_num_seqs: int, devices: int):
        self.layout, self.devices, self.local = layout, devices, max_num_seqs // devices
        self.pools = [PagePool(layout, self.local) for _ in range(devices)]
        self.per_device_states = self.local + 1 + layout.snapshots

    def device(self, slot: int) -> int:
        return slot // self.local

    def _at(self, slot: int) -> tuple[PagePool, int]:
        return self.pools[slot // self.local], slot % self.local

    def state_slot(self, slot: int) -> int:
        return self.device(slot) * self.per_device_states + slot % self.local

    def reserve(self, slot: int, first: int, last: int) -> bool:
        pool, s = self._at(slot)
        return pool.reserve(s, first, last)

    def match(self, slot: int, hashes: list[bytes], states: bool = True) -> int:
        return self._at(slot)[0].match(slot, hashes, states)

    def snapshot(self, slot: int, h: bytes) -> int | None:
        j = self._at(slot)[0].snapshot(slot, h)
        return None if j is None else self.device(slot) * self.per_device_states + j

    def restore(self, slot: int, h: bytes) -> int:
        return self.device(slot) * self.per_device_states + self._at(slot)[0].restore(slot, h)

    def share(self, slot: int, hashes: list[bytes]) -> None:
        pool, s = self._at(slot)
        pool.share(s, hashes)

    def register(self, slot: int, hashes: list[bytes], start: int = 0) -> None:
        pool, s = self._at(slot)
        pool.register(s, hashes, start)

    def release(self, slot: int) -> None:
        pool, s = self._at(slot)
        pool.release(s)

    @property
    def used(self) -> int:
        return sum(p.used for p in self.pools)

    @property
    def cached_pages(self) -> int:
        return sum(p.cached_pages for p in self.pools)

    @property
    def total(self) -> int:
        return sum(p.total for p in self.pools)

    @property
    def snaps(self) -> list:
        return [h for p in self.pools for h in p.snaps]
