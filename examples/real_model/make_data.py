"""Writes the real-model recipe's data: every sum of two digits (0-9 + 0-9) in four phrasings, 400 prompts shuffled
with a fixed seed into 320 training and 80 held-out rows, {"prompt": ..., "label": "<sum>"} per line.

    python examples/real_model/make_data.py [OUT_DIR]   # default: runs/real_model/data
"""

from __future__ import annotations

import json
import os
import random
import sys

PHRASINGS = ("What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} plus {b}.", "What is the sum of {a} and {b}?")


def rows() -> list[dict]:
    out = [{"prompt": p.format(a=a, b=b), "label": str(a + b)} for p in PHRASINGS for a in range(10) for b in range(10)]
    random.Random(0).shuffle(out)
    return out


def write(out_dir: str, n_train: int = 320) -> dict[str, str]:
    """Writes train.jsonl and eval.jsonl into out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    data = rows()
    paths = {"train": os.path.join(out_dir, "train.jsonl"), "eval": os.path.join(out_dir, "eval.jsonl")}
    for name, part in (("train", data[:n_train]), ("eval", data[n_train:])):
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    return paths


if __name__ == "__main__":
    print(write(sys.argv[1] if len(sys.argv) > 1 else "runs/real_model/data"))
