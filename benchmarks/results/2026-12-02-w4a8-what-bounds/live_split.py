"""Where the live time goes, over the w4a8 target: the target alone against PACER (the default head's rule), on the
30 benchmark prompts (10 each of HumanEval, GSM8K, MT-Bench; 96 new tokens; interleaved per prompt). PACER: every
model forward of its loop timed: the target's prefill (its first forward, the prompt), the draft's prefill (its
first forward), and the decoding forwards after them. The target alone runs transformers' own loop, so its prefill
is estimated by one more forward of the prompt after the generation, subtracted from the generation's time.
Prints per-part seconds and the speedup with and without the prefills.

Run: python benchmarks/results/2026-12-02-w4a8-what-bounds/live_split.py > benchmarks/results/2026-12-02-w4a8-what-bounds/live_split.md
"""

import collections
import sys
import time

import torch

import modeling_pacer.custom_generate.generate as loop
from modeling_pacer import PacerHead, enable_pacer
from modeling_pacer.pairs import default_head_path, load_pair, resolve_pair
from modeling_pacer.pairs.registry import DEFAULT_PAIR
from modeling_pacer.prompts import apply_chat_template, load_prompts

NEW = 96
torch.set_num_threads(2)


def main():
    pair = load_pair(quantize_target="w4a8")
    enable_pacer(pair.target)
    head = PacerHead.from_pretrained(default_head_path(resolve_pair(DEFAULT_PAIR)))
    calls = []
    plain_forward = loop.model_forward

    def timed(model, tokens, cache, num_logits, hidden=False):
        start = time.perf_counter()
        result = plain_forward(model, tokens, cache, num_logits, hidden)
        calls.append(("draft" if model is pair.draft else "target", tokens.shape[1], time.perf_counter() - start))
        return result

    loop.model_forward = timed
    parts = {m: collections.Counter() for m in ("target", "pacer")}
    prompt_tokens = 0
    # warm-up (the cost curve is measured or read here, kernels built): not counted
    warm = apply_chat_template(pair.tokenizer, load_prompts("gsm8k", 1)[0])
    pair.target.generate(warm, assistant_model=pair.draft, pacer_head=head, max_new_tokens=8)
    for dataset in ("humaneval", "gsm8k", "mtbench"):
        for prompt in load_prompts(dataset, 10):
            ids = apply_chat_template(pair.tokenizer, prompt)
            prompt_tokens += ids.shape[1]
            for method in ("target", "pacer"):
                calls.clear()
                start = time.perf_counter()
                if method == "target":
                    # the plain loop's forwards are transformers' own: time the prefill alone through one forward
                    out = pair.target.generate(ids, do_sample=False, max_new_tokens=NEW)
                    total = time.perf_counter() - start
                    t0 = time.perf_counter()
                    plain_forward(pair.target, ids, transformers_cache(pair.target), 1)
                    parts[method]["target prefill"] += time.perf_counter() - t0
                    parts[method]["target decoding"] += total - (time.perf_counter() - t0)
                else:
                    out = pair.target.generate(ids, assistant_model=pair.draft, pacer_head=head, max_new_tokens=NEW,
                                               return_dict_in_generate=True)
                    total = time.perf_counter() - start
                    first = {}
                    for role, n, seconds in calls:
                        key = f"{role} {'prefill' if role not in first else 'decoding'}"
                        first[role] = True
                        parts[method][key] += seconds
                    parts[method]["other (policy, logits, Python)"] += total - sum(s for *_, s in calls)
                parts[method]["total"] += total
            print(f"{prompt.id}: {ids.shape[1]} prompt tokens", file=sys.stderr)
    t, p = parts["target"], parts["pacer"]
    print(f"30 prompts ({prompt_tokens / 30:.0f} prompt tokens on average), {NEW} new tokens, w4a8 target, int4 draft, "
          "2 threads; seconds summed over the prompts.\n")
    print("| part | target alone | PACER |")
    print("|---|---|---|")
    for key in ("target prefill", "draft prefill", "target decoding", "draft decoding", "other (policy, logits, Python)", "total"):
        print(f"| {key} | {t.get(key, 0.0):.1f} | {p.get(key, 0.0):.1f} |")
    print(f"\nSpeedup, whole generation: {t['total'] / p['total']:.2f}x; without the draft's prefill: "
          f"{t['total'] / (p['total'] - p['draft prefill']):.2f}x; decoding alone (both prefills out): "
          f"{(t['total'] - t['target prefill']) / (p['total'] - p['target prefill'] - p['draft prefill']):.2f}x.")


def transformers_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


if __name__ == "__main__":
    main()
