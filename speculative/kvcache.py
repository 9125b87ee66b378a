"""Paged KV storage for :class:`speculative.fast.FastRunner`: fixed-size blocks of a preallocated pool.

The pool is one tensor ``[layers, 2, H_kv, slots, D]`` in 16 bits (float16 by default, as llama.cpp
keeps its cache), ``slots = blocks * block_tokens``. A sequence owns a list of blocks; its position p
lives in slot ``blocks[p // B] * B + p % B``. Blocks are taken from a free list as a sequence grows
and returned when it is released: memory is bounded by the pool, a sequence never doubles, and the
bytes a cached token costs are ``layers * 2 * H_kv * D * 2`` (23,040 for SmolLM2-135M, against
92,160 in float64).

The pool is allocated with ``torch.empty``: its pages become resident only as blocks are first
written, so an idle server's RSS does not carry the whole budget.

Prefix caching: a block whose positions are all settled (below the start of its sequence's next
call) is indexed by a digest of every token up to its end and the request's cache salt (its
tenant). A new request's prompt takes the longest run of indexed blocks it matches, then copies the
matching head of one more block, so its prefill starts after what is already cached (a shared
system prompt, a conversation's history re-sent). Indexed blocks are never written: a sequence that
steps back into one copies it first. Released blocks that are indexed stay cached, least recently
used first out, until the pool needs them or their number passes ``max_idle_blocks``. Different
salts never share a block, so one tenant's prompts cannot be timed by another's.

Memory: the free list hands out the block freed last, so pages already written are reused before
new ones become resident. Without ``max_idle_blocks`` the idle cache alone grows until every page
of the pool is resident (the whole budget, however few tokens run); with it, resident memory stays
near the most the running sequences held at once plus that many idle blocks.

Exactness: keys and values are rounded to 16 bits when written and read back by every later step
the same way, so a row's attention inputs do not depend on whether its context was prefilled,
verified or decoded one by one, nor on which other sequences share the step (the float64
attention of :func:`speculative.fast._attend` then keeps rows batch-invariant).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable

import torch

#: float32 is for checks of a forward against a float32 reference; a server keeps 16 bits
KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def as_float64(x: torch.Tensor) -> torch.Tensor:
    """16-bit keys and values for the float64 attention. float16 goes through float32: the same
    values (both conversions are exact), about 3x faster on the CPU than float16 -> float64 at once."""
    return (x.float() if x.dtype == torch.float16 else x).double()


class KVCacheFull(RuntimeError):
    """The pool has no free block for a sequence's next positions."""


class BlockPool:
    """Fixed-size blocks of keys and values for every layer: ``kv`` is [L, 2, H_kv, slots, D]."""

    def __init__(self, layers: int, heads: int, dim: int, max_tokens: int, block_tokens: int = 16,
                 dtype: str = "float16", device: str | torch.device = "cpu", zeroed: bool = False):
        if dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {sorted(KV_DTYPES)}, not {dtype!r}")
        if block_tokens < 1 or max_tokens < 1:
            raise ValueError("the KV pool needs at least one block of at least one token")
        self.block_tokens = block_tokens
        self.num_blocks = -(-max_tokens // block_tokens)
        shape = (layers, 2, heads, self.num_blocks * block_tokens, dim)
        # ``zeroed``: every slot holds a finite number from the start (the lean path reads masked
        # slots: a weight of exactly 0 times garbage could be NaN); else pages become resident as used
        alloc = torch.zeros if zeroed else torch.empty
        self.kv = alloc(shape, dtype=KV_DTYPES[dtype], device=device)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low blocks first
        self._refs = [0] * self.num_blocks  # sequences holding each block
        # the prefix index: digest of (salt, every token to a block's end) -> block; per block its
        # digest, its parent's, its own tokens and the salt's root its chain hangs from; blocks no
        # sequence holds, least recently used first
        self._index: dict[bytes, int] = {}
        self._meta: dict[int, tuple[bytes, bytes, tuple[int, ...], bytes]] = {}
        self._children: dict[bytes, list[int]] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        #: idle cached blocks kept at most (least recently used leave the index first); None: all
        self.max_idle_blocks: int | None = None
        #: prompt positions looked up in the index, and found there
        self.prefix_stats = {"looked_up": 0, "hit": 0}

    @property
    def bytes_per_token(self) -> int:
        L, two, H, _, D = self.kv.shape
        return L * two * H * D * self.kv.element_size()

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence can take: free ones, and cached ones no sequence holds."""
        return len(self._free) + len(self._idle)

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix index (held by sequences or idle)."""
        return len(self._meta)

    @property
    def used_tokens(self) -> int:
        """Slots held by sequences (whole blocks)."""
        return (self.num_blocks - self.free_blocks) * self.block_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    def take(self, n: int) -> list[int]:
        """n blocks for one sequence: free ones first, then idle cached ones (least recently used
        first, leaving the index)."""
        if n > self.free_blocks:
            raise KVCacheFull(f"the KV cache pool has {self.free_blocks} free blocks of {self.block_tokens} tokens, "
                              f"{n} more are needed (capacity {self.capacity_tokens} tokens)")
        while len(self._free) < n:
            self._evict_idle()
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def give_back(self, blocks: list[int]) -> None:
        """A sequence lets go of ``blocks``: indexed ones no one else holds stay cached (idle)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] > 0:
                continue
            if b in self._meta:
                self._idle[b] = None
            else:
                self._free.append(b)
        if self.max_idle_blocks is not None:
            while len(self._idle) > self.max_idle_blocks:
                self._evict_idle()

    def _evict_idle(self) -> None:
        """The least recently used idle cached block leaves the index for the free list."""
        block, _ = self._idle.popitem(last=False)
        self._unindex(block)
        self._free.append(block)

    # -- the prefix index ---------------------------------------------------------------------
    @staticmethod
    def digest(parent: bytes, tokens) -> bytes:
        """The key of a block: its parent's key (the salt's, for a first block) and its tokens."""
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(torch.as_tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
        return h.digest()

    @staticmethod
    def root(salt: str | None) -> bytes:
        return hashlib.blake2b(("salt:" + (salt or "")).encode(), digest_size=16).digest()

    def indexed(self, block: int) -> bool:
        return block in self._meta

    def index(self, block: int, parent: bytes, tokens: tuple[int, ...], root: bytes) -> bytes:
        """Enter a settled full block under (parent, tokens) of a chain from ``root`` (its salt's);
        returns its key. A block of the same key already there stays the one found (this one is
        freed when its sequence lets go)."""
        key = self.digest(parent, tokens)
        if key not in self._index and block not in self._meta:
            self._index[key] = block
            self._meta[block] = (key, parent, tuple(tokens), root)
            self._children.setdefault(parent, []).append(block)
        return key

    def drop_index(self) -> None:
        """Forget every cached prefix (the model's weights changed: their keys and values are stale)."""
        for b in list(self._meta):
            self._unindex(b)
        self._free.extend(self._idle)
        self._idle.clear()

    def forget(self, salt: str | None) -> int:
        """Drop every cached block of ``salt`` (a tenant whose records are deleted) from the index:
        idle ones are freed at once, held ones when their sequence lets go. Returns how many."""
        root = self.root(salt)
        gone = [b for b, meta in self._meta.items() if meta[3] == root]
        for b in gone:
            self._unindex(b)
            if b in self._idle:
                del self._idle[b]
                self._free.append(b)
        return len(gone)

    def _unindex(self, block: int) -> None:
        key, parent, _, _ = self._meta.pop(block)
        del self._index[key]
        kids = self._children[parent]
        kids.remove(block)
        if not kids:
            del self._children[parent]

    def share(self, block: int) -> None:
        """One more sequence holds an indexed ``block``."""
        self._refs[block] += 1
        self._idle.pop(block, None)

    def find(self, key: bytes) -> int | None:
        return self._index.get(key)

    def lookup(self, root: bytes, tokens: list[int]) -> tuple[list[int], list[bytes], tuple[int | None, int]]:
        """The cached prefix of ``tokens`` in the chain from ``root`` (a salt's), touching nothing:
        its whole indexed blocks and their keys, then (block, positions) of the indexed block after
        them that matches the longest head of the rest (:meth:`best_child`)."""
        B = self.block_tokens
        blocks: list[int] = []
        keys: list[bytes] = []
        while (len(blocks) + 1) * B <= len(tokens):
            n = len(blocks) * B
            key = self.digest(keys[-1] if keys else root, tokens[n : n + B])
            block = self.find(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
        n = len(blocks) * B
        return blocks, keys, self.best_child(keys[-1] if keys else root, tokens[n : n + B])

    def best_child(self, parent: bytes, tokens: list[int]) -> tuple[int | None, int]:
        """The indexed block after ``parent`` whose tokens start with the longest head of ``tokens``:
        (block, how many positions match); (None, 0) when none does."""
        best, most = None, 0
        for b in self._children.get(parent, ()):
            own = self._meta[b][2]
            m = 0
            for a, t in zip(own, tokens):
                if a != t:
                    break
                m += 1
            if m > most:
                best, most = b, m
        return best, most

    def copy_of(self, src: int, n: int) -> int:
        """A fresh block holding positions 0..n-1 of block ``src`` (every layer); ``src`` is held
        meanwhile, so taking the fresh block cannot evict it."""
        self.share(src)
        (dst,) = self.take(1)
        B = self.block_tokens
        self.kv[:, :, :, dst * B : dst * B + n] = self.kv[:, :, :, src * B : src * B + n]
        self.give_back([src])
        return dst


class SeqCache:
    """One sequence's blocks in a :class:`BlockPool`; ``slots[p]`` is position p's slot ([capacity] long)."""

    def __init__(self, pool: BlockPool, salt: str | None = None):
        self.pool = pool
        self.blocks: list[int] = []
        self.slots = torch.empty(0, dtype=torch.long)
        self.length = 0
        self.contiguous = True  # blocks[i] == blocks[0] + i: positions read as one slice of the pool
        self.tokens: list[int] = []  # the token at each written position (what the prefix index keys)
        self.keys: list[bytes] = [BlockPool.root(salt)]  # keys[i]: the key block i's entry hangs from

    def attach(self, tokens: list[int]) -> int:
        """An empty sequence takes the longest cached prefix of ``tokens``: whole indexed blocks,
        shared, then the matching head of one more, copied. Returns the positions now cached."""
        pool = self.pool
        pool.prefix_stats["looked_up"] += len(tokens)
        blocks, keys, (src, m) = pool.lookup(self.keys[0], tokens)
        for block in blocks:
            pool.share(block)
        self.blocks, self.keys = list(blocks), [self.keys[0], *keys]
        n = len(blocks) * pool.block_tokens
        if src is not None:
            self.blocks.append(pool.copy_of(src, m))
            n += m
        self._slots_from(0)
        self.tokens, self.length = list(tokens[:n]), n
        pool.prefix_stats["hit"] += n
        return n

    def write(self, start: int, tokens: list[int]) -> None:
        """A call writes ``tokens`` at ``start``..: the blocks before ``start`` are settled (indexed
        now), an indexed block at or after it is copied first (never written in place)."""
        pool, B = self.pool, self.pool.block_tokens
        first = start // B
        for i in range(first, len(self.blocks)):
            if pool.indexed(self.blocks[i]):
                old, self.blocks[i] = self.blocks[i], pool.copy_of(self.blocks[i], B)
                pool.give_back([old])
                del self.keys[i + 1 :]
                self._slots_from(i)
        del self.tokens[start:]
        self.tokens += tokens
        for i in range(len(self.keys) - 1, min(start // B, len(self.blocks))):  # settled full blocks: indexed
            self.keys.append(pool.index(self.blocks[i], self.keys[i], tuple(self.tokens[i * B : (i + 1) * B]), self.keys[0]))

    def _slots_from(self, i: int) -> None:
        B = self.pool.block_tokens
        tail = torch.tensor(self.blocks[i:], dtype=torch.long)
        fresh = (tail[:, None] * B + torch.arange(B)).reshape(-1)
        self.slots = torch.cat([self.slots[: i * B], fresh])
        self.contiguous = all(b - a == 1 for a, b in zip(self.blocks, self.blocks[1:]))

    def reserve(self, n: int) -> None:
        """Room for positions 0..n-1: whole blocks taken from the pool as needed."""
        B = self.pool.block_tokens
        more = -(-n // B) - len(self.blocks)
        if more > 0:
            self.blocks += self.pool.take(more)
            self._slots_from(len(self.blocks) - more)

    def read(self, layer: int, end: int) -> torch.Tensor:
        """Keys and values of positions 0..end-1 of one layer, in float64: [2, H_kv, end, D]."""
        if self.contiguous:
            first = self.blocks[0] * self.pool.block_tokens
            return as_float64(self.pool.kv[layer][:, :, first : first + end])  # one slice, no gather
        return as_float64(self.pool.kv[layer].index_select(2, self.slots[:end]))

    def free(self) -> None:
        self.pool.give_back(self.blocks)
        self.blocks, self.slots, self.length, self.contiguous = [], torch.empty(0, dtype=torch.long), 0, True
        self.tokens, self.keys = [], self.keys[:1]

    def get_seq_length(self) -> int:
        return self.length


def kv_bytes_per_token(config, runtime: str, kv_dtype: str = "float16", eager_dtype: str = "float32") -> int:
    """Bytes of keys and values one cached position costs for a model ``config`` (a transformers
    config) on a runtime: the fast path (``int4`` / ``int8`` / ``auto`` on a CPU) stores ``kv_dtype``;
    Hugging Face eager (``none``) keeps the model's own dtype."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    size = KV_DTYPES[kv_dtype].itemsize if runtime != "none" else getattr(torch, eager_dtype).itemsize
    return config.num_hidden_layers * 2 * heads * dim * size


class PooledCaches:
    """Per-sequence caches in one :class:`BlockPool` (``self.pool``), for a runner that keeps its
    caches by id in ``self._caches`` and checks calls with ``self._cached`` (the fast and lean paths)."""

    #: reuse cached prompt prefixes across sequences (:meth:`attach_prefix`); a server turns it on
    prefix_caching = False
    # what the runner provides
    pool: BlockPool
    _caches: dict[str, SeqCache]
    _cached: Callable[[str, int, list[int]], tuple[SeqCache | None, int]]

    def _open(self, c) -> SeqCache:
        """The call's cache, cropped back to ``c.start`` (a new one at 0) with room for its tokens."""
        cache, _ = self._cached(c.seq_id, c.start, c.tokens)
        if cache is None:
            cache = self._caches[c.seq_id] = SeqCache(self.pool)
        cache.length = c.start  # crop: positions past start are overwritten
        cache.reserve(c.start + len(c.tokens))
        if self.prefix_caching:
            cache.write(c.start, list(c.tokens))
        return cache

    def limit_prefix_cache(self, tokens: int | None) -> None:
        """Keep at most ``tokens`` positions of idle cached prefixes (whole blocks; None: no bound)."""
        self.pool.max_idle_blocks = None if tokens is None else tokens // self.pool.block_tokens

    def forget_prefixes(self, salt: str | None) -> int:
        """Cached prompt prefixes of ``salt`` leave the index (a tenant's records deleted)."""
        return self.pool.forget(salt)

    def attach_prefix(self, seq_id: str, tokens: list[int], salt: str | None = None) -> int:
        """A new sequence starts from the longest cached prefix of its prompt ``tokens`` (at most
        all but the last token, which a call must feed to get its logits) among sequences of the
        same ``salt``; returns how many positions are cached (0 with prefix caching off)."""
        self.release(seq_id)
        if not self.prefix_caching or len(tokens) < 2:
            return 0
        cache = self._caches[seq_id] = SeqCache(self.pool, salt)
        return cache.attach(list(tokens[:-1]))

    def cached_prefix(self, tokens: list[int], salt: str | None = None) -> int:
        """The positions :meth:`attach_prefix` would find cached for a prompt of ``tokens`` now."""
        if not self.prefix_caching or len(tokens) < 2:
            return 0
        blocks, _, (_, m) = self.pool.lookup(BlockPool.root(salt), list(tokens[:-1]))
        return len(blocks) * self.pool.block_tokens + m

    def release(self, seq_id: str) -> None:
        cache = self._caches.pop(seq_id, None)
        if cache is not None:
            cache.free()

    @property
    def kv_bytes_per_token(self) -> int:
        return self.pool.bytes_per_token
