"""Paged KV storage for :class:`speculative.fast.FastRunner`: fixed-size blocks of a preallocated pool.

The pool is one tensor ``[layers, 2, H_kv, slots, D]`` in 16 bits (float16 by default, as llama.cpp
keeps its cache), ``slots = blocks * block_tokens``. A sequence owns a list of blocks; its position p
lives in slot ``blocks[p // B] * B + p % B``. Blocks are taken from a free list as a sequence grows
and returned when it is released: memory is bounded by the pool, a sequence never doubles, and the
bytes a cached token costs are ``layers * 2 * H_kv * D * 2`` (23,040 for SmolLM2-135M, against
92,160 in float64).

The pool is allocated with ``torch.empty``: its pages become resident only as blocks are first
written, so an idle server's RSS does not carry the whole budget.

Exactness: keys and values are rounded to 16 bits when written and read back by every later step
the same way, so a row's attention inputs do not depend on whether its context was prefilled,
verified or decoded one by one, nor on which other sequences share the step (the float64
attention of :func:`speculative.fast._attend` then keeps rows batch-invariant).
"""

from __future__ import annotations

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

    @property
    def bytes_per_token(self) -> int:
        L, two, H, _, D = self.kv.shape
        return L * two * H * D * self.kv.element_size()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_tokens(self) -> int:
        """Slots held by sequences (whole blocks)."""
        return (self.num_blocks - len(self._free)) * self.block_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFull(f"the KV cache pool has {len(self._free)} free blocks of {self.block_tokens} tokens, "
                              f"{n} more are needed (capacity {self.capacity_tokens} tokens)")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class SeqCache:
    """One sequence's blocks in a :class:`BlockPool`; ``slots[p]`` is position p's slot ([capacity] long)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.slots = torch.empty(0, dtype=torch.long)
        self.length = 0
        self.contiguous = True  # blocks[i] == blocks[0] + i: positions read as one slice of the pool

    def reserve(self, n: int) -> None:
        """Room for positions 0..n-1: whole blocks taken from the pool as needed."""
        B = self.pool.block_tokens
        more = -(-n // B) - len(self.blocks)
        if more > 0:
            new = self.pool.take(more)
            chain = ([self.blocks[-1]] if self.blocks else []) + new
            self.contiguous = self.contiguous and all(b - a == 1 for a, b in zip(chain, chain[1:]))
            self.blocks += new
            fresh = (torch.tensor(new, dtype=torch.long)[:, None] * B + torch.arange(B)).reshape(-1)
            self.slots = torch.cat([self.slots, fresh])

    def read(self, layer: int, end: int) -> torch.Tensor:
        """Keys and values of positions 0..end-1 of one layer, in float64: [2, H_kv, end, D]."""
        if self.contiguous:
            first = self.blocks[0] * self.pool.block_tokens
            return as_float64(self.pool.kv[layer][:, :, first : first + end])  # one slice, no gather
        return as_float64(self.pool.kv[layer].index_select(2, self.slots[:end]))

    def free(self) -> None:
        self.pool.give_back(self.blocks)
        self.blocks, self.slots, self.length, self.contiguous = [], torch.empty(0, dtype=torch.long), 0, True

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

    def _open(self, c) -> SeqCache:
        """The call's cache, cropped back to ``c.start`` (a new one at 0) with room for its tokens."""
        cache, _ = self._cached(c.seq_id, c.start, c.tokens)
        if cache is None:
            cache = self._caches[c.seq_id] = SeqCache(self.pool)
        cache.length = c.start  # crop: positions past start are overwritten
        cache.reserve(c.start + len(c.tokens))
        return cache

    def release(self, seq_id: str) -> None:
        cache = self._caches.pop(seq_id, None)
        if cache is not None:
            cache.free()

    @property
    def kv_bytes_per_token(self) -> int:
        return self.pool.bytes_per_token
