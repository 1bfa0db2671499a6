"""No flag silently ignored: every config field is honoured by every backend and engine kind, or refused at start-up
by the kinds that would ignore it, naming the flag and the kind."""

from __future__ import annotations

import dataclasses

import pytest

from polyrl.backends.base import BACKEND_CAPABILITIES, BACKENDS
from polyrl.capabilities import NEEDS, SELF_CHECKED_SECTIONS, UNIVERSAL_FIELDS, UNIVERSAL_SECTIONS, refuse_unhonoured
from polyrl.config import Config, ConfigError, _base_type, _flag
from polyrl.rollout.base import ENGINE_CAPABILITIES, ENGINES

ENGINE_SETUPS = {  # engine kind -> the config that chooses it
    "embedded": {},
    "server": {("rollout", "rollout_engine"): "server"},
    "sglang": {("rollout", "rollout_engine"): "sglang"},
    "external": {("engines", "rollout_external"): True, ("engines", "rollout_external_engine_addrs"): ["http://127.0.0.1:1"]},
    "none": {("debug", "debug_train_only"): True},
}


def fields():
    for sname in (f.name for f in dataclasses.fields(Config)):
        for f in dataclasses.fields(getattr(Config(), sname)):
            yield sname, f


def other_value(f: dataclasses.Field):
    """A value of the field's type unlike its default: what a user who sets the flag gives."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"] if c != default)
    tp, is_list = _base_type(f.type)
    if is_list:
        return ["x=1"]
    if tp is bool:
        return True if default is not True else False
    if tp is int:
        return (default or 1) + 1
    if tp is float:
        return (default or 0.5) / 2
    return "x"


def configured(backend: str, engine: str, section: str | None = None, name: str | None = None, value=None) -> Config:
    c = Config()
    c.cluster.train_backend = backend
    for (s, k), v in ENGINE_SETUPS[engine].items():
        setattr(getattr(c, s), k, v)
    if section is not None:
        setattr(getattr(c, section), name, value)
    return c


def test_every_field_is_honoured_by_all_or_has_a_capability():
    unclassified = [f"{s}.{f.name}" for s, f in fields()
                    if s not in UNIVERSAL_SECTIONS + SELF_CHECKED_SECTIONS and f.name not in UNIVERSAL_FIELDS.get(s, ())
                    and f.name not in NEEDS]
    assert not unclassified, f"fields neither honoured by every kind nor mapped to a capability: {unclassified}"
    both = [f"{s}.{f.name}" for s, f in fields() if f.name in NEEDS and f.name in UNIVERSAL_FIELDS.get(s, ())]
    assert not both
    caps = set().union(*BACKEND_CAPABILITIES.values(), *ENGINE_CAPABILITIES.values())
    assert {n.capability for n in NEEDS.values()} <= caps  # no capability that nothing can declare
    assert set(BACKEND_CAPABILITIES) == set(BACKENDS) and set(ENGINE_CAPABILITIES) - {"none"} == set(ENGINES)


@pytest.mark.parametrize("backend", sorted(BACKEND_CAPABILITIES))
@pytest.mark.parametrize("engine", sorted(ENGINE_SETUPS))
def test_each_capability_flag_is_refused_exactly_where_the_kind_lacks_it(backend, engine):
    """For every (backend, engine kind) pair and every flag that needs a capability: set the flag alone and check that
    the start-up check refuses it, naming the flag, iff the chosen kind does not declare the capability."""
    base = configured(backend, engine)
    refuse_unhonoured(base, "train")  # the defaults ask for nothing
    for section, f in fields():
        need = NEEDS.get(f.name)
        if need is None or section in SELF_CHECKED_SECTIONS:
            continue
        c = configured(backend, engine, section, f.name, other_value(f))
        flag = _flag(f)
        if f.default is True:  # an on-by-default switch is asked for by its --no- form, and named so
            flag = "--no-" + flag[2:]
        if f.name == "sglang_router_policy":  # configures the router: only with --use-sglang-router, refused first
            c.engines.use_sglang_router, flag = True, "--use-sglang-router"
        caps = BACKEND_CAPABILITIES[backend] if need.who == "backend" else ENGINE_CAPABILITIES[engine]
        if need.capability in caps:
            refuse_unhonoured(c, "train")
        else:
            with pytest.raises(ConfigError, match=f"^{flag} is not honoured by "):
                refuse_unhonoured(c, "train")


def test_known_refusals_name_flag_and_kind():
    c = configured("megatron", "embedded", "model", "fsdp_cpu_offload", True)
    with pytest.raises(ConfigError, match="--fsdp-cpu-offload is not honoured by --train-backend megatron .*"
                                          "--optimizer-cpu-offload"):
        refuse_unhonoured(c)
    c = configured("fsdp", "embedded", "engines", "use_fault_tolerance", True)
    with pytest.raises(ConfigError, match="--use-fault-tolerance is not honoured by --rollout-engine embedded"):
        refuse_unhonoured(c)
    c = configured("fsdp", "sglang", "rollout", "rollout_cuda_graph", False)
    with pytest.raises(ConfigError, match="--no-rollout-cuda-graph is not honoured by --rollout-engine sglang"):
        refuse_unhonoured(c)
    c = configured("fsdp", "server", "engines", "sglang_router_policy", "random")
    with pytest.raises(ConfigError, match="--sglang-router-policy random configures the sglang-router: add --use-sglang-router"):
        refuse_unhonoured(c)
    c = configured("fsdp", "embedded", "megatron", "tensor_model_parallel_size", 2)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size is not honoured by --train-backend fsdp"):
        refuse_unhonoured(c)
    refuse_unhonoured(configured("megatron", "embedded", "model", "compile", False))  # --no-compile asks for nothing
    refuse_unhonoured(configured("fsdp", "embedded", "engines", "use_fault_tolerance", True), "sft")  # no engine in sft


def test_the_cli_refuses_an_ignored_flag_at_start_up(tiny_model, arith_data, monkeypatch, capsys):
    from polyrl.cli import main
    monkeypatch.setattr("polyrl.assemble.setup_command", lambda cfg: pytest.fail("validation must stop the run before set-up"))
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--check-weight-update-equal", "--device", "cpu"]) == 2
    assert "--check-weight-update-equal is not honoured by --rollout-engine embedded" in capsys.readouterr().err


def test_nccl_on_a_cpu_run_is_a_flag_error(tiny_model, arith_data, capsys):
    from polyrl.cli import main
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--device", "cpu", "--dist-backend", "nccl"]) == 2
    assert "--dist-backend nccl needs CUDA devices" in capsys.readouterr().err
