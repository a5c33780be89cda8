"""Full greedy traces of the benchmark prompts (HumanEval, GSM8K, MT-Bench; the first 30 of each), for
replaying stopping rules where they are used, not only on ShareGPT.

The default pair as pacer-bench runs it (bf16 exact target, dynamic-int8 draft), recorded with pacer-train's
batched recorder (`record_traces`: the exact target's batched greedy outputs, then the draft's side), one
safetensors file per prompt, resumable:

    python benchmarks/results/2026-11-30-calibration-replay/record.py runs/bench-traces int8
    python benchmarks/results/2026-11-30-calibration-replay/record.py runs/bench-traces-int4 int4 runs/bench-traces

(the second argument: the draft's quantization, `--quantize-draft`; the third: a folder whose traces give the
target's outputs, so that only the draft's side is recorded).

Prompts 0-9 of each dataset are the live benchmark's (`pacer-bench run --n 10`); 10-29 are kept apart for
choosing between rules, so that the live run measures a choice made on other prompts.
"""

import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modeling_pacer.pairs import load_pair
from modeling_pacer.prompts import apply_chat_template, load_prompts
from modeling_pacer.training.pipeline import record_traces

DATASETS = ("humaneval", "gsm8k", "mtbench")


def main(out: str, quantize_draft: str = "int8", outputs_from: str | None = None, n: int = 30,
         max_new_tokens: int = 128, max_draft: int = 12) -> None:
    torch.set_num_threads(2)
    pair = load_pair(quantize_draft=quantize_draft)
    # file names: the dataset and the prompt's index in its file (the prompts' own ids hold '/')
    prompts = [(f"{dataset}-{i}", apply_chat_template(pair.tokenizer, prompt))
               for dataset in DATASETS for i, prompt in enumerate(load_prompts(dataset, n))]
    with tqdm(total=len(prompts), desc="recording traces", unit="prompt") as bar:
        record_traces(pair, prompts, max_new_tokens, max_draft, Path(out), resume=True, progress=bar, batch_size=16,
                      outputs_from=Path(outputs_from) if outputs_from else None)


if __name__ == "__main__":
    main(*sys.argv[1:4])
