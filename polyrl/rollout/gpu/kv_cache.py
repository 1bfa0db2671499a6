"""Paged KV cache: one buffer of fixed-size blocks shared by all sequences, block tables
mapping each sequence's positions to blocks, and reference counts so the n samples of one
prompt share the prompt's blocks.

Block 0 is never handed out: the padded rows of a CUDA-graph batch write their (ignored)
k/v there.
"""

from __future__ import annotations

import math

import torch


class BlockAllocator:
    """Hands out blocks 1 .. num_blocks - 1: released blocks first (last released, first out), then never-used ones in
    increasing order. Made fresh for every generate() call, so it builds no list of all blocks up front (at ~150k
    blocks that list took ~2 ms of each call)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks = num_blocks
        self.free: list[int] = []  # released blocks
        self.fresh = 1  # blocks [fresh, num_blocks) have never been handed out
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free) + self.num_blocks - self.fresh

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV cache out of blocks: asked {n}, {self.num_free} free")
        k = min(n, len(self.free))
        out = self.free[len(self.free) - k:][::-1]
        del self.free[len(self.free) - k:]
        out += range(self.fresh, self.fresh + n - k)
        self.fresh += n - k
        for b in out:
            self.refs[b] = 1
        return out

    def share(self, blocks: list[int], times: int) -> None:
        for b in blocks:
            self.refs[b] += times

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than held")


class KVCache:
    """k[i], v[i]: layer i's [num_blocks * block_size, Hkv, D] views of one buffer
    [2, layers, slots, Hkv, D] (one allocation: sleep frees it in one go)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, cos: torch.Tensor, sin: torch.Tensor):
        self.shape = (2, layers, num_blocks * block_size, kv_heads, head_dim)
        self.num_blocks, self.block_size, self.dtype, self.device = num_blocks, block_size, dtype, device
        self.cos, self.sin = cos, sin
        self.data: torch.Tensor | None = None
        self.allocate()

    @staticmethod
    def bytes_per_block(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self) -> None:
        self.data = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.data[:, :, :self.block_size].zero_()  # the scratch block: finite values for padded rows
        self.k = list(self.data[0].unbind(0))
        self.v = list(self.data[1].unbind(0))

    def release(self) -> None:
        self.data, self.k, self.v = None, [], []

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (every layer, k and v): the partial last prompt block, once per extra sample."""
        if not src:
            return
        bs = self.block_size
        off = torch.arange(bs)
        s = (torch.tensor(src)[:, None] * bs + off).flatten().to(self.device)
        d = (torch.tensor(dst)[:, None] * bs + off).flatten().to(self.device)
        self.data[:, :, d] = self.data[:, :, s]
