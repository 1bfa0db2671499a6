"""--use-wandb: the metrics.jsonl keys go to Weights & Biases too, from rank 0, under RUN_DIR/wandb.

The fake `wandb` module put in sys.modules checks what polyrl hands to wandb.init/log per rank; the last test runs
the real package (a test dependency) offline and reads back the run file it wrote.
"""

from __future__ import annotations

import importlib.machinery
import json
import math
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
    assert "polyrl eval: error: unrecognized argument '--use-wandb'" in capsys.readouterr().err  # eval logs no steps


def _wandb_records(path):
    """The protobuf records of a run-*.wandb file: a 7-byte header (":W&B", magic 0xBEE1, version) then LevelDB's log
    format (32 KiB blocks; each chunk has crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4; a block tail shorter
    than a chunk header is zero padding), each whole record a wandb_internal_pb2.Record."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert data[:6] == b":W&B\xe1\xbe", data[:7]
    pos, block, records, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            records.append(pb.Record.FromString(buf))
            buf = b""
    return records


def _nan_as_str(v):
    return "nan" if isinstance(v, float) and math.isnan(v) else v


def _key(item):
    return item.key or ".".join(item.nested_key)


def test_real_offline_run_logs_the_metrics_jsonl_rows_and_no_secret(tiny_model, arith_data, tmp_path, monkeypatch):
    import wandb  # a test dependency: the real package, offline, everything under tmp_path, no network
    home = tmp_path / "wandb_home"
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home))
    for var, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_CONSOLE", "off")):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    secret = "sk-polyrl-wandb-7c2e91"
    run = tmp_path / "run"
    try:  # launched engine servers, so the run's config really holds an api key for wandb to be given
        assert main(_args(tiny_model, arith_data, run, "--num-rollout", "2", "--rollout-engine", "server",
                          "--api-key", secret, "--use-wandb", "--wandb-project", "proj", "--wandb-run-name", "name",
                          "--wandb-mode", "offline")) == 0
    finally:
        wandb.teardown()  # stop wandb's service process now, not at interpreter exit
    (offline,) = list((run / "wandb").glob("offline-run-*"))  # --run-dir wins over WANDB_DIR
    (log,) = list(offline.glob("run-*.wandb"))
    records = _wandb_records(log)
    (run_rec,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run_rec.project, run_rec.display_name) == ("proj", "name")
    config = {u.key: json.loads(u.value_json) for u in run_rec.config.update}
    assert config["rollout"]["rollout_batch_size"] == 2 and config["log"]["use_wandb"] is True
    assert config["engines"]["api_key"] == "<redacted>" and config["rollout"]["rollout_engine"] == "server"
    history = [{_key(i): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    rows = _rows(run)
    assert [h["_step"] for h in history] == [r["step"] for r in rows] == [1, 2]
    for h, row in zip(history, rows):  # every metrics.jsonl value, as wandb stored it (JSON both ways: floats exact)
        assert {k: _nan_as_str(h[k]) for k in row if k != "step"} == {k: _nan_as_str(v) for k, v in row.items() if k != "step"}
        assert set(h) - set(row) <= {"_step", "_runtime", "_timestamp"}, set(h) - set(row)
    files = [p for p in (*run.rglob("*"), *home.rglob("*")) if p.is_file()]
    assert log in files
    for f in files:  # the key is in no file wandb (or the run) wrote: not the config, logs or metadata
        assert secret.encode() not in f.read_bytes(), f
