"""The user's call, end to end, on tiny random models (no download): PACER output is identical to the
target's own greedy output, with the statistics PACER returns.

    python examples/quickstart.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_pacer import PacerConfig, PacerHead, enable_pacer


def tiny_llama(layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    target = enable_pacer(tiny_llama(layers=4, seed=0))  # the one line of setup
    draft = tiny_llama(layers=4, seed=0)
    with torch.no_grad():  # a draft that mostly, not always, agrees with the target
        for p in draft.parameters():
            p.add_(0.02 * p.std() * torch.randn_like(p))
    head = PacerHead(PacerConfig(draft_hidden_size=draft.config.hidden_size, block_size=3))  # untrained

    input_ids = torch.tensor([[1, 20, 30, 40, 50]])
    out = target.generate(input_ids, assistant_model=draft, pacer_head=head, max_new_tokens=64,
                          return_dict_in_generate=True)
    plain = target.generate(input_ids, max_new_tokens=64)

    stats = out.pacer_stats
    print("identical to the target's greedy output:", out.sequences.tolist() == plain.tolist())
    print(f"{stats.generated_tokens} tokens in {len(stats.steps)} target verifications "
          f"(tau = {stats.mean_accepted:.2f} tokens per verification), acceptance rate {stats.acceptance_rate:.2f}")
    print("draft lengths:", stats.draft_length_histogram())
    print("why drafting stopped:", sorted({s.stop_reason for s in stats.steps}))


if __name__ == "__main__":
    main()
