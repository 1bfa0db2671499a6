"""polyrl.train from Python: the TRL user's path (prompts as a list, dataset-like rows or a path; rewards as plain
callables in polyrl's or TRL's form; TRL's names of the settings), on the tiny model and on the real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import polyrl


def digit_count(sample) -> float:
    return sum(c.isdigit() for c in sample.response) / 4.0


def trl_length(prompts, completions, **kwargs) -> list[float]:
    assert len(prompts) == len(completions) == len(kwargs["label"]) == len(kwargs["completion_ids"]) == 1
    return [-0.01 * len(c) for c in completions]


def test_import_polyrl_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, polyrl; print('torch' in sys.modules, callable(polyrl.train))"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_train_takes_rows_callables_and_trl_names(tiny_model, arith_data, tmp_path):
    rows = [json.loads(line) for line in open(arith_data["train"])][:8]
    calls = []

    def polyrl_form(sample):
        calls.append(sample.label)
        return digit_count(sample)
    import datasets
    out = polyrl.train(tiny_model, datasets.Dataset.from_list(rows), [polyrl_form, trl_length], eval_prompts=rows[:2],
                       rollout_batch_size=2, num_generations=2, max_completion_length=4, learning_rate=1e-3,
                       max_steps=2, device="cpu", quiet=True, eval_interval=2, run_dir=str(tmp_path / "run"))
    assert [r["step"] for r in out["metrics"]] == [0, 1, 2] and out["run_dir"] == str(tmp_path / "run")
    assert all(r["lr"] == pytest.approx(1e-3) for r in out["metrics"][1:])
    assert set(calls) <= {r["label"] for r in rows} and len(calls) >= 8  # 2 steps x 2 prompts x 2 samples (+ evals)
    [written] = (tmp_path / "run").glob("prompts-*.jsonl")
    assert [json.loads(line) for line in open(written)] == rows


def test_train_refuses_unknown_settings_and_bad_rows(tiny_model, tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown setting 'rollout_batch'"):
        polyrl.train(tiny_model, ["1+1="], digit_count, rollout_batch=2, run_dir=str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"prompts\[1\] is a int"):
        polyrl.train(tiny_model, ["1+1=", 3], digit_count, run_dir=str(tmp_path / "b"))
    with pytest.raises(ValueError, match="learning_rate is TRL's name for lr"):
        polyrl.train(tiny_model, ["1+1="], digit_count, lr=1e-3, learning_rate=1e-3, run_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="exited with status 2"):  # the command's own validation, its line printed
        polyrl.train(tiny_model, ["1+1="], digit_count, rollout_batch_size=0, device="cpu", run_dir=str(tmp_path / "d"))
    assert "--rollout-batch-size" in capsys.readouterr().err


def test_prompt_data_names_what_a_datasets_directory_needs(tmp_path):
    from polyrl.data import DataError, load_records
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match=r"needs the datasets package \(pip install datasets\)"):
            load_records(str(tmp_path / "ds"))
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(DataError, match=r"a DatasetDict \(splits \['train', 'test'\]\); name one split's directory"):
        load_records(str(tmp_path / "dd"))
    (tmp_path / "other").mkdir()
    with pytest.raises(DataError, match="not a datasets save_to_disk directory"):
        load_records(str(tmp_path / "other"))


def test_a_saved_dataset_directory_reads_as_its_rows(tmp_path):
    import datasets  # make install adds it

    from polyrl.data import load_records
    datasets.Dataset.from_list([{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(5)]).save_to_disk(
        str(tmp_path / "ds"))
    recs = load_records(str(tmp_path / "ds") + "@[1:3]")
    assert [(r.prompt, r.label) for r in recs] == [("1+1=", "2"), ("2+1=", "3")]


def test_the_docs_example_on_the_real_model(real_model, tmp_path):
    """docs/python-api.md's example, shortened: chat-templated one-digit sums, a gsm8k-style reward function."""
    def last_number(sample) -> float:
        import re
        found = re.findall(r"-?\d+", sample.response)
        return float(bool(found) and found[-1] == sample.label)
    prompts = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in ((2, 3), (4, 1))]
    out = polyrl.train(real_model, prompts, [last_number], apply_chat_template=True, rollout_batch_size=2,
                       num_generations=2, max_completion_length=12, learning_rate=1e-5, max_steps=1, device="cpu",
                       quiet=True, run_dir=str(tmp_path / "run"))
    [m] = out["metrics"]
    assert 0.0 <= m["reward/mean"] <= 1.0 and m["lr"] == pytest.approx(1e-5) and m["train_rollout_logprob_abs_diff"] < 1e-4


def test_a_cpu_run_in_a_program_follows_the_load_and_gives_the_program_its_threads_back(tiny_model, tmp_path):
    """In a program that set no wait and no POLYRL_CPU_THREADS (a notebook): the run's rows carry the governed thread
    count, and afterwards the environment and torch's thread count are the program's again."""
    code = f"""
import json, os, torch, polyrl
torch.set_num_threads(2)
def digits(sample):
    return sum(c.isdigit() for c in sample.response) / 4.0
out = polyrl.train({tiny_model!r}, ["1+1=", "2+2="], digits, rollout_batch_size=2, n_samples_per_prompt=2,
                   rollout_max_response_len=3, num_rollout=2, device="cpu", quiet=True, run_dir={str(tmp_path / "run")!r})
print(json.dumps([[r.get("cpu/threads") for r in out["metrics"]], os.environ.get("OMP_WAIT_POLICY"),
                  torch.get_num_threads()]))
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("POLYRL_CPU_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    threads, wait, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(threads) == 2 and all(t is not None and t >= 1 for t in threads)
    assert wait is None and after == 2
