"""A length-controlled workload (--rollout-length-distribution): every sample draws the length at which its response
ends from a named distribution, and the engine forces EOS there. Random-weight models never emit EOS, so without this
every response runs to --rollout-max-response-len and a rollout ends when all of its samples end together; reasoning
RL does not look like that (DAPO / Qwen runs: median about 1k tokens, a few percent at an 8k-32k cap).

Forms (one flag value):
  lognormal:median=1024,p99=8192,cap=8192   lengths whose median and 99th percentile are these (before the cap),
                                            clipped to [1, cap] (cap: p99 when absent)
  histogram:PATH                            an empirical distribution: a text file of "LENGTH [COUNT]" lines
                                            (COUNT 1 when absent; '#' starts a comment)

The draw is a function of the sample's sampling seed alone, so a sample keeps its length whichever engine, batch or
step (a resumed partial response) generates it. The forced EOS is not the policy's choice: it gets rollout log-prob 0
(the forcing leaves it alone in the distribution) and loss mask 0, and every token before it is the uncut
generation's (the engines change nothing but that token)."""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import random
from dataclasses import dataclass
from statistics import NormalDist

from polyrl.rollout.sampling import mix_seed, sample_seed

Z99 = 2.3263478740408408  # the standard normal's 99th percentile
LENGTH_SALT = 0x5EED1E46  # the length's stream is not the sampler's: mix_seed(sample seed, this)
FORCED_LOGPROB = 0.0  # the rollout log-prob reported for a forced EOS


class LengthSpecError(ValueError):
    """A --rollout-length-distribution value that does not parse."""


@dataclass(frozen=True)
class LengthDistribution:
    """Inverse CDF over a sorted support: values[k] with cumulative probability cdf[k] (lognormal: computed)."""

    spec: str
    median: float
    p99: float
    cap: int
    sigma: float = 0.0  # lognormal: log-space std
    values: tuple[int, ...] = ()  # histogram: sorted lengths
    cdf: tuple[float, ...] = ()  # histogram: cumulative probabilities

    def quantile(self, u: float) -> int:
        """The length at probability u in (0, 1)."""
        if self.values:
            return self.values[min(bisect.bisect_left(self.cdf, u), len(self.values) - 1)]
        z = NormalDist().inv_cdf(u)
        return int(min(self.cap, max(1, round(self.median * math.exp(self.sigma * z)))))

    def draw(self, sample_seed: int) -> int:
        """The stop length of the sample whose sampling seed is `sample_seed`."""
        u = (mix_seed(sample_seed, LENGTH_SALT) + 0.5) / 2**63
        return self.quantile(u)

    def describe(self) -> str:
        return f"median {self.median:g}, p99 {self.p99:g}, cap {self.cap} tokens ({self.spec})"


def parse_length_distribution(spec: str) -> LengthDistribution:
    kind, _, rest = spec.partition(":")
    if kind == "lognormal":
        kv = {}
        for part in filter(None, rest.split(",")):
            k, eq, v = part.partition("=")
            if not eq or k not in ("median", "p99", "cap"):
                raise LengthSpecError(f"--rollout-length-distribution {spec!r}: {part!r} is not median=, p99= or cap=")
            try:
                kv[k] = float(v)
            except ValueError:
                raise LengthSpecError(f"--rollout-length-distribution {spec!r}: {k}={v!r} is not a number") from None
        if "median" not in kv or "p99" not in kv:
            raise LengthSpecError(f"--rollout-length-distribution {spec!r}: give median= and p99= (and cap=), e.g. "
                                  "lognormal:median=1024,p99=8192,cap=8192")
        med, p99 = kv["median"], kv["p99"]
        cap = int(kv.get("cap", p99))
        if not (1 <= med <= p99 and med <= cap) or cap != kv.get("cap", cap):
            raise LengthSpecError(f"--rollout-length-distribution {spec!r}: need 1 <= median <= p99 and median <= cap "
                                  "(cap an integer; p99 is the uncapped distribution's, the cap clips the tail)")
        return LengthDistribution(spec, med, p99, cap, sigma=math.log(p99 / med) / Z99)
    if kind == "histogram":
        return _histogram(spec, rest)
    raise LengthSpecError(f"--rollout-length-distribution {spec!r}: expected lognormal:median=M,p99=P,cap=C or "
                          "histogram:PATH")


def _histogram(spec: str, path: str) -> LengthDistribution:
    if not os.path.isfile(path):
        raise LengthSpecError(f"--rollout-length-distribution {spec!r}: no file {path!r}")
    counts: dict[int, float] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            try:
                length, count = int(fields[0]), float(fields[1]) if len(fields) > 1 else 1.0
            except ValueError:
                raise LengthSpecError(f"{path}:{n}: expected 'LENGTH [COUNT]', got {line.strip()!r}") from None
            if length < 1 or count < 0 or len(fields) > 2:
                raise LengthSpecError(f"{path}:{n}: expected 'LENGTH [COUNT]' with LENGTH >= 1, COUNT >= 0")
            counts[length] = counts.get(length, 0.0) + count
    total = sum(counts.values())
    if total <= 0:
        raise LengthSpecError(f"--rollout-length-distribution {spec!r}: {path} holds no lengths")
    values = sorted(counts)
    acc, cdf = 0.0, []
    for v in values:
        acc += counts[v] / total
        cdf.append(acc)
    d = LengthDistribution(spec, 0, 0, values[-1], values=tuple(values), cdf=tuple(cdf))
    return LengthDistribution(spec, d.quantile(0.5), d.quantile(0.99), values[-1], values=d.values, cdf=d.cdf)


def mark_forced(sample, stop_length: int) -> None:
    """A response that ended at its stop length ends in a forced EOS: out of the loss (not the policy's choice)."""
    if stop_length and sample.finish_reason == "stop" and len(sample.response_ids) == stop_length:
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * stop_length
        sample.loss_mask = mask[:-1] + [0]


def with_stop_lengths(params, dist: LengthDistribution, n_prompts: int):
    """params with every sample's stop length drawn from its sampling seed (polyrl.rollout.sampling.sample_seed)."""
    base = params.seed if params.seed is not None else random.getrandbits(62)
    return dataclasses.replace(params, seed=base, stop_lengths=[dist.draw(sample_seed(params, base, i, j))
                                                                for i in range(n_prompts) for j in range(params.n)])
