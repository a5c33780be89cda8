"""How a draft LM head over fewer tokens (`--draft-vocab N`) changes what the draft proposes, and what it costs.

For each benchmark prompt the target (w4a8, exact) writes its greedy continuation; the int4 draft then reads
prompt + continuation in one forward, and at every continuation position the draft's next-token logits are cut
to the N kept tokens (as `modeling_pacer.draft_vocab` keeps them: the special tokens, then the lowest ids).
Per N: coverage (the target's tokens that are kept), first-token acceptance (the draft's argmax is the
target's token) and the AUC of the draft's max probability for that event (the estimate the default stopping
rule reads). Then the draft's step, full head against each N, timed in interleaved rounds, with its weight
bytes. Run: python benchmarks/results/2026-12-02-draft-vocab/vocab.py > benchmarks/results/2026-12-02-draft-vocab/vocab.md
"""

import sys

import torch
from transformers import DynamicCache

from modeling_pacer.costs import fixed_prefix, interleaved_medians, measure_bandwidth, weight_bytes
from modeling_pacer.custom_generate.generate import crop_cache, model_forward
from modeling_pacer.draft_vocab import frequent_token_ids, special_token_ids
from modeling_pacer.pairs import load_pair
from modeling_pacer.pairs.loading import load_draft
from modeling_pacer.prompts import apply_chat_template, load_prompts
from modeling_pacer.training.trainer import roc_auc

SIZES = (None, 65536, 49152, 32768, 16384)
N_PROMPTS, NEW = 10, 96
torch.set_num_threads(2)


def main():
    pair = load_pair(quantize_target="w4a8")
    vocab = pair.draft.get_output_embeddings().out_features
    kept = {n: frequent_token_ids(vocab, n, special_token_ids(pair.tokenizer)) for n in SIZES if n}
    rows = {n: dict(tokens=0, covered=0, hits=[], probs=[]) for n in SIZES}
    with torch.inference_mode():
        for dataset in ("humaneval", "gsm8k", "mtbench"):
            for prompt in load_prompts(dataset, N_PROMPTS):
                ids = apply_chat_template(pair.tokenizer, prompt)
                out = pair.target.generate(ids, max_new_tokens=NEW, do_sample=False)
                new = out[0, ids.shape[1]:]
                logits = pair.draft(input_ids=out[:, :-1]).logits[0, ids.shape[1] - 1:].float()  # predicts `new`
                for n in SIZES:
                    row = rows[n]
                    cut = logits if n is None else torch.full_like(logits, float("-inf")).index_copy_(
                        -1, kept[n], logits[:, kept[n]])
                    q = cut.softmax(-1)
                    p, pred = q.max(-1)
                    row["tokens"] += new.numel()
                    row["covered"] += new.numel() if n is None else int(torch.isin(new, kept[n]).sum())
                    row["hits"].append(pred == new)
                    row["probs"].append(p)
                print(f"{prompt.id}: {new.numel()} tokens", file=sys.stderr)
    print(f"Host: {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()}, "
          f"2 threads; {N_PROMPTS} prompts each of HumanEval, GSM8K, MT-Bench, {NEW} new tokens, w4a8 target, int4 draft.\n")
    print("| kept tokens | coverage of the target's tokens | first-token acceptance | AUC of the draft's max probability |")
    print("|---|---|---|---|")
    for n in SIZES:
        row = rows[n]
        hits, probs = torch.cat(row["hits"]), torch.cat(row["probs"])
        print(f"| {n or f'{vocab} (all)'} | {row['covered'] / row['tokens']:.4f} | {hits.float().mean():.4f} | "
              f"{roc_auc(probs, hits.float()):.4f} |")
    del pair
    drafts = {n: load_draft(spec_draft(), torch.bfloat16, "int4", draft_vocab=n, tokenizer=tokenizer())
              for n in SIZES}
    prefix = fixed_prefix(drafts[None], 128)
    fns = []
    with torch.inference_mode():
        for draft in drafts.values():
            cache = DynamicCache(config=draft.config)
            model_forward(draft, prefix, cache, 1)
            fns.append(lambda d=draft, c=cache: (model_forward(d, prefix[:, -1:], c, 1), crop_cache(c, 128)))
        bandwidth = measure_bandwidth()
        seconds = interleaved_medians(fns, 30)
    print(f"\nThe draft's one-token step after a 128-token prefix, median of 30 interleaved rounds; memory bandwidth "
          f"measured in the same run: {bandwidth / 1e9:.1f} GB/s.\n")
    print("| kept tokens | weight bytes (MB) | step (ms) | memory floor (ms) | step / floor |")
    print("|---|---|---|---|---|")
    for (n, draft), t in zip(drafts.items(), seconds):
        b = weight_bytes(draft)
        print(f"| {n or f'{vocab} (all)'} | {b / 1e6:.0f} | {t * 1e3:.2f} | {b / bandwidth * 1e3:.2f} | {t * bandwidth / b:.2f}x |")


def spec_draft():
    from modeling_pacer.pairs import DEFAULT_PAIR, get_pair

    return get_pair(DEFAULT_PAIR).draft


def tokenizer():
    from modeling_pacer.pairs import DEFAULT_PAIR, get_pair
    from modeling_pacer.pairs.loading import load_tokenizer

    return load_tokenizer(get_pair(DEFAULT_PAIR).target)


if __name__ == "__main__":
    main()
