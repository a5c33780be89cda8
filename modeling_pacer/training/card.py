"""The head's model card: the fields a training run saves (in summary.json, so the card can be rendered again)
and the Speed section read from a `pacer-bench` results.json measured with the head."""

import json
from pathlib import Path


def describe_source(source) -> str:
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
    # a merged report (`pacer-bench merge`) keeps the command of every run it merged
    commands = [part["command"] for part in bench["meta"].get("parts", [])] + [bench["meta"].get("command")]
    return (f"Measured live by `pacer-bench` on this CPU ({prompts} prompts: {datasets}; "
            f"{bench['meta'].get('max_new_tokens')} new tokens, greedy), every method interleaved per prompt:\n\n"
            + "\n".join(lines) + "\n\nCommands:\n\n```bash\n" + "\n".join(commands) + "\n```")


def render_card(folder: Path, fields: dict, bench: dict | None = None) -> Path:
    """Write `folder/README.md` from the card fields a training run saved (and a benchmark, if given)."""
    from ..hub_cards import render_head_card

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


def rerender_card(out: Path, bench_results: Path | None = None) -> Path:
    """`pacer-train card`: the head card of the finished run in `out` rendered again from the fields its
    summary.json kept, with the Speed section of `bench_results` (a pacer-bench run of the head) if given."""
    fields = json.loads((out / "summary.json").read_text())["card"]
    bench = json.loads(Path(bench_results).read_text()) if bench_results else None
    return render_card(out / "head", fields, bench)
