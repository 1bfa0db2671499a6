"""Multi-turn SFT: a conversation's loss mask covers exactly its assistant turns (hand-checked with the arithmetic
task's character tokenizer, by the prefix rule and by {% generation %} blocks), templates that rewrite earlier turns
are refused, conversation rows load, and `polyrl sft` on conversations lowers the held-out loss on assistant tokens."""

from __future__ import annotations

import json
import random

import pytest
import torch

from polyrl.cli import main
from polyrl.data import DataError, build_conversation_example, build_sft_example, load_sft_records
from polyrl.tasks.arithmetic import build_tokenizer

CONVERSATION = [
    {"role": "user", "content": "12+34="},
    {"role": "assistant", "content": "12+34="},  # a calculator call
    {"role": "tool", "content": "46"},
    {"role": "assistant", "content": "46"},
    {"role": "user", "content": "5+5="},
    {"role": "assistant", "content": "10"},
]
# rendered: 12+34= | 12+34=<eos> | 46 | 46<eos> | 5+5= | 10<eos>   (one token per character, <eos> one token)
EXPECTED_MASK = [0] * 6 + [1] * 7 + [0] * 2 + [1] * 3 + [0] * 4 + [1] * 3
GENERATION_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<eos>"
                       "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("template", ["prefix rule", "generation blocks"])
def test_mask_covers_exactly_the_assistant_turns(template):
    tok = build_tokenizer()
    if template == "generation blocks":
        tok.chat_template = GENERATION_TEMPLATE
    ids, mask = build_conversation_example(tok, CONVERSATION)
    assert ids == tok("12+34=12+34=<eos>4646<eos>5+5=10<eos>", add_special_tokens=False)["input_ids"]
    assert mask == EXPECTED_MASK
    assistant = [t for t, m in zip(ids, mask) if m]
    assert tok.decode(assistant).replace(" ", "") == "12+34=<eos>46<eos>10<eos>"


def test_template_that_rewrites_earlier_turns_is_refused():
    tok = build_tokenizer()
    # like Qwen3's: the last assistant turn is rendered with an extra marker that earlier turns lose in the history
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}+{% endif %}"
                         "{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match=r"assistant turn 1 .*rewrites earlier turns"):
        build_conversation_example(tok, CONVERSATION)
    with pytest.raises(DataError, match="starts with an assistant turn"):
        build_conversation_example(build_tokenizer(), CONVERSATION[1:])


def test_conversation_rows_load_and_need_the_chat_template(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"messages": CONVERSATION}) + "\n"
                 + json.dumps({"messages": CONVERSATION[:1], "response": "46"}) + "\n")
    rows = load_sft_records(str(p), input_key="messages")
    assert [r[1] for r in rows] == [None, "46"]  # a conversation, then a prompt/response row
    tok = build_tokenizer()
    assert build_sft_example(tok, rows[0][0], None, apply_chat_template=True)[1] == EXPECTED_MASK
    with pytest.raises(DataError, match="--apply-chat-template"):
        build_sft_example(tok, rows[0][0], None, apply_chat_template=False)


def _conversations(n: int, seed: int) -> list[dict]:
    rng, rows = random.Random(seed), []
    for _ in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        rows.append({"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": f"{a}+{b}="},
                                  {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]})
    return rows


def _assistant_nll(model_dir: str, rows: list[dict]) -> tuple[float, float]:
    """Mean NLL per token on the assistant tokens and on the others of `rows` (teacher forcing, FP32)."""
    from transformers import AutoModelForCausalLM
    tok, model = build_tokenizer(), AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sums = torch.zeros(2, dtype=torch.float64)
    counts = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for r in rows:
            ids, mask = build_conversation_example(tok, r["messages"])
            x = torch.tensor([ids])
            nll = torch.nn.functional.cross_entropy(model(x).logits[0, :-1], x[0, 1:], reduction="none").double()
            m = torch.tensor(mask[1:], dtype=torch.bool)  # token t + 1 is predicted at position t
            sums += torch.stack([nll[m].sum(), nll[~m].sum()])
            counts += torch.tensor([m.sum(), (~m).sum()], dtype=torch.float64)
    return tuple((sums / counts).tolist())


def test_sft_on_conversations_lowers_the_assistant_loss(tiny_model, tmp_path):
    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _conversations(64, seed=0)))
    held_out = _conversations(16, seed=1)
    out = tmp_path / "hf"
    assert main(["sft", "--hf-checkpoint", tiny_model, "--prompt-data", str(data), "--input-key", "messages",
                 "--apply-chat-template", "--global-batch-size", "16", "--num-epoch", "3", "--lr", "3e-3",
                 "--device", "cpu", "--quiet", "--run-dir", str(tmp_path / "run"), "--save-hf", str(out)]) == 0
    losses = [json.loads(line)["sft_loss"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 12 and losses[-1] < losses[0]
    before, before_other = _assistant_nll(tiny_model, held_out)
    after, after_other = _assistant_nll(str(out), held_out)
    # measured (seed 0, FP32): assistant 2.72 -> 2.35 nats per token, the others 2.70 -> 2.76 (their random digits are
    # never trained on, and the EOS the model learns to put after assistant turns costs there). The bounds keep half
    # of each observed gap, far wider than what CPU summation order moves in 12 FP32 Adam steps.
    assert after < before - 0.15, (before, after)
    assert (after_other - before_other) - (after - before) > 0.25, (before_other, after_other)
