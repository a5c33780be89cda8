"""`pacer-align`'s pipeline: the target's greedy outputs (a head run's traces, or recorded now), then trl's
`SFTTrainer` (or `GKDTrainer`) with a peft LoRA adapter on the draft, then a Hub-ready adapter folder with its card.

Sequence-level distillation (the default): the draft learns to write what the target writes, token for
token, from the target's own greedy outputs (the loss on those tokens only). Token-level distillation
(`--distillation token`): the draft learns the target's whole next-token distribution at every position of
those outputs (trl's `GKDTrainer`, no generation), at one target forward more per step. Greedy speculative decoding accepts a draft
token exactly when it is the target's greedy choice after the same prefix, so the held-out metric is the
draft's next-token agreement with the target's output, teacher-forced, measured before and after on
prompts never trained on ([`held_out`]).
"""

import gc
import json
import shlex
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from ..training.arguments import held_out_count
from ..training.card import describe_source
from ..training.pipeline import DEFAULT_DRAFT_HUB_ID, TrainingError, push_to_hub, record_traces, sharegpt_rows

SUMMARY = "alignment_summary.json"  # beside the adapter: what the card was rendered from


def alignment_dataset(prompts: list[tuple[str, torch.Tensor]], outputs: dict[str, torch.Tensor]):
    """A tokenized `datasets.Dataset` for `SFTTrainer`: per prompt with an output, `input_ids` = prompt + the
    target's greedy output and `completion_mask` = 1 on the output's tokens (trl's completion-only loss).
    Already tokenized: the target's tokens are used as they were generated, never re-tokenized from text."""
    from datasets import Dataset

    ids, masks, names = [], [], []
    for prompt_id, input_ids in prompts:
        if prompt_id not in outputs:
            continue
        prompt, output = input_ids[0].tolist(), outputs[prompt_id].tolist()
        ids.append(prompt + output)
        masks.append([0] * len(prompt) + [1] * len(output))
        names.append(prompt_id)
    return Dataset.from_dict({"input_ids": ids, "completion_mask": masks, "prompt_id": names})


@torch.no_grad()
def held_out(model, dataset) -> dict:
    """The draft's teacher-forced next-token agreement with the target's outputs in `dataset` (rows of
    [`alignment_dataset`]) and its loss on them (nats per target token), token-weighted: what greedy
    verification would accept, measured the same way for every kind of training."""
    from ..benchmarks.agreement import draft_agreement

    was_training = model.training
    model.eval()
    rows = []
    for ids, mask in zip(dataset["input_ids"], dataset["completion_mask"]):
        start = mask.index(1)
        rows.append(draft_agreement(model, torch.tensor([ids[:start]]), torch.tensor(ids[start:])))
    model.train(was_training)
    tokens = sum(r["tokens"] for r in rows)
    return dict(agreement=sum(r["agreement"] * r["tokens"] for r in rows) / tokens,
                loss=sum(r["nll"] * r["tokens"] for r in rows) / tokens, tokens=tokens)


@dataclass
class Alignment:
    """What [`fit_adapter`] returns: the draft with its trained adapter (a peft model), the held-out figures
    ([`held_out`]) of the plain draft (`before`) and of the aligned one (`after`), the training time (summed
    over resumed runs), and the trainer's log (one entry per logging step)."""

    model: torch.nn.Module
    before: dict
    after: dict
    seconds: float
    log_history: list[dict]


def fit_adapter(draft, tokenizer, train_set, eval_set, config, lora_config, resume: bool, teacher=None) -> Alignment:
    """Train a LoRA adapter on `draft` with trl, on the target's outputs in `train_set`.

    Without `teacher`: sequence-level distillation, trl's `SFTTrainer` (cross-entropy on the target's tokens).
    With `teacher` (the target, in a form that reads right-padded batches): token-level distillation, trl's
    `GKDTrainer` with `lmbda=0` (the same fixed outputs, no generation by the draft) and `beta=0` (forward KL
    from the target's full next-token distribution at every output position to the draft's).
    `resume`: continue from the last checkpoint in `config.output_dir`, if any (the plain draft's held-out
    figures are kept beside the checkpoints, so a resumed run still reports them)."""
    from transformers.trainer_utils import get_last_checkpoint

    out = Path(config.output_dir)
    checkpoint = get_last_checkpoint(str(out)) if resume and out.is_dir() else None
    saved = out / "before.json"
    if checkpoint and saved.exists():
        before = json.loads(saved.read_text())
    else:
        before = held_out(draft, eval_set)
        out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(before))
    if teacher is None:
        from trl import SFTTrainer

        trainer = SFTTrainer(model=draft, args=config, train_dataset=train_set, processing_class=tokenizer,
                             peft_config=lora_config)
    else:
        from trl.experimental.gkd import GKDConfig, GKDTrainer
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        settings = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
        gkd = GKDConfig(**{**settings, "lmbda": 0.0, "beta": 0.0})
        # GKD skips trl's dataset preparation: the labels are the target's tokens, -100 on the prompt
        labelled = train_set.map(lambda row: {"labels": [t if m else -100 for t, m in zip(row["input_ids"], row["completion_mask"])]},
                                 remove_columns=["completion_mask"])
        trainer = GKDTrainer(model=draft, teacher_model=teacher, args=gkd, train_dataset=labelled, processing_class=tokenizer,
                             peft_config=lora_config, data_collator=DataCollatorForLanguageModeling(tokenizer.pad_token_id))
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=checkpoint)
    # training time summed over the runs that made this adapter (an interrupted run resumes its total)
    spent = out / "training_seconds.json"
    earlier = json.loads(spent.read_text()) if checkpoint and spent.exists() else 0.0
    seconds = earlier + time.perf_counter() - start
    spent.write_text(json.dumps(seconds))
    return Alignment(trainer.model, before, held_out(trainer.model, eval_set), seconds, list(trainer.state.log_history))


def align(args, pair, prompts: list[tuple[str, torch.Tensor]], data_description: str, hub_api=None) -> dict:
    """Everything after the prompts: outputs, adapter, folder, upload. `args` = (config, pair args, script)."""
    from tqdm.auto import tqdm

    from ..hub_cards import render_adapter_card
    from ..pairs.loading import load_model, resolve_dtype

    config, pair_args, script = args
    out = Path(script.out)
    trace_dir = Path(script.traces) if script.traces else out / "traces"
    with tqdm(total=len(prompts), desc="target outputs", unit="prompt") as bar:
        traces = record_traces(pair, prompts, script.max_new_tokens, script.max_draft, trace_dir,
                               resume=script.resume or script.traces is not None, progress=bar,
                               batch_size=script.record_batch_size)
    outputs = {t.prompt_id: t.output for t in traces}
    n_eval = held_out_count(len(prompts), script.eval_fraction)
    train_set = alignment_dataset(prompts[:-n_eval], outputs)
    eval_set = alignment_dataset(prompts[-n_eval:], outputs)
    if not len(train_set) or not len(eval_set):
        raise TrainingError(f"need target outputs for training and held-out prompts; got {len(train_set)} and "
                            f"{len(eval_set)}.")

    # the draft to train: the plain one, unquantized, in the target's dtype (bf16 where the CPU has it)
    tokenizer, draft_source, pair_name = pair.tokenizer, pair.draft_source, pair.name
    target_name, dtype = pair.target_source, resolve_dtype(pair_args.dtype)
    pair.target = pair.draft = None  # past the outputs the pair's models are not needed: their memory is training's
    gc.collect()
    draft = load_model(draft_source, dtype=dtype, pair_name=pair_name)
    draft.config.use_cache = False
    config = replace(config, output_dir=str(out / "trainer"))
    teacher = None
    if script.distillation == "token":  # the target, plain (sdpa reads right-padded batches; exactness is for decoding)
        teacher = load_model(target_name, dtype=dtype, pair_name=pair_name)
    lora = script.lora_config()
    result = fit_adapter(draft, tokenizer, train_set.remove_columns("prompt_id"), eval_set, config, lora, script.resume,
                         teacher)
    model, before, after, seconds = result.model, result.before, result.after, result.seconds

    folder = out / "adapter"
    model.peft_config["default"].base_model_name_or_path = script.base_model
    model.save_pretrained(folder, save_embedding_layers=False)  # LoRA only (asking the Hub about the vocabulary: no)
    command = "pacer-align " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    tokens = sum(len(o) for o in outputs.values())
    fields = dict(
        base_model=script.base_model, repo_id=script.push_to_hub_repo or "org/pacer-aligned-draft", pair_name=pair_name,
        target=describe_source(target_name), draft=describe_source(draft_source), dtype=str(dtype).removeprefix("torch."),
        distillation=script.distillation,
        data_description=(f"{data_description} {len(train_set)} prompts for training and {len(eval_set)} held out; "
                          f"{tokens} target tokens of greedy output ({script.max_new_tokens} at most per prompt)."),
        lora=dict(r=lora.r, alpha=lora.lora_alpha, dropout=lora.lora_dropout, target_modules=script.lora_target_modules),
        optimisation=dict(epochs=config.num_train_epochs, learning_rate=config.learning_rate,
                          batch_size=config.per_device_train_batch_size * config.gradient_accumulation_steps,
                          max_length=config.max_length,
                          scheduler=getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type)),
        before={k: f"{v:.4f}" if isinstance(v, float) else v for k, v in before.items()},
        after={k: f"{v:.4f}" if isinstance(v, float) else v for k, v in after.items()},
        training_time=f"{seconds:.0f} s on {torch.get_num_threads()} CPU threads" if config.use_cpu else f"{seconds:.0f} s",
        command=command,
    )
    render_adapter_card(**fields).save(folder / "README.md")
    summary = dict(before=before, after=after, training_seconds=seconds, command=command, card=fields,
                   prompts=dict(train=len(train_set), eval=len(eval_set)), tokens=tokens, log_history=result.log_history)
    (folder / SUMMARY).write_text(json.dumps(summary, indent=1, default=str))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if script.push_to_hub_repo:
        summary["pushed"] = push_to_hub(folder, script.push_to_hub_repo, script.private, api=hub_api)
    return summary


def run(args, hub_api=None) -> dict:
    """`pacer-align` once its arguments are checked: the prompts, then the pair, then `align`."""
    from ..pairs import pair_from_args
    from ..prompts import apply_chat_template

    config, pair_args, script = args
    if pair_args.aligned_draft:
        raise TrainingError("pacer-align trains an adapter for the plain draft: leave out --aligned-draft.")
    if script.base_model is None and pair_args.is_default:
        script = replace(script, base_model=DEFAULT_DRAFT_HUB_ID)
    if script.threads:
        torch.set_num_threads(script.threads)
    rows, description = sharegpt_rows(script)
    pair = pair_from_args(pair_args)
    prompts = [(prompt_id, apply_chat_template(pair.tokenizer, text)) for prompt_id, text in rows]
    return align((config, pair_args, script), pair, prompts, description, hub_api=hub_api)
