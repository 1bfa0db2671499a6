"""Multi-digit addition with a character tokenizer.

The SFT demonstrations are *noisy in a systematic way*: a fraction of them forget the carry
(the classic human addition bug). Supervised learning imitates the majority habit; RL with
an exact-answer verifier can then find and reinforce the correct procedure the model
already samples sometimes. That gap is what `make demo` measures.
"""

from __future__ import annotations

import json
import os
import random

from polyrl.types import Sample

CHARS = list("0123456789+=")
SPECIAL = ["<pad>", "<eos>"]
# contents only (a prompt renders as itself); an assistant turn ends with EOS, as real templates end it with their
# end-of-turn token, so multi-turn SFT teaches the model to end its turns
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"


def build_tokenizer(out_dir: str | None = None, *, extra_tokens: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE):
    """A one-token-per-character tokenizer (vocab of 14, then `extra_tokens` with the ids after it) as a
    PreTrainedTokenizerFast. A tag such as `<tool_call>` is one token; the base ids never move, so a tokenizer with
    extras still encodes the task's characters as the plain one does."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS + list(extra_tokens))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # tags are added tokens, matched before any pre-tokenizer: transformers loads a qwen2 model's tokenizer as
    # Qwen2Tokenizer, whose own pre-tokenizer would cut a tag into unknown pieces
    tok.add_tokens([AddedToken(t, normalized=False) for t in extra_tokens if len(t) > 1])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = chat_template
    if out_dir:
        fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: str, *, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                seed: int = 0, arch: str = "qwen2", tokenizer=None):
    """A tiny causal LM with random weights, saved with the tokenizer (build_tokenizer()'s unless given) as a local
    HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    tok = tokenizer or build_tokenizer()
    tok.save_pretrained(out_dir)
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden, norm_topk_prob=True) if arch == "qwen3_moe" else {}
    cfg = cls(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
              tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
              bos_token_id=tok.eos_token_id, head_dim=hidden // heads, **moe)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return model, tok


def _no_carry_sum(a: int, b: int) -> int:
    """Digit-wise sum mod 10: what you write when you forget every carry."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def make_problem(rng: random.Random, digits: int) -> tuple[str, int, int]:
    a = rng.randrange(10 ** (digits - 1), 10**digits)
    b = rng.randrange(10 ** (digits - 1), 10**digits)
    return f"{a}+{b}=", a + b, _no_carry_sum(a, b)


def write_datasets(out_dir: str, *, digits: int = 3, n_train: int = 4000, n_eval: int = 200, carry_bug_rate: float = 0.6,
                   seed: int = 0) -> dict[str, str]:
    """Writes sft.jsonl (prompt/response, with the carry bug at `carry_bug_rate`), train.jsonl and
    eval.jsonl (prompt/label). Eval prompts never appear in train or SFT data."""
    rng = random.Random(seed)
    seen: set[str] = set()
    def fresh(n):
        rows = []
        while len(rows) < n:
            p, ans, bug = make_problem(rng, digits)
            if p not in seen:
                seen.add(p)
                rows.append((p, ans, bug))
        return rows
    eval_rows = fresh(n_eval)
    train_rows = fresh(n_train)
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{k}.jsonl") for k in ("sft", "train", "eval")}
    with open(paths["sft"], "w") as f:
        for p, ans, bug in train_rows:
            resp = bug if rng.random() < carry_bug_rate else ans
            f.write(json.dumps({"prompt": p, "response": str(resp)}) + "\n")
    for key, rows in (("train", train_rows), ("eval", eval_rows)):
        with open(paths[key], "w") as f:
            for p, ans, _ in rows:
                f.write(json.dumps({"prompt": p, "label": str(ans)}) + "\n")
    return paths


def reward(sample: Sample) -> float:
    """1.0 when the response is exactly the sum."""
    return 1.0 if sample.response.strip() == str(sample.label).strip() else 0.0
