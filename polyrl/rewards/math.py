"""Math rewards: ``\\boxed{}`` answers checked with math-verify, and gsm8k ``####`` answers."""

from __future__ import annotations

import re
import threading

from polyrl.types import Sample

_NUMBER_RE = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced; None if absent or cut off."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # the response ended inside the box (truncated): no final answer


def _require_label(sample: Sample) -> str:
    if sample.label is None:
        raise ValueError("sample has no label; set --label-key to the dataset column with the answer")
    return str(sample.label).strip()


def math_reward(sample: Sample) -> float:
    """1.0 if the last ``\\boxed{}`` answer equals the label according to math-verify, else 0.0."""
    from math_verify import parse, verify  # sympy-heavy import: only for runs that use it

    answer = extract_boxed(sample.response)
    if answer is None:
        return 0.0
    label = _require_label(sample)
    gold_text = label if ("\\boxed" in label or label.startswith("$")) else f"${label}$"
    # math-verify times out with signal.alarm, which only works in the main thread; elsewhere
    # (reward worker threads, Ray actors) it raises unless the timeout is off.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(gold_text, parsing_timeout=timeout)
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def _to_number(text: str) -> float | None:
    matches = _NUMBER_RE.findall(text)
    return float(matches[-1].replace(",", "").replace("$", "")) if matches else None


def extract_gsm8k_answer(text: str) -> float | None:
    """The number after the last ``####``; else the last number in the text; else None."""
    if "####" in text:
        after = _NUMBER_RE.findall(text.rsplit("####", 1)[1])
        if after:
            return float(after[0].replace(",", "").replace("$", ""))
    return _to_number(text)


def gsm8k_reward(sample: Sample) -> float:
    """1.0 if the response's final number equals the label's (a bare number or a full gsm8k
    solution ending in ``#### N``), else 0.0."""
    gold = extract_gsm8k_answer(_require_label(sample))
    if gold is None:
        raise ValueError(f"gsm8k label has no number: {str(sample.label)[-80:]!r}")
    pred = extract_gsm8k_answer(sample.response)
    return 1.0 if pred is not None and abs(pred - gold) <= 1e-6 * max(1.0, abs(gold)) else 0.0
