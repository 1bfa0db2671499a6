"""The branch's premise on CPU, BF16: a prepare()d 2-layer Qwen2 (Qwen3, Llama) whose decoder layers are compiled with Inductor's
emulate_precision_casts gives the same log-probs (bit for bit) from its inference graph, its training graph's forward
and eager; without the setting (--no-emulate) the two compiled graphs differ. Compiling on a 2-vCPU machine takes
4-7 minutes.

    PYTHONPATH=. python3 bench/probes/exact_compiled_cpu.py [--arch qwen3] [--no-emulate]
"""

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-emulate", action="store_true", help="compile without emulate_precision_casts")
    p.add_argument("--arch", default="qwen2", choices=("qwen2", "qwen3", "llama"))
    a = p.parse_args()
    import torch._inductor.config as inductor_config
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    from polyrl.backends.fsdp.parallelize import apply_compile
    from polyrl.backends.true_on_policy import prepare, register_attention, sequences_logprobs
    torch.manual_seed(0)
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[a.arch]
    cfg = cls(head_dim=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
    lm = prepare(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=register_attention()))
    seqs = [(torch.randint(0, 512, (n,)), p_) for n, p_ in ((40, 10), (70, 5), (33, 20), (150, 1))]
    with torch.no_grad():
        eager = sequences_logprobs(lm, seqs, temperature=1.0)[0]
    inductor_config.emulate_precision_casts = not a.no_emulate
    apply_compile(lm)
    t = time.perf_counter()
    with torch.no_grad():
        inference = sequences_logprobs(lm, seqs, temperature=1.0)[0]
    training = sequences_logprobs(lm, seqs, temperature=1.0)[0]
    training.sum().backward()
    with torch.no_grad():
        later = sequences_logprobs(lm, seqs[1:], temperature=1.0)[0]
    first = len(seqs[0][0]) - seqs[0][1]
    print(f"{a.arch}: compiled in {time.perf_counter() - t:.0f} s; emulate_precision_casts={not a.no_emulate}")
    print("| compared | max abs diff |\n|---|---|")
    print(f"| eager vs compiled inference | {(eager - inference).abs().max().item():.3g} |")
    print(f"| compiled inference vs compiled training forward | {(inference - training.detach()).abs().max().item():.3g} |")
    print(f"| compiled, a sequence in two packs | {(inference[first:] - later).abs().max().item():.3g} |")


if __name__ == "__main__":
    main()
