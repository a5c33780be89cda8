"""Sampled decoding with PACER: each draw is a draw from the target's own distribution (speculative sampling's
accept/resample rule), so the share of each next token over many draws matches the target's probabilities.

    python examples/sampling.py

On tiny random models built here: draws the first new token 400 times with PACER and compares how often each
token came with the target's probability of it. With a trained head whose config names a rule for sampling
(`sampling_stopping_rule`), `generate` follows it when `do_sample=True`.
"""

from collections import Counter

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_pacer import PacerConfig, PacerHead, enable_pacer

DRAWS = 400


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a peaked next-token distribution, as a trained model's: random logits are nearly flat
        model.lm_head.weight.mul_(8.0)
    return model


def main() -> None:
    target = enable_pacer(tiny_llama(seed=0))
    draft = tiny_llama(seed=1)  # another model: its proposals are often rejected, and resampled from the target
    head = PacerHead(PacerConfig(draft_hidden_size=32, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                 block_size=2, threshold=0.0))  # untrained, and never stops early: drafts are long
    input_ids = torch.tensor([[1, 2, 3]])
    temperature = 1.0
    with torch.no_grad():
        probs = torch.softmax(target(input_ids).logits[0, -1].float() / temperature, dim=-1)
        draft_probs = torch.softmax(draft(input_ids).logits[0, -1].float() / temperature, dim=-1)

    counts = Counter()
    for seed in range(DRAWS):
        torch.manual_seed(seed)
        out = target.generate(input_ids, assistant_model=draft, pacer_head=head, max_new_tokens=4, do_sample=True,
                              temperature=temperature, top_k=0, top_p=1.0)
        counts[int(out[0, input_ids.shape[1]])] += 1

    print("token  target probability  draft probability  PACER's share of draws")
    for token in probs.argsort(descending=True)[:5].tolist():
        print(f"{token:5d}  {probs[token]:.3f}               {draft_probs[token]:.3f}              {counts[token] / DRAWS:.3f}")
    total_variation = 0.5 * sum(abs(counts[t] / DRAWS - probs[t].item()) for t in range(probs.numel()))
    print(f"total variation distance over {DRAWS} draws: {total_variation:.3f} "
          f"(sampling noise alone is about {0.5 * (probs * (1 - probs)).sqrt().sum().item() / DRAWS ** 0.5:.3f}; "
          f"the draft's distribution is {0.5 * (draft_probs - probs).abs().sum().item():.3f} away)")


if __name__ == "__main__":
    main()
