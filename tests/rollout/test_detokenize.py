"""Batched response texts (polyrl.rollout.detokenize) equal `tokenizer.decode(ids, skip_special_tokens=True)`."""

import multiprocessing
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from polyrl.rollout.detokenize import CHUNK, Detokenizer, batch_decoder, decode_all
from polyrl.tasks.arithmetic import build_tokenizer
from polyrl.types import Sample

CORPUS = ["naïve café 12+34=46 déjà vu", "über 😀 emoji and 漢字 text", "the quick brown fox", "x" * 40] * 20


def byte_bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE like Qwen's / Llama 3's (multi-byte characters span tokens), with special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def random_seqs(tok, n: int, length: int, seed: int = 0) -> list[list[int]]:
    # any id the vocabulary has, special ones included, cut anywhere (half a multi-byte character too)
    rng = random.Random(seed)
    return [[rng.randrange(len(tok)) for _ in range(rng.randrange(0, length))] for _ in range(n)]


@pytest.mark.parametrize("make", [byte_bpe, build_tokenizer], ids=["byte-bpe", "char"])
def test_batched_texts_equal_decode(make):
    tok = make()
    assert batch_decoder(tok) is not None  # the fast path is the one under test
    seqs = random_seqs(tok, 3 * CHUNK + 5, 60) + [tok(t)["input_ids"] for t in CORPUS[:4]]
    assert decode_all(tok, seqs) == [tok.decode(s, skip_special_tokens=True) for s in seqs]


def test_clean_up_spaces_tokenizer_keeps_the_per_sample_decode():
    tok = byte_bpe()
    tok.clean_up_tokenization_spaces = True  # transformers' clean-up runs in Python: not the backend's text
    assert batch_decoder(tok) is None
    seqs = random_seqs(tok, 10, 30, seed=1)
    assert decode_all(tok, seqs) == [tok.decode(s, skip_special_tokens=True) for s in seqs]


def test_detokenizer_fills_every_batch_in_order():
    tok = byte_bpe()
    seqs = random_seqs(tok, 2 * CHUNK + 3, 40, seed=2)
    samples = [Sample(prompt_ids=[1], response_ids=s, rollout_logprobs=[0.0] * len(s), finish_reason="length") for s in seqs]
    d = Detokenizer(tok)
    d.add(samples[:1])  # batches of any size, as rows finish
    d.add(samples[1:CHUNK + 7])
    d.add([])
    d.add(samples[CHUNK + 7:])
    d.finish()
    assert [s.response for s in samples] == [tok.decode(s, skip_special_tokens=True) for s in seqs]
    assert d.pending == []


def _decode_in_child(q):
    tok = byte_bpe()
    seqs = random_seqs(tok, 2 * CHUNK, 20, seed=3)
    q.put(decode_all(tok, seqs) == [tok.decode(s, skip_special_tokens=True) for s in seqs])


def test_a_forked_child_decodes_with_its_own_threads():
    """The parent's pool has run work (its threads exist); a child forked from it must not queue onto that pool,
    whose threads it does not have."""
    tok = byte_bpe()
    decode_all(tok, random_seqs(tok, 2 * CHUNK, 20))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_decode_in_child, args=(q,))
    p.start()
    p.join(timeout=60)
    alive = p.is_alive()
    if alive:
        p.kill()
    assert not alive, "the forked child hung decoding (it queued onto the parent's thread pool)"
    assert q.get(timeout=5) is True
