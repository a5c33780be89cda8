"""Summaries, the Markdown table, the JSON file and the plots of a benchmark run."""

import json
import random
from collections import Counter, defaultdict
from pathlib import Path

from ..hub_cards import format_speedup, lossless_label


def _share(rs: list[dict], key: str, seconds: float) -> float | None:
    """The fraction of `seconds` spent in `key` (e.g. the target's forwards), or None where a record
    lacks it (results written before forwards were timed)."""
    values = [r.get(key) for r in rs]
    return None if any(v is None for v in values) else sum(values) / seconds


def speedup_interval(pairs: list[tuple[float, float]], resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """95% percentile-bootstrap interval of a speedup over prompts.

    `pairs`: per prompt `(seconds of the target alone, seconds of the method)`. The speedup is a ratio
    of sums, so each resample draws prompts with replacement, keeping each prompt's two times
    together (both were measured on the same prompt in the same run). None below two prompts.
    """
    if len(pairs) < 2:
        return None
    rng = random.Random(seed)  # the same interval every time the report is written
    ratios = []
    for _ in range(resamples):
        sample = rng.choices(pairs, k=len(pairs))
        ratios.append(sum(t for t, _ in sample) / sum(m for _, m in sample))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


# the oracle's schedules priced with the live run's measured prefills (the cost model prices none)
END_TO_END_ORACLE = "oracle + measured prefills"
ORACLES = ("oracle (replay)", END_TO_END_ORACLE)


def summarize(records: list[dict], oracle_rows: list[dict]) -> list[dict]:
    """One row per (dataset, method), plus dataset "all". Ratios of sums over prompts.

    `speedup_ci`: the 95% bootstrap interval over prompts (None below two prompts).
    `tokens_per_s`: all new tokens over all seconds (the row's prompts together, not a mean of per-prompt rates).
    Where the time goes: `target_share` and `draft_share` (inside the models' forwards), `head_share`
    (PACER's and SpecDec++'s heads), `other_share` (the rest: the decoding loop's own work).
    `own_numerics`: the method computes another function than the torch target (llama.cpp; records with
    `matches_target` None): never a mismatch, and no forward counts, shares or oracle fraction (None);
    `agree_prefix`: the mean number of new tokens equal to the target's before the first difference
    (None for results written before it was recorded, and for sampled runs). `sampled`: the records are
    sampled decoding (draws, not compared with the target's; their losslessness is the sampling tests').
    """
    by_key = defaultdict(list)
    for r in records:
        by_key[(r["dataset"], r["method"])].append(r)
        by_key[("all", r["method"])].append(r)
    oracle_by_dataset = defaultdict(list)
    for r in oracle_rows:
        oracle_by_dataset[r["dataset"]].append(r)
        oracle_by_dataset["all"].append(r)
    oracle_speedup = {
        d: sum(r["target_alone_seconds"] for r in rows) / sum(r["seconds"] for r in rows)
        for d, rows in oracle_by_dataset.items()
    }
    # the same schedules with the prompts' prefills as the live run measured them: what any stopping rule could reach
    # end to end, as the live speedups are measured (prefills included); None where a row lacks them
    end_to_end_pairs = {
        d: [(r["end_to_end_target_alone_seconds"], r["end_to_end_seconds"]) for r in rows]
        for d, rows in oracle_by_dataset.items() if rows and all(r.get("end_to_end_seconds") is not None for r in rows)
    }
    end_to_end_speedup = {d: sum(t for t, _ in ps) / sum(m for _, m in ps) for d, ps in end_to_end_pairs.items()}
    # a live row's "of oracle": against the end-to-end oracle where the run measured prefills, else the replayed one
    reference = {**oracle_speedup, **end_to_end_speedup}

    rows = []
    for (dataset, method), rs in by_key.items():
        target_seconds = sum(r["seconds"] for r in by_key[(dataset, "target")])
        alone = {(r["dataset"], r["prompt_id"]): r["seconds"] for r in by_key[(dataset, "target")]}
        interval = speedup_interval([(alone[(r["dataset"], r["prompt_id"])], r["seconds"]) for r in rs])
        seconds = sum(r["seconds"] for r in rs)
        tokens = sum(r["new_tokens"] for r in rs)
        speedup = target_seconds / seconds
        mismatches = sum(r["matches_target"] is False for r in rs)
        sampled = any(r.get("sampled") for r in rs)
        own_numerics = not sampled and all(r["matches_target"] is None for r in rs)
        head_share = sum(r["head_seconds"] for r in rs) / seconds
        target_share, draft_share = _share(rs, "target_seconds", seconds), _share(rs, "draft_seconds", seconds)
        other_share = None if None in (target_share, draft_share) else 1.0 - target_share - draft_share - head_share
        prefixes = [r.get("agree_prefix") for r in rs]
        row = dict(
            dataset=dataset, method=method, prompts=len(rs), speedup=speedup, speedup_ci=interval,
            tokens_per_s=tokens / seconds,
            tau=tokens / max(1, sum(r["target_forwards"] for r in rs)),
            target_forwards_per_token=sum(r["target_forwards"] for r in rs) / tokens,
            draft_forwards_per_token=sum(r["draft_forwards"] for r in rs) / tokens,
            target_share=target_share, draft_share=draft_share, head_share=head_share, other_share=other_share,
            of_oracle=speedup / reference[dataset] if dataset in reference else None,
            mismatches=mismatches, own_numerics=own_numerics, sampled=sampled,
            agree_prefix=None if None in prefixes else sum(prefixes) / len(prefixes),
        )
        row.update(_peer_summary(rs))
        if own_numerics:  # not the torch models: nothing of theirs was counted or timed
            row.update(tau=None, target_forwards_per_token=None, draft_forwards_per_token=None, target_share=None,
                       draft_share=None, head_share=None, other_share=None, of_oracle=None)
        rows.append(row)
    for dataset, speedup in oracle_speedup.items():
        rs = oracle_by_dataset[dataset]
        tokens = sum(r["new_tokens"] for r in rs)
        steps = sum(len(r["draft_lengths"]) for r in rs)
        rows.append(dict(
            dataset=dataset, method="oracle (replay)", prompts=len(rs), speedup=speedup,
            speedup_ci=speedup_interval([(r["target_alone_seconds"], r["seconds"]) for r in rs]), tokens_per_s=None,
            tau=tokens / max(1, steps), target_forwards_per_token=steps / tokens,
            draft_forwards_per_token=sum(sum(r["draft_lengths"]) for r in rs) / tokens,
            target_share=None, draft_share=None, head_share=0.0, other_share=None,
            of_oracle=None if dataset in end_to_end_speedup else 1.0, mismatches=0,
        ))
    for dataset, pairs in end_to_end_pairs.items():
        rows.append(dict(
            dataset=dataset, method=END_TO_END_ORACLE, prompts=len(pairs), speedup=end_to_end_speedup[dataset],
            speedup_ci=speedup_interval(pairs), tokens_per_s=None, tau=None, target_forwards_per_token=None,
            draft_forwards_per_token=None, target_share=None, draft_share=None, head_share=None, other_share=None,
            of_oracle=1.0, mismatches=0,
        ))
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in records))}
    order["oracle (replay)"] = len(order)
    order[END_TO_END_ORACLE] = len(order)
    datasets = list(dict.fromkeys(r["dataset"] for r in records)) + ["all"]
    return sorted(rows, key=lambda r: (datasets.index(r["dataset"]), order[r["method"]]))


def _peer_summary(rs: list[dict]) -> dict:
    """llama.cpp's speculative methods (records with its own counts): the share of its drafted tokens accepted,
    and how many outputs equal plain llama.cpp's, with the mean agreeing prefix; nothing for the others."""
    if all(r.get("peer_drafted") is None for r in rs):
        return {}
    drafted = sum(r.get("peer_drafted") or 0 for r in rs)
    accepted = sum(r.get("peer_accepted") or 0 for r in rs)
    out = dict(peer_drafted=drafted, peer_acceptance=accepted / drafted if drafted else None)
    same = [r.get("same_as_plain_llamacpp") for r in rs]
    if all(v is not None for v in same):
        prefixes = [r["plain_llamacpp_prefix"] for r in rs]
        out.update(same_as_plain_llamacpp=sum(same), plain_llamacpp_prefix=sum(prefixes) / len(prefixes))
    return out


def peer_notes(summary: list[dict]) -> str:
    """A line per llama.cpp speculative method (all prompts): its acceptance by llama.cpp's own count and its
    agreement with plain llama.cpp, for under the table."""
    lines = []
    for r in summary:
        if r["dataset"] != "all" or "peer_drafted" not in r:
            continue
        accepted = "–" if r["peer_acceptance"] is None else f"{r['peer_acceptance']:.2f}"
        line = f"- {r['method']}: {r['peer_drafted']} draft tokens proposed, {accepted} of them accepted (llama.cpp's count)"
        if "same_as_plain_llamacpp" in r:
            line += (f"; {r['same_as_plain_llamacpp']}/{r['prompts']} outputs equal plain llama.cpp's token for token "
                     f"(on average {r['plain_llamacpp_prefix']:.1f} new tokens agree before the first difference)")
        lines.append(line)
    return ("\n" + "\n".join(lines) + "\n") if lines else ""


def _fmt(value, pattern: str) -> str:
    return "–" if value is None else format(value, pattern)


def _time_shares(row: dict) -> str:
    return " / ".join(_fmt(row.get(key), pattern) for key, pattern in
                      [("target_share", ".0%"), ("draft_share", ".0%"), ("head_share", ".1%"), ("other_share", ".0%")])


def markdown_table(summary: list[dict]) -> str:
    # results written before the forwards were timed only know the head's share
    timed = any(r.get("target_share") is not None for r in summary)
    time_header = "time in target / draft / head / other" if timed else "head time"
    lines = [
        "| dataset | method | speedup (95% CI over prompts) | tokens/s (all tokens / all s) | τ (tokens / target fwd) | "
        f"target fwd / token | draft fwd / token | {time_header} | of oracle | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lossless = lossless_label(r, emphasis="**")
        time = _time_shares(r) if timed else _fmt(r["head_share"], ".1%")
        lines.append(
            f"| {r['dataset']} | {r['method']} | {format_speedup(r)} | {_fmt(r['tokens_per_s'], '.2f')} | "
            f"{_fmt(r['tau'], '.2f')} | {_fmt(r['target_forwards_per_token'], '.2f')} | "
            f"{_fmt(r['draft_forwards_per_token'], '.2f')} | {time} | {_fmt(r['of_oracle'], '.0%')} | {lossless} |"
        )
    return "\n".join(lines) + "\n"


def draft_length_histograms(records: list[dict], oracle_rows: list[dict]) -> dict[str, dict[int, int]]:
    hist = defaultdict(Counter)
    for r in list(records) + list(oracle_rows):
        hist[r["method"]].update(r["draft_lengths"])
    return {m: dict(sorted(h.items())) for m, h in hist.items() if h}


def write_plots(summary: list[dict], histograms: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    datasets = list(dict.fromkeys(r["dataset"] for r in summary))
    methods = list(dict.fromkeys(r["method"] for r in summary))
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(methods) * len(datasets) / 2), 4.5))
    width = 0.8 / len(datasets)
    for d_i, dataset in enumerate(datasets):
        values = {r["method"]: r["speedup"] for r in summary if r["dataset"] == dataset}
        xs = [m_i + d_i * width for m_i, m in enumerate(methods) if m in values]
        ax.bar(xs, [values[m] for m in methods if m in values], width, label=dataset)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(methods))], methods, rotation=45, ha="right")
    ax.set_ylabel("speedup over the target alone")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    if histograms:
        cols = min(4, len(histograms))
        rows = (len(histograms) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
        for ax, (method, hist) in zip(axes.flat, histograms.items()):
            ax.bar(list(hist), list(hist.values()))
            ax.set_title(method, fontsize=9)
            ax.set_xlabel("draft length")
        for ax in list(axes.flat)[len(histograms):]:
            ax.axis("off")
        fig.tight_layout()
        paths.append(out / "draft_lengths.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def verdict(summary: list[dict], out: Path) -> str:
    """The run in one line: PACER's speedup over the target alone (all prompts), the best other method and its
    speedup, whether every method returned the target's own output, and where the files are."""
    rows = {r["method"]: r for r in summary if r["dataset"] == "all" and r["method"] not in ORACLES}
    end_to_end = next((r for r in summary if r["dataset"] == "all" and r["method"] == END_TO_END_ORACLE), None)
    target = rows.get("target")
    others = {name: r for name, r in rows.items() if name not in ("target", "pacer")}
    parts = []
    if "pacer" in rows:
        pacer = rows["pacer"]
        rate = f" ({pacer['tokens_per_s']:.1f} tokens/s, the target alone {target['tokens_per_s']:.1f})" if target else ""
        bound = "" if end_to_end is None else f"; the oracle with the measured prefills {end_to_end['speedup']:.2f}x"
        parts.append(f"PACER {pacer['speedup']:.2f}x the target alone{rate}{bound}")
    else:
        parts.append("PACER not run (no head)")
    if others:
        best = max(others.values(), key=lambda r: r["speedup"])
        ahead = "" if "pacer" not in rows else (" (PACER ahead)" if rows["pacer"]["speedup"] > best["speedup"] else " (ahead of PACER)")
        parts.append(f"best other: {best['method']} {best['speedup']:.2f}x{ahead}")
    compared = [r for r in rows.values() if not r.get("own_numerics") and not r.get("sampled")]
    prompts = target["prompts"] if target else 0
    if any(r.get("sampled") for r in rows.values()):
        parts.append("sampled: outputs are draws, not compared")
    elif all(r["mismatches"] == 0 for r in compared):
        parts.append(f"every method lossless (the target's own output on all {prompts} prompts)")
    else:
        bad = ", ".join(f"{r['method']} ({r['mismatches']}/{r['prompts']})" for r in compared if r["mismatches"])
        parts.append(f"NOT LOSSLESS: {bad} differ from the target alone")
    parts.append(f"files in {out}/")
    return "; ".join(parts)


def write_report(out: Path, records: list[dict], oracle_rows: list[dict], meta: dict) -> dict:
    """Write `results.json`, `results.md` and the PNG plots into `out`; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records, oracle_rows)
    histograms = draft_length_histograms(records, oracle_rows)
    table = markdown_table(summary) + peer_notes(summary)
    if meta.get("llama_server"):
        table += f"\nllama.cpp's server: build {meta['llama_server']}\n"
    for name, message in (meta.get("failed") or {}).items():  # a method that died: said under the table
        table += f"\n**{name} failed** (no rows): {message}\n"
    (out / "results.md").write_text(f"Command: `{meta.get('command', '')}`\n\n" + table)
    payload = dict(meta=meta, summary=summary, draft_length_histograms=histograms, records=records, oracle=oracle_rows)
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    plots = write_plots(summary, histograms, out)
    files = [out / "results.json", out / "results.md", *plots]
    return dict(summary=summary, table=table, files=files, verdict=verdict(summary, out))
