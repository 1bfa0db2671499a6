"""The RL loop end to end through the CLI, on a tiny model: resume, determinism, weight sync."""

from __future__ import annotations

import json
import os

import pytest
import torch

from polyrl.cli import main
from conftest import hf_greedy

REWARD = '''
def digits(sample):
    """partial credit so advantages are non-zero on an untrained model"""
    return sum(c.isdigit() for c in sample.response) / 8.0
'''
KEYS = ("loss", "reward/mean", "grad_norm", "entropy", "pg_loss", "response_len/mean")


def rows(run_dir):
    return [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.fixture
def base_args(tiny_model, arith_data, tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    return ["--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:digits",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6", "--lr", "1e-3",
            "--quiet", "--rollout-shuffle", "--seed", "3"]


def train(args, run_dir, *extra):
    assert main(["train", *args, "--run-dir", str(run_dir), *extra]) == 0
    return rows(run_dir)


def test_resume_logs_the_same_losses_and_rewards(base_args, tmp_path):
    full = train(base_args, tmp_path / "full", "--num-rollout", "4")
    train(base_args, tmp_path / "first", "--num-rollout", "2", "--save", str(tmp_path / "ck"))
    resumed = train(base_args, tmp_path / "second", "--num-rollout", "4", "--load", str(tmp_path / "ck"))
    assert [r["step"] for r in resumed] == [3, 4]
    assert full[0]["grad_norm"] > 0 and full[0]["reward/mean"] > 0
    for r in full:  # the step's wall time is its phases plus what none of them accounts for, shown as time/other
        phases = sum(v for k, v in r.items() if k.startswith("time/") and k not in ("time/step", "time/other", "time/gc"))
        assert r["time/other"] >= 0 and r["time/step"] == pytest.approx(phases + r["time/other"], rel=1e-9)
        assert 0 <= r["time/gc"] <= r["time/step"]  # the collector's pauses, inside the phases
        assert not any(k.startswith("memory/") for k in r)  # the GPU allocator's peaks: CUDA runs only
    for a, b in zip(full[2:], resumed):
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k


def test_same_seed_same_run_and_weight_sync_keeps_rollout_logprobs_exact(base_args, tmp_path):
    a = train(base_args, tmp_path / "a", "--num-rollout", "3")
    b = train(base_args, tmp_path / "b", "--num-rollout", "3")
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in KEYS} == {k: rb[k] for k in KEYS}
    # the engine receives every update: its logprobs equal the trainer's (fp32 CPU) at every step
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in a)
    assert a[-1]["loss"] != a[0]["loss"]


def _saved_steps(template: str, steps: int) -> list[list[dict]]:
    """The samples each step trained on, as --save-debug-rollout-data wrote them (header line first)."""
    return [[json.loads(line) for line in open(template.format(rollout_id=k))][1:] for k in range(steps)]


def _group_adv(rewards: list[float], normalize_std: bool) -> list[float]:
    """GRPO's per-sequence advantage for groups of --n-samples-per-prompt 4: (r - mean) / (unbiased std + 1e-6)."""
    out = []
    for g in range(0, len(rewards), 4):
        r = rewards[g:g + 4]
        mean = sum(r) / 4
        std = (sum((x - mean) ** 2 for x in r) / 3) ** 0.5
        out += [(x - mean) / (std + 1e-6) if normalize_std else x - mean for x in r]
    return out


def _token_mean_of(adv: list[float], samples: list[dict]) -> float:
    """Token mean of per-sequence advantages broadcast to each response token."""
    lens = [len(x["response_ids"]) for x in samples]
    return sum(a * n for a, n in zip(adv, lens)) / sum(lens)


# pg_loss is the token mean of the per-token surrogate. On a step's single optimizer step the loss's old log-probs
# are the current ones detached, so the ratio is exactly 1 and pg_loss = -(token mean of the advantages): computed
# here from each step's saved rewards and lengths with the estimator's formula. Whitened estimators (REINFORCE++ and
# its baseline) have a token mean of 0 by construction, which GRPO's per-sequence advantages over responses of
# different lengths do not; Dr.GRPO drops the std division (advantages several times smaller than GRPO's).
@pytest.mark.parametrize("extra", [
    ["--advantage-estimator", "gspo", "--eps-clip", "3e-4", "--eps-clip-high", "4e-4", "--loss-agg-mode", "seq-mean-token-mean"],
    ["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3", "--ref-update-interval", "1"],
    ["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.05", "--use-kl-loss", "--kl-loss-coef", "0.01"],
    ["--advantage-estimator", "dr_grpo", "--loss-agg-mode", "seq-mean-token-sum-norm", "--global-batch-size", "8",
     "--use-tis", "--eps-clip-c", "3"],
    ["--advantage-estimator", "reinforce_plus_plus_baseline", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "40",
     "--entropy-coef", "0.01"],
])
def test_algorithm_variants_train(base_args, tmp_path, extra):
    saved = str(tmp_path / "rollouts" / "{rollout_id}.jsonl")
    r = train(base_args, tmp_path / "run", "--num-rollout", "2", "--save-debug-rollout-data", saved, *extra)
    assert len(r) == 2
    for row in r:
        assert row["skipped_step"] == 0 and row["grad_norm"] > 0
    steps = _saved_steps(saved, 2)
    estimator = extra[extra.index("--advantage-estimator") + 1] if "--advantage-estimator" in extra else "grpo"
    for row, samples in zip(r, steps):
        rewards = [x["reward"] for x in samples]
        assert len(set(rewards)) > 1, rewards  # partial credit: advantages are not all zero
        grpo = -_token_mean_of(_group_adv(rewards, normalize_std=True), samples)
        if estimator in ("grpo", "gspo"):
            # fp32 sums of 16 advantages of size <= 1.5: 1e-5 covers their rounding
            assert row["pg_loss"] == pytest.approx(grpo, abs=1e-5) and row["ratio"] == pytest.approx(1.0, abs=1e-6)
        elif estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
            # whitening removes the token mean (to fp32 rounding of ~100 unit-scale terms); GRPO's mean is not 0 here
            assert row["pg_loss"] == pytest.approx(0.0, abs=1e-5) and abs(grpo) > 1e-3, (row["pg_loss"], grpo)
        else:  # dr_grpo: two optimizer steps (--global-batch-size 8); the first half's ratio is 1, the second's is near 1
            half = [-_token_mean_of(_group_adv(rewards[k:k + 8], normalize_std=False), samples[k:k + 8]) for k in (0, 8)]
            dr = sum(half) / 2
            # lr 1e-3 moves the second half's ratios and TIS weights by a few percent at most: 10% of the advantages'
            # scale covers them, and GRPO's std-normalised value lies beyond that
            scale = max(abs(a) for a in _group_adv(rewards, normalize_std=False))
            assert abs(row["pg_loss"] - dr) <= 0.1 * scale and abs(grpo - dr) > 0.1 * scale, (row["pg_loss"], dr, grpo)
    if "--use-kl-loss" in extra:
        assert "kl" in r[0] and r[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # actor == reference before any update
        assert r[1]["kl"] >= 0.0
        if "--ref-update-interval" in extra:  # the reference took the actor's weights after step 1: equal again
            assert r[1]["kl"] == pytest.approx(0.0, abs=1e-6)
        else:  # the reference stayed at the initial weights, the actor moved
            assert r[1]["kl"] > 1e-6
    if "--global-batch-size" in extra:  # two optimizer steps per rollout: second one is off-policy
        assert r[0]["ratio"] != 1.0


def test_eval_interval_save_hf_and_plot(base_args, tmp_path, arith_data):
    from transformers import AutoModelForCausalLM
    r = train(base_args, tmp_path / "run", "--num-rollout", "2", "--eval-prompt-data", arith_data["eval"], "--eval-interval", "1",
              "--save-hf", str(tmp_path / "hf"), "--use-tensorboard")
    assert r[0]["step"] == 0 and "eval/accuracy" in r[0]  # the initial policy is evaluated too
    assert [x["step"] for x in r] == [0, 1, 2] and r[1]["eval/n"] == 32
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")) is not None
    assert os.listdir(tmp_path / "run" / "tb")
    assert main(["plot", str(tmp_path / "run")]) == 0
    assert os.path.getsize(tmp_path / "run" / "curves.png") > 10_000


def test_sft_then_eval_from_checkpoint(tiny_model, arith_data, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from polyrl.tasks.arithmetic import write_datasets
    paths = write_datasets(str(tmp_path / "d"), digits=2, n_train=64, n_eval=8, carry_bug_rate=0.0)
    assert main(["sft", "--hf-checkpoint", tiny_model, "--prompt-data", paths["sft"], "--global-batch-size", "16",
                 "--micro-batch-size", "8", "--lr", "3e-3", "--num-epoch", "2", "--save", str(tmp_path / "ck"),
                 "--run-dir", str(tmp_path / "sft"), "--quiet"]) == 0
    r = rows(tmp_path / "sft")
    assert len(r) == 8 and r[-1]["sft_loss"] < r[0]["sft_loss"]
    assert main(["eval", "--hf-checkpoint", tiny_model, "--load", str(tmp_path / "ck"), "--eval-prompt-data", paths["eval"],
                 "--rm-type", "arithmetic", "--run-dir", str(tmp_path / "ev"), "--quiet"]) == 0
    ev = json.load(open(tmp_path / "ev" / "eval.json"))
    assert main(["export-hf", "--hf-checkpoint", tiny_model, "--load", str(tmp_path / "ck"), "--save-hf", str(tmp_path / "hf")]) == 0
    # the export holds the checkpoint's weights bit for bit (fp32 in both containers), every one of them
    ckpt = _checkpoint_model_weights(str(tmp_path / "ck"))
    exported = _safetensors(tmp_path / "hf")
    assert exported and all(torch.equal(exported[k], ckpt[k]) for k in exported), [k for k in exported if k not in ckpt]
    tied = {"lm_head.weight"} if AutoConfig.from_pretrained(str(tmp_path / "hf")).tie_word_embeddings else set()
    assert set(ckpt) - set(exported) <= tied and any(not torch.equal(ckpt[k], base) for k, base in
                                                     _safetensors(tiny_model).items())  # SFT moved the weights
    # eval's figures recomputed without polyrl's engine: transformers' greedy continuation of each prompt from the
    # exported (= checkpoint) weights, scored by the task's reward; eval/response_len pins every response's length too
    from polyrl.data import encode_prompt, load_records
    from polyrl.tasks.arithmetic import reward
    from polyrl.types import Sample
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    correct, lengths, texts = 0, [], []
    for rec in load_records(paths["eval"]):
        ids = encode_prompt(tok, rec.prompt, apply_chat_template=False)
        out = hf_greedy(model, ids, max_new_tokens=64, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)  # --rollout-max-response-len
        texts.append(tok.decode(out, skip_special_tokens=True))
        s = Sample(prompt_ids=ids, response_ids=out, rollout_logprobs=[0.0] * len(out), finish_reason="stop",
                   response=texts[-1], label=rec.label)
        correct += reward(s) > 0.5
        lengths.append(len(out))
    assert ev["eval/n"] == len(lengths) == 8
    assert ev["eval/accuracy"] == correct / 8 and ev["eval/response_len"] == pytest.approx(sum(lengths) / 8, abs=1e-12), \
        (ev, correct, lengths)
    # a tiny SFT model may get none right (accuracy 0 either way): a set labelled with the reference's own answer on the
    # even prompts and an impossible one on the odd gives 0.5 only if eval generates those answers and counts them
    relabelled = tmp_path / "relabelled.jsonl"
    relabelled.write_text("".join(json.dumps({"prompt": rec.prompt, "label": texts[i] if i % 2 == 0 else "no such answer"})
                                  + "\n" for i, rec in enumerate(load_records(paths["eval"]))))
    assert main(["eval", "--hf-checkpoint", tiny_model, "--load", str(tmp_path / "ck"), "--eval-prompt-data", str(relabelled),
                 "--rm-type", "exact", "--run-dir", str(tmp_path / "ev2"), "--quiet"]) == 0
    assert json.load(open(tmp_path / "ev2" / "eval.json"))["eval/accuracy"] == 0.5, texts


def _checkpoint_model_weights(save_dir: str) -> dict:
    """The model tensors of the newest checkpoint under save_dir by HF name, read from its DCP files by torch alone."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from polyrl.checkpoint import resolve_checkpoint
    out = os.path.join(save_dir, "plain.pt")
    dcp_to_torch_save(os.path.join(resolve_checkpoint(save_dir), "dcp"), out)
    model = torch.load(out, weights_only=True)["model"]
    return {k.removeprefix("lm."): v for k, v in model.items()}  # the backend holds the HF model as its `lm` child


def _safetensors(hf_dir) -> dict:
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(hf_dir, name)))
    return out


def test_profile_step_prints_where_the_step_goes_and_writes_a_trace(tiny_model, arith_data, tmp_path, capsys):
    from polyrl.cli import main
    run = tmp_path / "run"
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
                 "--num-rollout", "2", "--profile-step", "2", "--quiet", "--device", "cpu", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "--profile-step 2:" in out and "Self CPU" in out and "aten::" in out
    assert (run / "profile_step2.json").stat().st_size > 0 and not (run / "profile_step1.json").exists()
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--num-rollout", "2", "--profile-step", "3", "--device", "cpu", "--run-dir", str(run)]) == 2


def test_colocated_sync_wakes_weights_then_offloads_the_trainer_then_wakes_the_kv_cache():
    """The order that keeps a colocated sync GPU-to-GPU without holding trainer, engine weights and KV cache at once
    (SGLang's resume_memory_occupation tags): weights back, push from the trainer's GPU copy, trainer off, KV back."""
    import contextlib
    from polyrl.step.handoff import Handoff
    calls = []

    class Engine:
        def wake(self, tags=None):
            calls.append(("wake", tuple(tags)))

        def sleep(self):
            calls.append(("sleep",))

    class Backend:
        def export_weights(self):
            return iter([("w", 1)])

        def offload(self):
            calls.append(("offload",))

    class Transport:
        def push(self, stream, engine, version):
            calls.append(("push", list(stream), version))

    h = Handoff(Backend(), Engine(), Transport(), contextlib.nullcontext(), push_at_start=False)
    h.sync(4)
    assert calls == [("wake", ("weights",)), ("push", [("w", 1)], 4), ("offload",), ("wake", ("kv_cache",))]
    calls.clear()
    h.start(0, resumed=False)  # an engine that loaded the trainer's checkpoint holds its weights already
    h.to_engine(), h.to_trainer()
    assert calls == [("offload",), ("sleep",)]
    calls.clear()
    Handoff(Backend(), Engine(), Transport(), contextlib.nullcontext(), push_at_start=True).start(0, resumed=False)
    assert ("push", [("w", 1)], 0) in calls  # external engines: the trainer's weights before the first rollout


def _handoff_rank(rank, port, log):
    import contextlib
    import os
    import time
    import torch.distributed as dist
    from polyrl.step.handoff import Handoff
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)

    class SharedServers:  # both ranks' engines are the same servers: a sleep holds every rank's requests
        def sleep(self):
            with open(log, "a") as f:
                f.write(f"sleep {rank}\n")

    if rank == 1:
        time.sleep(1.0)  # this rank's rollout is still out when rank 0's ends
        with open(log, "a") as f:
            f.write("rollout 1 done\n")
    Handoff(None, SharedServers(), None, contextlib.nullcontext(), push_at_start=False).to_trainer()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no interpreter finalization with gloo threads about


def test_colocated_servers_sleep_only_once_every_ranks_rollout_is_over(tmp_path):
    """Ranks that share their servers (--use-ray --colocate, torchrun with shared servers): a rank whose rollout ends
    first must not put the servers to sleep while another rank's requests are out (they would wait for a wake that
    comes only after the step, which waits for them)."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "events"
    mp.spawn(_handoff_rank, args=(port, str(log)), nprocs=2)
    events = log.read_text().splitlines()
    assert events[0] == "rollout 1 done" and sorted(events[1:]) == ["sleep 0", "sleep 1"], events


def test_memory_tags_are_checked():
    from polyrl.rollout.base import wake_tags
    assert wake_tags(None) == {"weights", "kv_cache"} and wake_tags(["weights"]) == {"weights"}
    with pytest.raises(ValueError, match="unknown memory tags"):
        wake_tags(["kv"])


def test_a_run_leaves_the_garbage_collector_as_it_found_it(base_args, tmp_path):
    """The loop freezes what is alive after the first step and logs the collector's pauses (time/gc); when the run
    ends, finished or not (here a --load of a checkpoint that is not one fails in the resume), its callback is gone and
    nothing stays frozen, so a later run in this process collects the earlier one's cycles."""
    import gc

    from polyrl.metrics import GcWatch

    def watching():
        return [cb for cb in gc.callbacks if isinstance(getattr(cb, "__self__", None), GcWatch)]
    r = train(base_args, tmp_path / "ok", "--num-rollout", "2")
    assert all(x["time/gc"] >= 0 for x in r) and not watching() and gc.get_freeze_count() == 0
    bad = tmp_path / "not_a_checkpoint"
    bad.mkdir()
    assert main(["train", *base_args, "--run-dir", str(tmp_path / "bad"), "--num-rollout", "2", "--load", str(bad)]) != 0
    assert not watching() and gc.get_freeze_count() == 0
