"""polyrl.rollout.gpu.kv_cache.BlockAllocator: which blocks it hands out, reference counts, running out."""

import random

import pytest

from polyrl.rollout.gpu.kv_cache import BlockAllocator


class _ListAllocator:
    """The plain version (a list of every free block, low ids first, released blocks reused last-in first-out): what
    the allocator must hand out, without building that list."""

    def __init__(self, n):
        self.free, self.refs = list(range(n - 1, 0, -1)), [0] * n

    def allocate(self, n):
        if n > len(self.free):
            raise RuntimeError("out of blocks")
        out = [self.free.pop() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def share(self, blocks, times):
        for b in blocks:
            self.refs[b] += times

    def release(self, blocks):
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)


def test_hands_out_the_same_blocks_as_a_free_list_of_every_block():
    rng = random.Random(0)
    for _ in range(100):
        n = rng.randrange(2, 120)
        a, ref, held = BlockAllocator(n), _ListAllocator(n), []
        for _ in range(200):
            if rng.random() < 0.5 or not held:
                k = rng.randrange(0, 10)
                if k > len(ref.free):
                    with pytest.raises(RuntimeError, match="out of blocks"):
                        a.allocate(k)
                    continue
                got = a.allocate(k)
                assert got == ref.allocate(k)
                held.append(got)
                if got and rng.random() < 0.3:  # a prompt's blocks shared by more samples
                    t = rng.randrange(1, 4)
                    a.share(got, t)
                    ref.share(got, t)
                    held += [got] * t
            else:
                blocks = held.pop(rng.randrange(len(held)))
                a.release(blocks)
                ref.release(blocks)
            assert a.num_free == len(ref.free) and a.refs == ref.refs
            assert 0 not in a.free  # block 0 is the graphs' scratch block, never handed out


def test_releasing_more_than_held_is_an_error():
    a = BlockAllocator(4)
    b = a.allocate(2)
    a.release(b)
    with pytest.raises(RuntimeError, match="released more often than held"):
        a.release(b[:1])
