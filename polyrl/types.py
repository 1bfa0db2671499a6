"""Plain data carried between the rollout engine, the rewards, the algorithms and the backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)  # stop strings (checked on decoded text)
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the tokenizer's EOS
    n: int = 1  # samples per prompt
    seed: int | None = None
    # one seed per prompt (overrides `seed`): what an HTTP client sends as SGLang's `sampling_seed`, so a sample
    # depends on (prompt seed, sample index) only, never on which server or batch produced it
    prompt_seeds: list[int] | None = None
    return_routed_experts: bool = False  # MoE: fill Sample.routed_experts (SGLang's request field of that name)
    # one budget per prompt (overrides max_new_tokens for that prompt's samples): a resumed partial response continues
    # with what its budget has left, in the same call as fresh prompts
    prompt_max_new_tokens: list[int] | None = None
    # per sample (prompt i, sample j at i * n + j): the response ends with EOS once it holds this many tokens, the
    # tokens before unchanged (polyrl.rollout.lengths: a length-controlled workload); None or 0 for a sample: no cut
    stop_lengths: list[int] | None = None
    # per response token, the k most likely tokens and their log-probs under the distribution the token was drawn
    # from (Sample.top_logprobs; SGLang's top_logprobs_num, OpenAI's top_logprobs); 0: none
    top_logprobs: int = 0

    def max_new_tokens_of(self, i: int) -> int:
        """The budget of prompt i's samples."""
        return self.prompt_max_new_tokens[i] if self.prompt_max_new_tokens is not None else self.max_new_tokens

    def stop_length_of(self, i: int, j: int) -> int:
        """Sample j of prompt i: the response length at which EOS is forced (0: none)."""
        return (self.stop_lengths[i * self.n + j] or 0) if self.stop_lengths is not None else 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Sample:
    """One generated response to one prompt, and everything later stages attach to it."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # per response token, from the engine that sampled it
    finish_reason: str  # "stop" (EOS / stop id / stop string) or "length"
    group_index: int = 0  # which prompt of the step this sample answers
    prompt: str = ""
    response: str = ""
    label: Any = None
    metadata: dict = field(default_factory=dict)
    reward: float = 0.0
    loss_mask: list[int] | None = None  # per response token; None means all ones
    weight_version: int | None = None  # the policy version (trainer step) whose weights generated it
    # MoE: the engine's top-k experts of every forwarded token (--return-routed-experts), a small-int tensor
    # [prompt + response tokens - 1, num_hidden_layers, k] (SGLang's `routed_experts`; -1 in layers without experts)
    routed_experts: Any = None
    # image prompts: what the trainer recomputes log-probs with, {"pixel_values": [patches, D], "image_grid_thw":
    # [images, 3]} (polyrl.multimodal); the n samples of one prompt share the tensors
    multimodal: dict | None = None
    # the weight version of every response token (--partial-rollout: a resumed response spans several); None: every
    # token is weight_version's
    token_versions: list[int] | None = None
    # SamplingParams.top_logprobs > 0: per response token, (token id, log-prob) of the k most likely, most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class PromptRecord:
    """One row of a prompt dataset after parsing."""

    prompt: Any  # str, or a list of chat messages when the dataset stores conversations
    label: Any = None
    metadata: dict = field(default_factory=dict)
    source: str = ""  # "file:line", for error messages
    images: list[str] | None = None  # --multimodal-keys: absolute paths or data URLs, filling the image parts in order


@dataclass
class TrainBatch:
    """Variable-length samples for a train backend; no padding anywhere.

    input_ids[i]: [L_i] prompt + response tokens; prompt_lens[i]: P_i.
    token_fields[k][i]: [L_i - P_i] per-response-token values (loss_mask, advantages,
    old_logprobs, ref_logprobs, rollout_logprobs, ...).
    MoE routes, one [L_i - 1, num_hidden_layers, k] tensor per sample (None: not carried):
    rollout_routed_experts from the engine (R3), recorded_routed_experts from the actor's log-prob pass (R2).
    multimodal[i]: sample i's pixel inputs (Sample.multimodal) or None; None for a text-only batch.
    """

    input_ids: list  # list[torch.Tensor]
    prompt_lens: list[int]
    token_fields: dict = field(default_factory=dict)  # str -> list[torch.Tensor]
    rollout_routed_experts: list | None = None
    recorded_routed_experts: list | None = None
    multimodal: list | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def response_lens(self) -> list[int]:
        return [int(x.numel()) - p for x, p in zip(self.input_ids, self.prompt_lens)]

    def select(self, idx: list[int]) -> "TrainBatch":
        return TrainBatch(
            [self.input_ids[i] for i in idx],
            [self.prompt_lens[i] for i in idx],
            {k: [v[i] for i in idx] for k, v in self.token_fields.items()},
            *([r[i] for i in idx] if r is not None else None for r in (self.rollout_routed_experts,
                                                                        self.recorded_routed_experts,
                                                                        self.multimodal)),
        )
