"""Paged KV cache: one buffer of fixed-size blocks shared by all sequences, block tables
mapping each sequence's positions to blocks, and reference counts so the n samples of one
prompt share the prompt's blocks.

Block 0 is never handed out: the padded rows of a CUDA-graph batch write their (ignored)
k/v there.
"""

from __future__ import annotations

import math

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn  # --kv-cache-dtype fp8_e4m3 (SGLang's spelling)
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": FP8_KV_DTYPE}


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
    [2, layers, slots, Hkv, D] (one allocation: sleep frees it in one go).

    kv_dtype float8_e4m3fn (--kv-cache-dtype fp8_e4m3): the cache holds E4M3 values with one float32 scale per
    (token, kv head), ks[i] / vs[i] [slots, Hkv], in the same allocation: each head's largest |x| maps onto 448, so
    every value keeps E4M3's 3 mantissa bits relative to its own head vector (no calibration, no static scale to go
    stale as the policy trains). 2 * D + 8 bytes per token and head instead of 4 * D in BF16."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, cos: torch.Tensor, sin: torch.Tensor,
                 kv_dtype: torch.dtype | None = None):
        self.shape = (2, layers, num_blocks * block_size, kv_heads, head_dim)
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.dtype = kv_dtype or dtype
        self.fp8 = self.dtype == FP8_KV_DTYPE
        self.cos, self.sin = cos, sin
        self.data: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.allocate()

    @staticmethod
    def bytes_per_block(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """dtype: the cache's (the model's, or FP8_KV_DTYPE with its per-head float32 scales)."""
        per = head_dim * torch.empty((), dtype=dtype).element_size() + (4 if dtype == FP8_KV_DTYPE else 0)
        return 2 * layers * block_size * kv_heads * per

    @property
    def _value_bytes(self) -> int:
        return -(-math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size() // 256) * 256

    @property
    def nbytes(self) -> int:
        return self._value_bytes + (4 * math.prod(self.shape[:4]) if self.fp8 else 0)

    def allocate(self) -> None:
        buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        n = math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()
        self.data = buf[:n].view(self.dtype).view(self.shape)
        self.data[:, :, :self.block_size].zero_()  # the scratch block: finite values for padded rows
        self.k = list(self.data[0].unbind(0))
        self.v = list(self.data[1].unbind(0))
        self.ks = self.vs = [None] * self.shape[1]
        if self.fp8:
            self.scales = buf[self._value_bytes:].view(torch.float32).view(self.shape[:4])
            self.scales[:, :, :self.block_size].fill_(1.0)
            self.ks = list(self.scales[0].unbind(0))
            self.vs = list(self.scales[1].unbind(0))

    def release(self) -> None:
        self.data, self.scales, self.k, self.v, self.ks, self.vs = None, None, [], [], [], []

    def scales_of(self, layer: int) -> dict:
        """The FP8 cache's scale views of one layer as the ops' keyword arguments ({} for a cache in the model dtype)."""
        return {"k_scale": self.ks[layer], "v_scale": self.vs[layer]} if self.fp8 else {}

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (every layer, k and v, and their scales): the partial last prompt block, once per extra
        sample."""
        if not src:
            return
        bs = self.block_size
        off = torch.arange(bs)
        s = (torch.tensor(src)[:, None] * bs + off).flatten().to(self.device)
        d = (torch.tensor(dst)[:, None] * bs + off).flatten().to(self.device)
        self.data[:, :, d] = self.data[:, :, s]
        if self.fp8:
            self.scales[:, :, d] = self.scales[:, :, s]
