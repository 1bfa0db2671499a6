"""The placement plan: one pure function from (config, visible devices) to the layout, for every layout polyrl runs."""

from __future__ import annotations

import pytest

from polyrl.config import Config, ConfigError
from polyrl.placement import engine_gpus, plan


def cfg(**sections) -> Config:
    c = Config()
    for name, fields in sections.items():
        for k, v in fields.items():
            setattr(getattr(c, name), k, v)
    return c


def test_engine_gpus_disaggregates_when_there_is_room_and_shares_otherwise():
    assert engine_gpus(1, 1, trainer_gpus=1, visible=2) == ([[1]], False)
    assert engine_gpus(2, 2, trainer_gpus=4, visible=8) == ([[4, 5], [6, 7]], False)
    assert engine_gpus(2, 1, trainer_gpus=1, visible=1) == ([[0], [0]], True)
    assert engine_gpus(4, 1, trainer_gpus=2, visible=3) == ([[0], [1], [0], [1]], True)


SERVER = {"rollout_engine": "server"}
SGLANG = {"rollout_engine": "sglang"}
EXTERNAL = {"rollout_external": True, "rollout_external_engine_addrs": ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]}

# (config sections, visible GPUs, local train ranks) -> (device, trainer devices, engine, engine devices, shared, transport)
LAYOUTS = [
    pytest.param({}, 0, 1, ("cpu", (), "embedded", (), False, "tensor"), id="cpu-embedded"),
    pytest.param({"cluster": {"device": "cpu"}}, 8, 1, ("cpu", (), "embedded", (), False, "tensor"), id="cpu-forced-on-gpu-node"),
    pytest.param({}, 1, 1, ("cuda", (0,), "embedded", ((0,),), True, "tensor"), id="1gpu-embedded-shared"),
    pytest.param({}, 4, 4, ("cuda", (0, 1, 2, 3), "embedded", ((0,), (1,), (2,), (3,)), True, "tensor"), id="4gpu-torchrun-embedded"),
    pytest.param({"rollout": SERVER}, 0, 1, ("cpu", (), "server", ((),), False, "distributed"), id="cpu-server"),
    pytest.param({"rollout": SERVER}, 1, 1, ("cuda", (0,), "server", ((0,),), True, "distributed"), id="1gpu-server-shared"),
    pytest.param({"rollout": SERVER}, 2, 1, ("cuda", (0,), "server", ((1,),), False, "distributed"), id="2gpu-server-own"),
    pytest.param({"rollout": SERVER, "engines": {"rollout_num_engines": 3}}, 4, 1,
                 ("cuda", (0,), "server", ((1,), (2,), (3,)), False, "distributed"), id="4gpu-3-servers-own"),
    pytest.param({"rollout": SERVER, "engines": {"rollout_num_engines": 2, "weight_sync": "disk"}}, 2, 2,
                 ("cuda", (0, 1), "server", ((0,), (1,)), True, "disk"), id="2gpu-torchrun-servers-shared-disk"),
    pytest.param({"rollout": SGLANG, "engines": {"rollout_num_gpus": 4, "rollout_num_gpus_per_engine": 2}}, 6, 2,
                 ("cuda", (0, 1), "sglang", ((2, 3), (4, 5)), False, "distributed"), id="sglang-tp2-own"),
    pytest.param({"engines": EXTERNAL}, 1, 1, ("cuda", (0,), "external", ((), ()), False, "distributed"), id="external"),
    pytest.param({"debug": {"debug_train_only": True, "load_debug_rollout_data": "r{rollout_id}"}}, 1, 1,
                 ("cuda", (0,), "none", (), False, "none"), id="train-only-no-engine"),
    pytest.param({"ray": {"use_ray": True, "colocate": True, "actor_num_gpus_per_node": 2}}, 0, 1,
                 ("cpu", (), "embedded", (), False, "tensor"), id="ray-colocate-cpu"),
    pytest.param({"ray": {"use_ray": True, "colocate": True, "actor_num_gpus_per_node": 2}, "cluster": {"device": "cuda"}}, 0, 1,
                 ("cuda", (0, 1), "embedded", ((0,), (1,)), True, "tensor"), id="ray-colocate-gpu-driver-without-gpus"),
    pytest.param({"ray": {"use_ray": True}, "rollout": SERVER, "engines": {"rollout_num_engines": 2}}, 0, 1,
                 ("cpu", (), "server", ((), ()), False, "distributed"), id="ray-engine-actors"),
    pytest.param({"ray": {"use_ray": True, "colocate": True}, "rollout": SERVER, "cluster": {"device": "cuda"}}, 0, 1,
                 ("cuda", (0,), "server", ((0,),), True, "distributed"), id="ray-colocate-server-actor-per-gpu"),
    # what a colocated train actor sees: its engine actor's server as an external engine on its own GPU
    pytest.param({"engines": {**EXTERNAL, "rollout_external_colocated": True}}, 1, 1,
                 ("cuda", (0,), "external", ((), ()), True, "distributed"), id="external-colocated"),
]


@pytest.mark.parametrize("sections, visible, ranks, want", LAYOUTS)
def test_layouts(sections, visible, ranks, want):
    p = plan(cfg(**sections), visible, ranks)
    assert (p.device, p.trainer_devices, p.engine, p.engine_devices, p.shared, p.transport) == want
    assert p.summary()  # the banner's line


IMPOSSIBLE = [
    pytest.param({"cluster": {"device": "cuda"}}, 0, 1, "--device cuda was asked for but no CUDA device", id="cuda-without-gpu"),
    pytest.param({}, 1, 2, "2 train ranks need 2 GPUs but 1 are visible", id="more-ranks-than-gpus"),
    pytest.param({"rollout": SERVER, "engines": {"rollout_num_gpus_per_engine": 2}}, 8, 1,
                 "--rollout-num-gpus-per-engine 2 with --rollout-engine server", id="multi-gpu-polyrl-serve"),
    pytest.param({"engines": {"rollout_num_gpus_per_engine": 2}}, 8, 1,
                 "--rollout-num-gpus-per-engine 2 with --rollout-engine embedded", id="multi-gpu-embedded"),
    pytest.param({"rollout": SGLANG, "engines": {"rollout_num_gpus_per_engine": 4}}, 3, 2,
                 "--rollout-num-gpus-per-engine 4 needs 4 GPUs of the trainer's 2", id="tp-engine-does-not-fit"),
    pytest.param({"rollout": {**SERVER, "async_training": True}}, 1, 1, "--async needs the engines on GPUs of their own",
                 id="async-with-shared-servers"),
]


@pytest.mark.parametrize("sections, visible, ranks, message", IMPOSSIBLE)
def test_impossible_layouts_name_the_flags(sections, visible, ranks, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(cfg(**sections), visible, ranks)


def test_validation_refuses_an_impossible_layout_before_anything_is_built(tiny_model, arith_data, monkeypatch, capsys):
    from polyrl.cli import main
    monkeypatch.setattr("polyrl.assemble.setup_command", lambda cfg: pytest.fail("validation must stop the run before set-up"))
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--rollout-engine", "server", "--rollout-num-gpus-per-engine", "2", "--device", "cpu"]) == 2
    assert "--rollout-num-gpus-per-engine 2 with --rollout-engine server" in capsys.readouterr().err


def test_ray_colocated_servers_get_one_engine_actor_per_train_actor():
    from polyrl.orchestration.ray_job import plan as ray_plan
    c = cfg(ray={"use_ray": True, "colocate": True, "actor_num_gpus_per_node": 2, "actor_num_nodes": 2}, rollout=SERVER)
    assert ray_plan(c) == (4, 4, 0)  # 4 train actors, an engine actor in each one's bundle
    assert ray_plan(cfg(ray={"use_ray": True, "colocate": True, "actor_num_gpus_per_node": 2})) == (2, 0, 0)


@pytest.mark.parametrize("args, message", [
    (["--use-ray", "--colocate", "--rollout-engine", "sglang"], "--rollout-engine sglang servers on the train actors' GPUs"),
    (["--use-ray", "--colocate", "--rollout-engine", "server", "--rollout-num-engines", "2"],
     "puts one engine actor on each train actor's GPU"),
    (["--use-ray", "--colocate", "--rollout-engine", "server", "--async"], "take turns on each GPU"),
    (["--rollout-external-colocated"], "--rollout-external-colocated describes --rollout-external servers"),
    (["--rollout-external", "--rollout-external-engine-addrs", "http://127.0.0.1:1", "--rollout-external-colocated",
      "--async"], "cannot take turns on the trainer's GPUs"),
])
def test_colocated_server_flags_refuse_what_cannot_take_turns(tiny_model, arith_data, capsys, args, message):
    from polyrl.cli import main
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--device", "cpu", *args]) == 2
    assert message in capsys.readouterr().err
