"""Bring your own pair: train a PACER head for it on your prompts, load the head, and generate with it.

    python examples/own_pair.py                                   # tiny random models built here (a minute)
    python examples/own_pair.py --target org/big --draft org/small --prompts my_prompts.txt --out runs/mine

The second form loads your target and draft (any pair that shares a tokenizer), renders each line of
`my_prompts.txt` with the target's chat template, records the target's greedy outputs and the draft's drafts
along them, trains the head with a `transformers.Trainer`, tunes its stopping rule on the held-out prompts
with this machine's cost curve, and writes a Hub-ready head folder to `runs/mine/head`. A few hundred
prompts are worth it (the committed 1,000-prompt head took 3,834 s of recording, 468 s of training and 257 s
of tuning on 2 CPU threads: its card); `pacer-train run --target org/big --draft org/small --n 500 --out runs/mine` does the same on
ShareGPT prompts.
"""

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_pacer import PacerHead, enable_pacer
from modeling_pacer.pairs import LoadedPair, ModelSource, load_pair
from modeling_pacer.prompts import apply_chat_template
from modeling_pacer.training import cli, pipeline

# a small head and short drafts: enough to show every step on tiny models in seconds
TINY_TRAINING = ["--max-new-tokens", "24", "--max-draft", "6", "--epochs", "3", "--batch-size", "64",
                 "--max-tokens-per-row", "64", "--head-hidden-size", "16", "--head-heads", "2",
                 "--head-intermediate-size", "32", "--eval-fraction", "0.34"]
# the committed int4 head's settings (training/qwen2.5-coder-1.5b-0.5b-int4.yaml)
REAL_TRAINING = ["--max-new-tokens", "128", "--max-draft", "12", "--head-draft-features", "--head-draft-prior",
                 "--epochs", "3"]


def tiny_pair() -> tuple[LoadedPair, list[tuple[str, torch.Tensor]]]:
    """A random tiny Llama target, a draft that mostly agrees with it (its weights plus noise), and 6 prompts."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * p.std() * torch.randn_like(p))
    pair = LoadedPair(target, draft, None, "tiny", ModelSource(path="tiny-target"), ModelSource(path="tiny-draft"))
    g = torch.Generator().manual_seed(0)
    prompts = [(f"p{i}", torch.randint(0, 256, (1, 4 + i), generator=g)) for i in range(6)]
    return pair, prompts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="your target: Hub repo id, folder or .gguf (default: tiny random models)")
    p.add_argument("--draft", help="your draft (with --target)")
    p.add_argument("--prompts", help="a text file, one prompt per line (with --target)")
    p.add_argument("--out", default="runs/own-pair", help="the run's folder; the head goes to OUT/head")
    args = p.parse_args(argv)

    if args.target:
        if not (args.draft and args.prompts):
            p.error("--target needs --draft and --prompts")
        pair = load_pair(args.target, args.draft)
        lines = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        prompts = [(f"line-{i}", apply_chat_template(pair.tokenizer, text)) for i, text in enumerate(lines)]
        flags = ["--target", args.target, "--draft", args.draft, *REAL_TRAINING]
        description = f"{len(prompts)} prompts from {Path(args.prompts).name}, rendered with the target's chat template."
    else:
        pair, prompts = tiny_pair()
        flags = ["--quantize-draft", "none", *TINY_TRAINING]
        description = "Tiny random prompts."

    # 1. train: traces, the Trainer, tuning on the held-out prompts, a Hub-ready folder with its card
    run_args = cli.parse_run_args(["--out", args.out, *flags])
    summary = pipeline.train(run_args, pair, prompts, description)
    folder = Path(args.out) / "head"
    print(f"trained on {summary['prompts']['train']} prompts, held-out AUC {summary['metrics']['eval_auc']:.3f}; "
          f"head in {folder}")

    # 2. use it: load the folder as you would a Hub repo id, and generate
    head = PacerHead.from_pretrained(folder)
    target = enable_pacer(pair.target)
    input_ids = prompts[-1][1]
    out = target.generate(input_ids, assistant_model=pair.draft, pacer_head=head, max_new_tokens=32,
                          return_dict_in_generate=True)
    plain = target.generate(input_ids, max_new_tokens=32)
    stats = out.pacer_stats
    print("identical to the target's greedy output:", out.sequences.tolist() == plain.tolist())
    print(f"rule: {stats.policy}; {stats.generated_tokens} tokens in {len(stats.steps)} target forwards")


if __name__ == "__main__":
    main()
