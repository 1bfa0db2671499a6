"""Saved rollouts for the debug modes: `--save-debug-rollout-data`, `--load-debug-rollout-data` (`--debug-train-only`).

One file per step and rank, JSON lines, no torch. The path template's ``{rollout_id}`` is the 0-based
step (slime's name); with several ranks each writes its own share, ``{rank}`` in the template or
``.rank{rank}`` appended to it. Line 1 is the header, every later line one scored sample::

    {"format": "polyrl-rollout", "version": 1, "rollout_id": 0, "rank": 0, "world": 1, "n_samples": 16,
     "rollout_batch_size": 4, "n_samples_per_prompt": 4,
     "model": {"name": "qwen-0.5b", "model_type": "qwen2", "architectures": [...], "vocab_size": ..., "hidden_size": ...,
               "num_hidden_layers": ...},
     "tokenizer": {"name": "qwen-0.5b", "vocab_size": 151665, "sha256": "<hash of the vocabulary and special ids>"}}
    {"prompt_ids": [...], "response_ids": [...], "rollout_logprobs": [...], "finish_reason": "stop", "group_index": 0,
     "prompt": "...", "response": "...", "label": ..., "metadata": {...}, "reward": 1.0, "loss_mask": null,
     "weight_version": 0}

Floats are written by json (shortest repr), so fp32 log-probs and rewards read back bit for bit. Reading
checks the format and version, that the tokenizer and the model's shape (the ``model`` keys but ``name``)
are this run's, and that the step sizes match; any difference is an error naming the file and what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from polyrl.data import DataError
from polyrl.rollout.base import InProcessEngine
from polyrl.types import Sample

FORMAT, VERSION = "polyrl-rollout", 1
MODEL_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers")


class RolloutDataError(DataError):
    """A saved rollout file that is missing, malformed, or from another model, tokenizer or step size."""


def model_identity(hf_checkpoint: str) -> dict:
    with open(os.path.join(hf_checkpoint, "config.json")) as f:
        config = json.load(f)
    return {"name": os.path.basename(os.path.normpath(hf_checkpoint)), **{k: config.get(k) for k in MODEL_KEYS}}


def tokenizer_identity(tokenizer) -> dict:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    digest = hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode()).hexdigest()
    return {"name": os.path.basename(os.path.normpath(str(tokenizer.name_or_path))), "vocab_size": len(tokenizer),
            "sha256": digest}


def _plain(value):
    """json's fallback for labels and metadata read from parquet (numpy scalars and arrays)."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


class RolloutFiles:
    """Writes and reads one step's samples of this rank at the path the template gives."""

    def __init__(self, template: str, *, tokenizer, hf_checkpoint: str, rollout_batch_size: int, n_samples_per_prompt: int,
                 rank: int = 0, world: int = 1):
        self.template, self.rank, self.world = template, rank, world
        self.identity = {"rollout_batch_size": rollout_batch_size, "n_samples_per_prompt": n_samples_per_prompt,
                         "model": model_identity(hf_checkpoint), "tokenizer": tokenizer_identity(tokenizer)}
        self.per_rank = rollout_batch_size * n_samples_per_prompt // world

    def path(self, rollout_id: int) -> str:
        path = self.template.format(rollout_id=rollout_id, rank=self.rank)
        return path + f".rank{self.rank}" if self.world > 1 and "{rank}" not in self.template else path

    def save(self, rollout_id: int, samples: list[Sample]) -> str:
        path = self.path(rollout_id)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        header = {"format": FORMAT, "version": VERSION, "rollout_id": rollout_id, "rank": self.rank, "world": self.world,
                  "n_samples": len(samples), **self.identity}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:  # written whole, then renamed: a crash never leaves half a file under the name
            f.write(json.dumps(header) + "\n")
            for s in samples:
                f.write(json.dumps(dataclasses.asdict(s), default=_plain) + "\n")
        os.replace(tmp, path)
        return path

    def load(self, rollout_id: int) -> list[Sample]:
        path = self.path(rollout_id)
        if not os.path.isfile(path):
            raise RolloutDataError(f"--load-debug-rollout-data: no file {path} for step {rollout_id + 1} (rollout_id "
                                   f"{rollout_id}); write it with --save-debug-rollout-data {self.template}")
        with open(path) as f:
            lines = [line for line in f if line.strip()]
        try:
            header = json.loads(lines[0]) if lines else None
            rows = [json.loads(line) for line in lines[1:]]
        except json.JSONDecodeError as e:
            raise RolloutDataError(f"{path}: not a polyrl rollout file (line {e.lineno}: {e.msg})") from None
        self._check(path, header, len(rows))
        for row in rows:  # MoE routes were written as nested lists ([tokens - 1, layers, k])
            if row.get("routed_experts") is not None:
                import torch
                row["routed_experts"] = torch.tensor(row["routed_experts"], dtype=torch.int16)
        try:
            return [Sample(**row) for row in rows]
        except TypeError as e:
            raise RolloutDataError(f"{path}: a sample does not fit polyrl's Sample ({e})") from None

    def _check(self, path: str, header, n_rows: int) -> None:
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise RolloutDataError(f"{path}: not a polyrl rollout file (its first line must be a header with "
                                   f"\"format\": \"{FORMAT}\")")
        if header.get("version") != VERSION:
            raise RolloutDataError(f"{path}: format version {header.get('version')!r}; this polyrl reads version {VERSION}")
        here = self.identity
        for what in ("tokenizer", "model"):
            theirs, ours = header.get(what) or {}, here[what]
            diff = [f"{k} {theirs.get(k)!r} in the file vs {ours[k]!r} here" for k in ours
                    if k != "name" and theirs.get(k) != ours[k]]
            if diff:
                raise RolloutDataError(f"{path}: written with another {what} ({theirs.get('name')!r}, this run has "
                                       f"{ours['name']!r} from --hf-checkpoint): {'; '.join(diff)}")
        for key, flag in (("n_samples_per_prompt", "--n-samples-per-prompt"), ("rollout_batch_size", "--rollout-batch-size")):
            if header.get(key) != here[key]:
                raise RolloutDataError(f"{path}: written with {flag} {header.get(key)}, this run has {here[key]}; "
                                       "use the settings of the run that saved it")
        if header.get("world") != self.world or n_rows != header.get("n_samples") or n_rows != self.per_rank:
            raise RolloutDataError(f"{path}: {n_rows} samples for {header.get('world')} ranks (header: "
                                   f"{header.get('n_samples')}); this run needs {self.per_rank} per rank on {self.world}")


def rollout_files(cfg, tokenizer, rank: int, world: int) -> RolloutFiles | None:
    """The saver or loader the debug flags ask for, else None."""
    template = cfg.debug.save_debug_rollout_data or cfg.debug.load_debug_rollout_data
    if not template:
        return None
    r = cfg.rollout
    return RolloutFiles(template, tokenizer=tokenizer, hf_checkpoint=cfg.model.hf_checkpoint,
                        rollout_batch_size=r.rollout_batch_size, n_samples_per_prompt=r.n_samples_per_prompt,
                        rank=rank, world=world)


class NoEngine(InProcessEngine):
    """--debug-train-only: the engine slot of a run that builds none (samples come from files)."""

    version = 0

    def generate(self, prompts, params):
        raise RuntimeError("--debug-train-only builds no rollout engine; samples come from --load-debug-rollout-data")

    def update_weights(self, weights, version: int) -> None:
        self.version = version

    def sleep(self) -> None:
        pass

    def wake(self, tags=None) -> None:
        pass
