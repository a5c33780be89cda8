"""The head's model card: the fields a training run saves (in summary.json, so the card can be rendered again)
and the Speed section read from a `pacer-bench` results.json measured with the head."""

import json
from pathlib import Path

from ..pairs.loading import DRAFT_QUANTIZATIONS


def describe_source(source) -> str:
    return source.describe() if hasattr(source, "describe") else str(source)


def _fmt(x, pattern=".3f"):
    return format(x, pattern) if isinstance(x, (int, float)) else str(x)


def bench_setting(bench: dict) -> str:
    """How a pacer-bench run ran the target (dtype, exact verification), from its meta or its parts'
    (a merged report). Runs written before pacer recorded it loaded the target in float32, not exact."""
    metas = bench["meta"].get("parts") or [bench["meta"]]
    settings = {f"{m.get('dtype', 'float32')}{' exact' if m.get('exact') else ' (verification not exact)'}"
                + (f", {m['quantize_target']} weights" if m.get("quantize_target") else "") for m in metas}
    kinds = {m.get("quantize_draft") for m in metas}
    kind = kinds.pop() if len(kinds) == 1 else None
    kind = "int8" if kind is True else kind  # runs written before int4 drafts existed: the flag meant dynamic int8
    draft = f"{DRAFT_QUANTIZATIONS[kind]} draft" if kind in DRAFT_QUANTIZATIONS else "draft"
    return f"target {' / '.join(sorted(settings))}, {draft}"


def _speed_table(bench: dict) -> str:
    from ..hub_cards import format_speedup, lossless_label

    rows = [r for r in bench["summary"] if r["dataset"] == "all"]
    lines = ["| method | speedup over the target alone (95% CI over prompts) | tokens/s | τ (tokens / target forward) "
             "| lossless |", "|---|---|---|---|---|"]
    for r in rows:
        lossless = lossless_label(r)
        tokens_per_s = "–" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.2f}"
        tau = "–" if r.get("tau") is None else f"{r['tau']:.2f}"
        lines.append(f"| {r['method']} | {format_speedup(r)} | {tokens_per_s} | {tau} | {lossless} |")
    prompts = max((r["prompts"] for r in rows), default=0)
    datasets = ", ".join(dict.fromkeys(r["dataset"] for r in bench["summary"] if r["dataset"] != "all"))
    # a merged report (`pacer-bench merge`) keeps the command of every run it merged
    commands = [part["command"] for part in bench["meta"].get("parts", [])] + [bench["meta"].get("command")]
    sampling = bench["meta"].get("sampling")
    decoding = "greedy" if not sampling else f"sampled at temperature {sampling['temperature']:g}, seed {sampling['seed']}"
    return (f"**{bench_setting(bench)}** ({prompts} prompts: {datasets}; {bench['meta'].get('max_new_tokens')} new "
            f"tokens, {decoding}):\n\n" + "\n".join(lines) + _standing_table(bench)
            + "\n\nCommands:\n\n```bash\n" + "\n".join(commands) + "\n```")


def _standing_table(bench: dict) -> str:
    """PACER (the head's default rule) against the run's other methods, per dataset: the ratio of its speedup to
    the best fixed draft length's and to the best other method's (any but the target, the oracle and PACER's own
    variants `pacer-*`), and its share of the oracle's. Empty when the run has no `pacer` row."""
    by_dataset = {}
    for row in bench["summary"]:
        by_dataset.setdefault(row["dataset"], {})[row["method"]] = row
    lines = []
    for dataset, rows in by_dataset.items():
        pacer = rows.get("pacer")
        others = {m: r for m, r in rows.items() if m not in ("target", "pacer") and not m.startswith(("pacer-", "oracle"))}
        if pacer is None or not others:
            continue
        fixed = [m for m in others if m.startswith("fixed-")]
        cells, short = [dataset, f"{pacer['speedup']:.2f}x"], []
        # the aims: at least 1.10 against the best fixed length, strictly ahead of every other method
        for names, met, what in ((fixed, lambda r: r >= 1.10, "best fixed length"),
                                 (list(others), lambda r: r > 1.0, "other methods")):
            best = max(names, key=lambda m: others[m]["speedup"], default=None)
            if best is None:
                cells.append("–")
                continue
            ratio = pacer["speedup"] / others[best]["speedup"]
            cells.append(f"{ratio:.3f} ({best} {others[best]['speedup']:.2f}x)")
            if not met(ratio):
                short.append(what)
        of_oracle = pacer.get("of_oracle")
        cells.append("–" if of_oracle is None else f"{of_oracle:.0%}")
        if of_oracle is not None and of_oracle < 0.90:
            short.append("oracle")
        cells.append("yes" if not short else "no: " + ", ".join(short))
        lines.append("| " + " | ".join(cells) + " |")
    if not lines:
        return ""
    return ("\n\nPACER against the others (ratios of speedups; the project aims at 1.10 or more against the best fixed "
            "length, above 1 against every other method, and 90% of the oracle, on each dataset):\n\n"
            "| dataset | PACER | against the best fixed length | against the best other method | of the oracle | aim met |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(lines))


def speed_section(benches: list[dict] | dict | None) -> str:
    """Markdown for the card's Speed section from one or more `pacer-bench` results.json (each one's summary
    over all datasets, labelled with how it ran the target), or a pointer when none was given."""
    if isinstance(benches, dict):
        benches = [benches]
    if not benches:
        return "No live benchmark of this head was given to the card (`--bench-results`); the replayed ablations are below."
    return ("Measured live by `pacer-bench` on this CPU, every method interleaved per prompt, each run against "
            "the target alone in the same run:\n\n" + "\n\n".join(_speed_table(b) for b in benches))


def render_card(folder: Path, fields: dict, bench: list[dict] | dict | None = None) -> Path:
    """Write `folder/README.md` from the card fields a training run saved (and a benchmark, if given)."""
    from ..hub_cards import render_head_card

    fields = dict(fields)
    base_model = fields.pop("base_model", None)
    card = render_head_card(base_model=base_model, speed=speed_section(bench), **fields)
    card.save(folder / "README.md")
    return folder / "README.md"


def card_fields(head, *, pair_name, target, draft, base_model, repo_id, metrics, tuned, ablations, data_description,
                command, training_time, predictors=None) -> dict:
    """Everything the card template needs, JSON-serialisable (kept in summary.json for re-rendering)."""
    return dict(
        base_model=base_model, repo_id=repo_id or "org/pacer-head", pair_name=pair_name, target=target, draft=draft,
        block_size=tuned.block_size, threshold=tuned.threshold, growth=tuned.growth,
        first_block_size=tuned.first_block_size, stopping_rule=getattr(head.config, "stopping_rule", "blocks"),
        throughput_estimate=getattr(head.config, "throughput_estimate", "head"),
        calibration=getattr(head.config, "calibration", None),
        sampling_stopping_rule=getattr(head.config, "sampling_stopping_rule", None),
        draft_quantization=getattr(head.config, "draft_quantization", None),
        max_draft_length=head.config.max_draft_length, data_description=data_description,
        eval_tokens=metrics.get("eval_tokens", "–"), auc=_fmt(metrics.get("eval_auc")),
        auc_first_token=_fmt(metrics.get("eval_auc_first_token")),
        accuracy=_fmt(metrics.get("eval_accuracy")), ece=_fmt(metrics.get("eval_ece")),
        brier=_fmt(metrics.get("eval_brier")), positive_rate=_fmt(metrics.get("eval_positive_rate")),
        ablations={k: f"{v:.2f}x" for k, v in ablations.items()}, command=command, training_time=training_time,
        predictors={name: dict(auc=_fmt(p["auc"]), ece="–" if p["ece"] != p["ece"] else _fmt(p["ece"]))
                    for name, p in (predictors or {}).items()},
    )


def rerender_card(out: Path, bench_results: list[Path] | None = None) -> Path:
    """`pacer-train card`: a head card rendered again from the fields its training run kept, with the Speed
    section of `bench_results` (pacer-bench runs of the head) if given. `out` is a finished run's folder
    (summary.json, card written to head/) or a head folder that carries its run's training_summary.json
    (as the committed heads do; card written there)."""
    out = Path(out)
    summary, folder = (out / "summary.json", out / "head") if (out / "summary.json").is_file() else (
        out / "training_summary.json", out)
    fields = json.loads(summary.read_text())["card"]
    benches = [json.loads(Path(path).read_text()) for path in bench_results or []]
    return render_card(folder, fields, benches)
