"""Analyses of a finished run's `results.json`, without the models: where each method's time went, and paired
per-prompt comparisons of two methods. Pure functions of the file's records; `pacer-bench breakdown` and
`pacer-bench paired` print and write them."""

from __future__ import annotations

from collections import Counter, defaultdict

from .report import speedup_interval

_SUMMED = ("seconds", "target_seconds", "draft_seconds", "head_seconds", "target_prefill_seconds",
           "draft_prefill_seconds", "target_forwards", "draft_forwards", "new_tokens")


def time_breakdown(records: list[dict]) -> list[dict]:
    """Per method, summed over its prompts: total seconds, the prompts' prefills (each run's first forward of each
    model), the target's and the draft's other forwards (seconds, and ms each) and the rest (heads, the loop), and
    decoding alone against the target alone (both without their prefills)."""
    sums: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        for key in _SUMMED:
            sums[r["method"]][key] += r.get(key) or 0
        sums[r["method"]]["prompts"] += 1
    alone = sums.get("target")
    rows = []
    for method, s in sums.items():
        row = dict(method=method, prompts=s["prompts"], seconds=s["seconds"])
        if s["target_forwards"]:  # methods of another runtime (llama.cpp) time no forwards
            n = s["prompts"]
            prefills = s["target_prefill_seconds"] + s["draft_prefill_seconds"]
            row.update(
                target_prefill=s["target_prefill_seconds"], draft_prefill=s["draft_prefill_seconds"],
                target_other=s["target_seconds"] - s["target_prefill_seconds"],
                draft_other=s["draft_seconds"] - s["draft_prefill_seconds"],
                rest=s["seconds"] - s["target_seconds"] - s["draft_seconds"],
            )
            row["target_ms_each"] = 1e3 * row["target_other"] / max(s["target_forwards"] - n, 1)
            row["draft_ms_each"] = (1e3 * row["draft_other"] / max(s["draft_forwards"] - n, 1)
                                    if s["draft_forwards"] else None)
            if alone is not None and s["seconds"] > prefills:
                row["decoding_speedup"] = (alone["seconds"] - alone["target_prefill_seconds"]) / (s["seconds"] - prefills)
        rows.append(row)
    return rows


def breakdown_table(rows: list[dict]) -> str:
    lines = ["| method | seconds | target prefills | draft prefills | other target forwards (ms each) | "
             "other draft forwards (ms each) | the rest | decoding alone vs the target alone |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "target_other" not in r:
            lines.append(f"| {r['method']} | {r['seconds']:.1f} | – | – | – | – | – | – |")
            continue
        draft_each = "" if r["draft_ms_each"] is None else f" ({r['draft_ms_each']:.1f})"
        decoding = f"{r['decoding_speedup']:.2f}x" if "decoding_speedup" in r else "–"
        lines.append(f"| {r['method']} | {r['seconds']:.1f} | {r['target_prefill']:.1f} | {r['draft_prefill']:.1f} | "
                     f"{r['target_other']:.1f} ({r['target_ms_each']:.1f}) | {r['draft_other']:.1f}{draft_each} | "
                     f"{r['rest']:.1f} | {decoding} |")
    return "\n".join(lines) + "\n"


def paired_comparison(records: list[dict], method: str, other: str, resamples: int = 2000, seed: int = 0) -> dict:
    """`method` against `other` over the prompts both ran: the ratio of summed seconds (> 1: `method` faster), its 95%
    bootstrap interval over prompts (each prompt's two times kept together) and on how many prompts it was faster."""
    seconds = {(r["dataset"], r["prompt_id"], r["method"]): r["seconds"] for r in records}
    prompts = sorted({(d, p) for d, p, m in seconds if m == method} & {(d, p) for d, p, m in seconds if m == other})
    if not prompts:
        known = sorted({m for _, _, m in seconds})
        raise ValueError(f"No prompt was run by both {method!r} and {other!r}; the file's methods: {known}.")
    pairs = [(seconds[p + (other,)], seconds[p + (method,)]) for p in prompts]
    return dict(method=method, other=other, prompts=len(pairs),
                ratio=sum(o for o, _ in pairs) / sum(m for _, m in pairs),
                interval=speedup_interval(pairs, resamples, seed),
                faster_on=sum(m < o for o, m in pairs))


def paired_table(rows: list[dict]) -> str:
    lines = ["| method | against | speedup, paired (95% CI over prompts) | faster on |", "|---|---|---|---|"]
    for r in rows:
        ci = "" if r["interval"] is None else f" ({r['interval'][0]:.3f}-{r['interval'][1]:.3f})"
        lines.append(f"| {r['method']} | {r['other']} | {r['ratio']:.3f}x{ci} | {r['faster_on']}/{r['prompts']} prompts |")
    return "\n".join(lines) + "\n"
