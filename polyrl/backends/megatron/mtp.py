"""MiMo's multi-token-prediction (MTP) layers on the Megatron backend: megatron-core's MultiTokenPredictionBlock
(`mtp.layers.{d}`: enorm, hnorm, eh_proj, mtp_model_layer, final_layernorm; the bridge maps MiMo's
`model.mtp_layers.{d}.*` onto them) on the chunk that ends the pipeline, and `--enable-mtp-training`'s loss.

The layers are always built and loaded, so checkpoints, weight sync and `--save-hf` keep the draft heads; without
--enable-mtp-training they are frozen (no gradient, no optimizer state) and never run.

The loss is the FSDP backend's (polyrl.backends.fsdp.mtp), computed from the block's layers by polyrl's log-prob head
rather than by GPTModel's own MTP path. GPTModel's path (config.mtp_num_layers on the model) takes a full-vocabulary
cross-entropy over all tokens, normalises it per micro-batch by its own token count and scales its gradient through
MTPLossAutoScaler by the schedule's 1/num_microbatches, and runs in every non-inference forward; polyrl's loss is a
mean over the response tokens with loss mask 1 of every rank (global counts per depth), in training forwards only.
So the block is built with its own config copy (mtp_num_layers set there, not on the model's config, which keeps
GPTModel from running it), and `mtp_logprobs` runs each layer's projection + decoder layer step itself:

- depth d at local token t reads the previous depth's output at t (depth 0: the decoder's output after its final
  norm) and the embedding of packed token t + d + 1 (`plan_inputs`: from the micro-batch's global packed ids, so
  context parallelism needs no exchange), and predicts token t + d + 2 with the shared output layer through the
  vocab-parallel log-prob head, at the positions whose next token is a response token ([D, R] in response order);
- the backend weighs it with `fsdp.mtp.mtp_token_weights` / `mtp_token_counts` / `mtp_loss` and adds
  --mtp-loss-scaling-factor times it to the micro-batch's loss;
- --mtp-detach-encoder: the decoder's hidden states, the embeddings and the output weight enter detached.

Depth d's attention uses the decoder's packed plan and RoPE tables (each token's own position), as the FSDP backend
passes the main model's position ids to every MTP layer. The wrap-around of `plan_inputs` at a sequence's end only
reaches positions whose prediction is never read, and causal attention keeps it from every earlier position.

Pipeline parallelism with --enable-mtp-training is refused (config.py): the MTP layers need the token embedding,
which lives on the first stage.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def plan_inputs(input_ids: list[Tensor], pb: Any, depths: int) -> tuple[Tensor, Tensor]:
    """input_ids: the micro-batch's samples as packed by thd.pack_thd into `pb` (pad id 0) -> (next_ids [D, T_local]:
    the packed token t + d + 1 beside each of this rank's tokens t, wrapping around the packed row; targets
    [D, R_local]: the packed token t + d + 2 at each of this rank's log-prob positions t, clamped at the row's end).
    Positions whose token lies past their sample are never counted (fsdp.mtp.mtp_token_weights)."""
    offs = [int(x) for x in pb.cu_seqlens.cpu()]
    total = offs[-1]
    ids_g = torch.zeros(total, dtype=torch.long)
    for s, off in zip(input_ids, offs):
        ids_g[off:off + s.numel()] = s.long()
    g = pb.token_index.cpu()  # global packed index of each local token
    shift = torch.arange(1, depths + 1)[:, None]
    next_ids = ids_g[(g[None] + shift) % total]
    at = g[pb.logp_index.cpu()]
    targets = ids_g[(at[None] + shift + 1).clamp(max=total - 1)]
    device = pb.input_ids.device
    return next_ids.to(device), targets.to(device)


@dataclass
class MTPInputs:
    """What the log-prob head needs to run the MTP layers on one micro-batch (model.HeadContext.mtp)."""

    model: Any  # the GPTModel chunk: its embedding and its `mtp` block
    next_ids: Tensor  # [D, T_local] (plan_inputs)
    targets: Tensor  # [D, R_local]
    detach: bool  # --mtp-detach-encoder


def check_trainable(hf_config: Any, path: str, *, pp: int, custom_provider: bool) -> int:
    """--enable-mtp-training on this model and layout: the number of MTP depths, or ValueError saying why not."""
    from polyrl import hf_families
    depths = hf_families.mtp_depths(hf_config)
    if not depths:
        raise ValueError(f"--enable-mtp-training: {path} has no multi-token-prediction layers")
    if pp > 1:
        raise ValueError("--enable-mtp-training with --pipeline-model-parallel-size > 1: the MTP layers sit on the last "
                         "stage and need the token embedding of the first; use pipeline size 1")
    if custom_provider:
        raise ValueError("--enable-mtp-training with --custom-model-provider-path: polyrl builds the MTP block on its "
                         "own GPTModel only")
    return depths


def build_block(config: Any, depths: int, inner_spec: Any, norm: type, vp_stage: int | None, pg_collection: Any):
    """megatron-core's MultiTokenPredictionBlock of `depths` layers: polyrl's norms (enorm, hnorm, final_layernorm),
    a column-parallel eh_proj, and `inner_spec` (the decoder's own layer spec) as each depth's decoder layer."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock, MultiTokenPredictionBlockSubmodules, MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec

    cfg = copy.copy(config)  # the block's own: on the model's config, GPTModel would run its MTP loss path
    cfg.mtp_num_layers = depths
    layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, layer_norm=norm, eh_proj=LocalSpecProvider().column_parallel_linear(),
        mtp_model_layer=inner_spec))
    return MultiTokenPredictionBlock(cfg, MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * depths),
                                     vp_stage=vp_stage, pg_collection=pg_collection)


def set_trainable(chunks: list, trainable: bool) -> None:
    """Freeze the MTP layers unless --enable-mtp-training trains them (before DDP wrapping: it buffers trainable
    parameters only, and the optimizer keeps no state for the frozen ones)."""
    for c in chunks:
        block = getattr(c, "mtp", None)
        if block is not None:
            block.requires_grad_(trainable)


def mtp_logprobs(hidden_states: Tensor, weight: Tensor, context: Any, config: Any, packed_seq_params: Any,
                 response_logprobs) -> Tensor:
    """hidden_states [T_local(/TP under SP), 1, H]: the decoder's output; weight: the output layer's (this TP rank's
    vocab rows) -> [D, R] depth d's log-prob of token t + d + 2 at each response position t (every TP / CP rank).
    response_logprobs: model.response_logprobs (the main head's gather, vocab-parallel log-probs and CP assembly)."""
    inp: MTPInputs = context.mtp
    m = inp.model
    h = hidden_states.detach() if inp.detach else hidden_states
    w = weight.detach() if inp.detach else weight
    pos = context.pb.position_ids[None]
    out = []
    for d, layer in enumerate(m.mtp.layers):
        with torch.no_grad() if inp.detach else contextlib.nullcontext():
            emb = m.embedding(input_ids=inp.next_ids[d][None], position_ids=pos)
        # megatron's own step after MultiTokenPredictionLayer.forward's roll: norms, eh_proj, decoder layer, final norm
        h = layer._proj_and_transformer_layer(hidden_states=h, decoder_input=emb, packed_seq_params=packed_seq_params)
        logp, _ = response_logprobs(h, w, inp.targets[d], context, config, temperature=1.0, with_entropy=False)
        out.append(logp)
    return torch.stack(out)
