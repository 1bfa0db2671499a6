"""--use-wandb: the metrics.jsonl keys go to Weights & Biases too, from rank 0, under RUN_DIR/wandb.

wandb is not a test dependency (about 75 MB installed with its own needs), so the logging path is tested
with a fake `wandb` module put in sys.modules; the offline test with the real package runs where it is
installed (`pip install 'polyrl[wandb]'`) and is skipped elsewhere.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types

import pytest

from polyrl.cli import main
from polyrl.config import Config
from polyrl.metrics import logger_from_config, start_wandb


def _args(tiny_model, arith_data, run, *extra):
    return ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--quiet",
            "--device", "cpu", "--run-dir", str(run), *extra]


def _rows(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


class FakeRun:
    def __init__(self, **kw):
        self.init, self.logged, self.finished = kw, [], False

    def log(self, data, step):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec (start-up validation) sees it as installed
    mod.runs = []

    def init(**kw):
        mod.runs.append(FakeRun(**kw))
        return mod.runs[-1]

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


def test_train_logs_the_metrics_jsonl_rows_to_wandb(fake_wandb, tiny_model, arith_data, tmp_path):
    run = tmp_path / "run"
    assert main(_args(tiny_model, arith_data, run, "--num-rollout", "2", "--use-wandb", "--wandb-project", "proj",
                      "--wandb-group", "grp", "--wandb-run-name", "name", "--wandb-mode", "offline")) == 0
    (wb,) = fake_wandb.runs
    assert {k: wb.init[k] for k in ("project", "group", "name", "mode", "dir")} == {
        "project": "proj", "group": "grp", "name": "name", "mode": "offline", "dir": str(run)}
    assert wb.init["config"]["rollout"]["rollout_batch_size"] == 2 and wb.init["config"]["log"]["use_wandb"] is True
    assert wb.logged == [(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in _rows(run)]
    assert [s for s, _ in wb.logged] == [1, 2] and "reward/mean" in wb.logged[0][1] and "loss" in wb.logged[0][1]
    assert wb.finished


def test_only_the_enabled_rank_starts_wandb(fake_wandb, tmp_path):
    cfg = Config()
    cfg.log.run_dir, cfg.log.use_wandb, cfg.log.quiet = str(tmp_path), True, True
    other = logger_from_config(cfg, total_steps=1, enabled=False, title="t")  # rank > 0
    other.log(1, {"x": 1.0})
    other.close()
    assert fake_wandb.runs == []
    main_rank = logger_from_config(cfg, total_steps=1, enabled=True, title="t")
    main_rank.log(1, {"x": 1.0})
    main_rank.close()
    assert [r.logged for r in fake_wandb.runs] == [[(1, {"x": 1.0})]]


def test_missing_wandb_is_a_clear_error_with_the_install_hint(monkeypatch, tiny_model, arith_data, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, find_spec says absent
    assert main(_args(tiny_model, arith_data, tmp_path / "run", "--use-wandb")) == 2
    assert "pip install 'polyrl[wandb]'" in capsys.readouterr().err
    with pytest.raises(ImportError, match=r"pip install 'polyrl\[wandb\]'"):
        start_wandb(str(tmp_path), project="p")


def test_wandb_flags_without_use_wandb_or_outside_training(tiny_model, arith_data, tmp_path, capsys):
    assert main(_args(tiny_model, arith_data, tmp_path / "run", "--wandb-project", "x")) == 2
    assert "add --use-wandb" in capsys.readouterr().err
    assert main(["eval", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["eval"], "--rm-type", "arithmetic",
                 "--use-wandb", "--wandb-mode", "disabled"]) == 2
    assert "polyrl eval writes its results to RUN_DIR: drop --use-wandb" in capsys.readouterr().err


def test_offline_run_writes_its_directory_under_the_run_dir(tiny_model, arith_data, tmp_path, monkeypatch):
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed (pip install 'polyrl[wandb]'); the fake-module tests above cover the logging path")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):  # nothing outside tmp_path
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run = tmp_path / "run"
    assert main(_args(tiny_model, arith_data, run, "--num-rollout", "2", "--use-wandb", "--wandb-mode", "offline")) == 0
    (offline,) = list((run / "wandb").glob("offline-run-*"))
    (log,) = list(offline.glob("run-*.wandb"))
    data = log.read_bytes()  # the run's records: every metrics key and the values as JSON text
    for key in _rows(run)[-1]:
        if key != "step":
            assert key.encode() in data, key
    assert json.dumps(_rows(run)[-1]["reward/mean"]).encode() in data

