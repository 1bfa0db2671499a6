"""A tiny chat model for the OpenAI routes and agent tests: the arithmetic task's character tokenizer with letters,
JSON punctuation and Qwen-style tags (`<|im_start|>`, `<tool_call>`, ...), a Qwen-like chat template whose turns end
with `<eos>`, and a random 2-layer Llama model with room for 256 positions (transformers loads a Qwen2 model's tokenizer as
Qwen2Tokenizer, whose byte-level pre-tokenizer would drop this vocabulary's spaces). ScriptedEngine answers queued token ids
instead of sampling, so a test can make the model call a tool; everything else is the embedded engine."""

from __future__ import annotations

import torch

from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.types import Sample

TAGS = ("<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHARS = tuple("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,:;!?'\"{}[]_#*-/()\n")
# Qwen2.5's shape: a system turn listing the tools, tool results as user turns in <tool_response>, calls as JSON in
# <tool_call>; an assistant turn ends with the tokenizer's EOS (<eos>, Qwen's <|im_end|>)
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools: {% for t in tools %}{{ t.function.name }} {% endfor %}<eos>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<eos>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><eos>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<eos>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(extra: tuple[str, ...] = ()):
    from tokenizers import decoders

    from polyrl.tasks.arithmetic import build_tokenizer
    tok = build_tokenizer(extra_tokens=CHARS + TAGS + extra, chat_template=CHAT_TEMPLATE)
    tok.backend_tokenizer.decoder = decoders.Fuse()  # characters join without spaces, as real text does
    return tok


def make_chat_model(path: str, *, max_positions: int = 256, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig
    tok = chat_tokenizer()
    tok.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id, head_dim=16)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


class ScriptedEngine(EmbeddedEngine):
    """The embedded engine; while `script` holds texts, each prompt is answered with the next one's tokens (and
    <eos>), log-prob -0.25 a token. `prompts` records every prompt it was given."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.script: list[str] = []
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params, **kw):
        self.prompts.extend(list(p) for p in prompts)
        if not self.script:
            return super().generate(prompts, params, **kw)
        out = []
        for i, p in enumerate(prompts):
            for _ in range(params.n):
                ids = self.tokenizer.encode(self.script.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
                ids = ids[:params.max_new_tokens]
                fin = "stop" if ids and ids[-1] == self.tokenizer.eos_token_id else "length"
                out.append(Sample(list(p), ids, [-0.25] * len(ids), fin, group_index=i))
        return out


# An agent of two chat calls through the openai SDK (tests of the gateway import it into an agent module)
PLAIN_AGENT = '''
import openai

async def plain(task, client):
    """Two chat calls; the reward: whether the second answer is longer than the first (something to learn)."""
    async with openai.AsyncOpenAI(**client.openai_kwargs(), max_retries=0) as oa:
        r1 = await oa.chat.completions.create(model=client.model, messages=task.messages, max_tokens=4)
        history = [*task.messages, {"role": "assistant", "content": r1.choices[0].message.content},
                   {"role": "user", "content": "more"}]
        r2 = await oa.chat.completions.create(model=client.model, messages=history, max_tokens=4)
    return float(len(r2.choices[0].message.content or "") > len(r1.choices[0].message.content or ""))
'''
