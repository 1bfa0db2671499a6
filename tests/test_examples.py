"""Every recipe in examples/ loads and validates as `polyrl train --config` (on CPU, with the tiny model and data in
place of the recipe's checkpoint and data paths, and WORLD_SIZE set to the GPUs its header names): a recipe cannot
drift from the flags. Megatron recipes are validated, not run (megatron-core needs a GPU)."""

from __future__ import annotations

import glob
import os
import re

import pytest

from polyrl.capabilities import refuse_unhonoured
from polyrl.cli import build_parser
from polyrl.config import config_from_args, validate
from polyrl.placement import plan

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
CONFIGS = sorted(glob.glob(os.path.join(EXAMPLES, "*", "config.yaml")))


def test_every_recipe_has_a_readme_with_its_command():
    assert len(CONFIGS) >= 5
    for path in CONFIGS:
        name = os.path.basename(os.path.dirname(path))
        readme = open(os.path.join(os.path.dirname(path), "README.md")).read()
        assert f"examples/{name}/config.yaml" in readme, name
        assert name in open(os.path.join(EXAMPLES, "README.md")).read(), name


def test_every_example_directory_is_listed_in_the_examples_readme():
    # a link per directory, so a recipe without a config.yaml (a script) is not missed
    listed = open(os.path.join(EXAMPLES, "README.md")).read()
    dirs = sorted(d for d in os.listdir(EXAMPLES) if os.path.isdir(os.path.join(EXAMPLES, d)) and not d.startswith((".", "_")))
    assert len(dirs) >= len(CONFIGS)
    assert [d for d in dirs if f"[{d}]({d}/)" not in listed] == []
    for d in dirs:
        assert os.path.isfile(os.path.join(EXAMPLES, d, "README.md")), d


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_recipe_validates(path, tiny_model, arith_data, monkeypatch):
    monkeypatch.chdir(os.path.dirname(EXAMPLES))  # recipes name their custom functions from the repository root
    world = int(re.search(r"#\s*world_size:\s*(\d+)", open(path).read()).group(1))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args, extras = build_parser().parse_known_args(
        ["train", "--config", path, "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"]])
    assert not extras
    cfg = config_from_args(args)
    if cfg.data.eval_prompt_data:
        cfg.data.eval_prompt_data = arith_data["eval"]
    validate(cfg, "train")
    refuse_unhonoured(cfg, "train")  # no flag of a recipe is one its backend or engine would ignore
    if cfg.cluster.device != "cuda":  # a GPU recipe's layout needs its GPUs: placement is checked on CPU recipes only
        plan(cfg, visible_gpus=0, trainer_ranks=world)
    assert cfg.model.hf_checkpoint == tiny_model  # the flag overrides the file
    assert cfg.rollout.num_rollout > 1 and (cfg.reward.rm_type or cfg.reward.custom_rm_path)  # the file's settings arrived
