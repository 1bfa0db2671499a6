"""--enable-mtp-training on the FSDP backend: the checkpoint's multi-token-prediction layers (MiMo's
`model.mtp_layers.{d}`) learn to predict the token d + 2 ahead beside the policy loss, so they stay usable as a draft
model after RL (docs/models.md).

Depth d (0-based) at position t reads the previous depth's hidden state at t (depth 0: the main model's last hidden
state, after its final norm, as the serving engines feed MiMo's MTP layer) and the embedding of token t + d + 1, runs
its decoder layer causally over the sequence, and predicts token t + d + 2 with the shared output layer. Its loss is
the mean cross-entropy over the response tokens that have a token d + 2 ahead in the same sample with loss mask 1;
the backend adds `--mtp-loss-scaling-factor` times the mean over depths (megatron-core weighs its MTP loss the same
way). With --mtp-detach-encoder (the default, verl's recommendation) the main model's hidden states, embeddings and
output layer enter the MTP loss detached: only the MTP layers learn from it and the policy update is unchanged.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from polyrl.backends.logprobs import chunked_logprobs


def mtp_layers(lm: nn.Module) -> nn.ModuleList | None:
    base = getattr(lm, lm.base_model_prefix)
    layers = getattr(base, "mtp_layers", None)
    return layers if layers is not None and len(layers) else None


def mtp_logprobs(lm: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, gather_idx: torch.Tensor, attn_kwargs: dict, *,
                 detach: bool, chunk_size: int) -> torch.Tensor:
    """hidden [B, L, H]: the main model's last hidden states of the laid-out micro-batch (input_ids [B, L]) ->
    [D, R]: at each gathered position t (the ones predicting a response token), depth d's log-prob of token
    t + d + 2 (meaningless where that token lies past the sample: mtp_loss masks those)."""
    from transformers.masking_utils import create_causal_mask

    base = getattr(lm, lm.base_model_prefix)
    layers = mtp_layers(lm)
    head = lm.get_output_embeddings().weight
    if detach:
        hidden, head = hidden.detach(), head.detach()
    mask = attention_mask
    if mask is not None and mask.dim() == 2:  # padded rows: the causal + padding mask the decoder built for itself
        # (transformers 5.x releases name the embeddings and the cache differently: pass what this one takes)
        params = inspect.signature(create_causal_mask).parameters
        kw = {"config": base.config, "attention_mask": mask, "position_ids": position_ids,
              ("inputs_embeds" if "inputs_embeds" in params else "input_embeds"): hidden}
        kw.update({k: None for k in ("cache", "past_key_values") if k in params})
        if "cache_position" in params:
            kw["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
        mask = create_causal_mask(**kw)
    pos_emb = base.rotary_emb(hidden, position_ids)
    flat_ids = input_ids.reshape(-1)
    last = flat_ids.numel() - 1
    ids, h, out = input_ids, hidden, []
    for d, layer in enumerate(layers):
        # token t + d + 1 beside position t; the wrap-around at a row's (or a pack's) end only reaches positions
        # whose prediction is never read, and causal attention keeps it from every earlier position
        ids = torch.roll(ids, -1, dims=-1)
        emb = base.embed_tokens(ids)
        h = layer(emb.detach() if detach else emb, h, pos_emb, mask, **attn_kwargs)
        x = h.reshape(-1, h.shape[-1]).index_select(0, gather_idx)
        targets = flat_ids[(gather_idx + d + 2).clamp(max=last)]
        logp, _ = chunked_logprobs(x, head, targets, temperature=1.0, chunk_size=chunk_size)
        out.append(logp)
    return torch.stack(out)


def mtp_token_weights(seq_ids: torch.Tensor, loss_mask: torch.Tensor, depths: int) -> torch.Tensor:
    """[D, R] 1 where depth d's prediction at response position j counts: token j + d + 1 of the gathered order is in
    the same sample and has loss mask 1."""
    R = seq_ids.numel()
    w = torch.zeros(depths, R, dtype=torch.float32, device=seq_ids.device)
    for d in range(depths):
        s = d + 1
        if s < R:
            w[d, :R - s] = ((seq_ids[s:] == seq_ids[:R - s]) & (loss_mask[s:] > 0)).float()
    return w


def mtp_token_counts(response_lens: list[int], loss_masks: list[torch.Tensor], depths: int) -> list[float]:
    """Per depth, how many tokens of these samples depth d's loss averages over (the global denominators)."""
    return [float(sum(float(m[d + 1:].sum()) for n, m in zip(response_lens, loss_masks) if n > d + 1))
            for d in range(depths)]


def mtp_loss(mtp_logp: torch.Tensor, weights: torch.Tensor, counts: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss term before --mtp-loss-scaling-factor: the mean over depths of each depth's token-mean
    cross-entropy, this micro-batch's share of it; and that share per depth [D], for the metrics)."""
    denom = torch.tensor([max(c, 1.0) for c in counts], dtype=torch.float32, device=mtp_logp.device)
    per_depth = -(mtp_logp.float() * weights).sum(-1) / denom
    return per_depth.mean(), per_depth.detach()
