"""MiMo's MTP layers on the Megatron backend, the parts that run without megatron-core: the MTP inputs of a packed
micro-batch (polyrl/backends/megatron/mtp.py plan_inputs) against the FSDP backend's definition, with and without
context parallelism, and the start-up checks of --enable-mtp-training on megatron. The MTP loss itself is proven
against the FSDP backend on GPU (test_megatron_mtp_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from polyrl import hf_families
from polyrl.backends.megatron import mtp, thd

DEPTHS = 3


def _samples():
    g = torch.Generator().manual_seed(0)
    lens, plens = [9, 6, 13, 4], [3, 4, 2, 2]
    return [torch.randint(1, 50, (n,), generator=g) for n in lens], plens


def _where(pb, index):
    """(sample, position in sample) of global packed indices."""
    offs = pb.cu_seqlens.tolist()
    seq = torch.bucketize(index, torch.tensor(offs[1:]), right=True)
    return seq, index - torch.tensor(offs)[seq]


def _expected(ids, plens):
    """The FSDP backend's MTP arithmetic (fsdp/mtp.py): response slot j of sample i sits at position t = p - 1 + j and
    depth d predicts token t + d + 2; {(d, sample, slot-in-sample): token} where that token is in the sample."""
    want = {}
    for i, (x, p) in enumerate(zip(ids, plens)):
        for j in range(x.numel() - p):
            for d in range(DEPTHS):
                t = p - 1 + j
                if t + d + 2 < x.numel():
                    want[d, i, j] = int(x[t + d + 2])
    return want


@pytest.mark.parametrize("cp", [1, 2])
def test_plan_inputs_match_the_fsdp_definition(cp):
    """Over all CP ranks, every in-sample target is token t + d + 2 of its sample (each exactly once), and every
    local token's depth-d input id is token t + d + 1 of its own sample where that lies in the sample."""
    ids, plens = _samples()
    want, got = _expected(ids, plens), {}
    starts = torch.tensor([0] + [x.numel() - p for x, p in zip(ids, plens)]).cumsum(0)
    for rank in range(cp):
        pb = thd.pack_thd(ids, plens, cp_size=cp, cp_rank=rank, sp_size=2)
        next_ids, targets = mtp.plan_inputs(ids, pb, DEPTHS)
        assert next_ids.shape == (DEPTHS, pb.input_ids.numel()) and targets.shape == (DEPTHS, pb.logp_index.numel())
        seq, pos = _where(pb, pb.token_index)
        for d in range(DEPTHS):
            for k in range(pb.input_ids.numel()):
                i, q = int(seq[k]), int(pos[k])
                if i < len(ids) and q + d + 1 < ids[i].numel():
                    assert int(next_ids[d, k]) == int(ids[i][q + d + 1]), (rank, d, k)
            for k, slot in enumerate(pb.logp_slot.tolist()):
                i = int(pb.seq_ids[slot])
                key = (d, i, slot - int(starts[i]))
                if key in want:
                    assert key not in got
                    got[key] = int(targets[d, k])
    assert got == want


def test_plan_inputs_keep_every_id_in_the_vocabulary():
    """Positions past a sample read the next sample's or padding ids (pad 0): never an out-of-range index."""
    ids, plens = _samples()
    pb = thd.pack_thd(ids, plens)
    next_ids, targets = mtp.plan_inputs(ids, pb, DEPTHS)
    assert int(next_ids.min()) >= 0 and int(targets.min()) >= 0
    assert int(next_ids.max()) < 50 and int(targets.max()) < 50


def _mimo(depths):
    return hf_families.MiMoConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_nextn_predict_layers=depths)


def test_check_trainable_names_what_cannot_train():
    assert mtp.check_trainable(_mimo(2), "m", pp=1, custom_provider=False) == 2
    with pytest.raises(ValueError, match="has no multi-token-prediction layers"):
        mtp.check_trainable(_mimo(0), "m", pp=1, custom_provider=False)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size > 1"):
        mtp.check_trainable(_mimo(1), "m", pp=2, custom_provider=False)
    with pytest.raises(ValueError, match="--custom-model-provider-path"):
        mtp.check_trainable(_mimo(1), "m", pp=1, custom_provider=True)


def test_megatron_honours_the_mtp_flags():
    from polyrl.capabilities import refuse_unhonoured
    from polyrl.config import Config

    cfg = Config()
    cfg.cluster.train_backend = "megatron"
    cfg.model.enable_mtp_training, cfg.model.mtp_loss_scaling_factor, cfg.model.mtp_detach_encoder = True, 0.5, False
    refuse_unhonoured(cfg)  # no ConfigError: megatron declares mtp_training


def test_megatron_refuses_mtp_training_without_mtp_layers(tiny_model, arith_data, capsys):
    """The checkpoint is read at start-up for either backend (exit 2, before megatron-core is needed)."""
    from polyrl.cli import main

    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type",
                 "arithmetic", "--train-backend", "megatron", "--enable-mtp-training"]) == 2
    assert "has no multi-token-prediction layers" in capsys.readouterr().err
