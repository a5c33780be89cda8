"""Streaming PACER's output as it is accepted, and watching each step's draft.

    python examples/streaming.py

`streamer=` works as with plain `generate` (here transformers' `TextStreamer`-style interface: `put` receives the
prompt first, then each step's accepted tokens at once); `pacer_step_callback` sees every step before its
tokens are emitted: what was drafted, how much the target accepted, and why drafting stopped.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

from modeling_pacer import PacerConfig, PacerHead, enable_pacer


class PrintTokens(BaseStreamer):
    """Prints the new token ids as they arrive, one line per step (a `TextStreamer` would print text)."""

    def __init__(self):
        self.prompt_seen, self.chunks = False, []

    def put(self, value):
        if not self.prompt_seen:  # the prompt comes first
            self.prompt_seen = True
            return
        self.chunks.append(value.flatten().tolist())
        print("  emitted", self.chunks[-1], flush=True)

    def end(self):
        print("  (end)")


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    target = enable_pacer(tiny_llama(seed=0))
    draft = tiny_llama(seed=0)
    with torch.no_grad():  # a draft that mostly, not always, agrees with the target
        for p in draft.parameters():
            p.add_(0.02 * p.std() * torch.randn_like(p))
    head = PacerHead(PacerConfig(draft_hidden_size=64, block_size=2, threshold=0.3))  # untrained

    def on_step(ids, proposal, target_scores, num_accepted):
        drafted = proposal.tokens[0].tolist()
        print(f"step: drafted {len(drafted)} ({proposal.stop_reason}), accepted {num_accepted}")

    streamer = PrintTokens()
    input_ids = torch.tensor([[1, 20, 30, 40, 50]])
    out = target.generate(input_ids, assistant_model=draft, pacer_head=head, max_new_tokens=24, streamer=streamer,
                          pacer_step_callback=on_step)
    streamed = [t for chunk in streamer.chunks for t in chunk]
    print("streamed tokens are the output:", streamed == out[0, input_ids.shape[1]:].tolist())
    print("identical to the target's greedy output:", out.tolist() == target.generate(input_ids, max_new_tokens=24).tolist())


if __name__ == "__main__":
    main()
