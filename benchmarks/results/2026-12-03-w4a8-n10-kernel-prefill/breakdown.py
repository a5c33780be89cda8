"""Where each method's time went in this run (results.json): the prompts' prefills (each run's first forward of each
model), the other forwards of the target and the draft, and the rest (heads, the loop), summed over the 30 prompts."""
import json
from collections import Counter, defaultdict
from pathlib import Path

run = json.loads((Path(__file__).parent / "results.json").read_text())
sums = defaultdict(Counter)
for r in run["records"]:
    for key in ("seconds", "target_seconds", "draft_seconds", "head_seconds", "target_prefill_seconds",
                "draft_prefill_seconds", "target_forwards", "draft_forwards", "new_tokens"):
        sums[r["method"]][key] += r.get(key) or 0
    sums[r["method"]]["prompts"] += 1
costs = run["meta"]["costs"]
print(f"cost curve of the run: target 1 token {1e3 * costs['target_forward']['1']:.1f} ms, "
      f"draft {1e3 * costs['draft_forward']:.1f} ms")
print()
print("| method | seconds | target prefills | draft prefills | other target forwards (ms each) | "
      "other draft forwards (ms each) | the rest |")
print("|---|---|---|---|---|---|---|")
for method, s in sums.items():
    if not s["target_forwards"]:
        print(f"| {method} | {s['seconds']:.1f} | – | – | – | – | – |")
        continue
    n = s["prompts"]
    target_rest, draft_rest = s["target_seconds"] - s["target_prefill_seconds"], s["draft_seconds"] - s["draft_prefill_seconds"]
    target_each = 1e3 * target_rest / (s["target_forwards"] - n)
    draft_each = f" ({1e3 * draft_rest / (s['draft_forwards'] - n):.1f})" if s["draft_forwards"] else ""
    rest = s["seconds"] - s["target_seconds"] - s["draft_seconds"]
    print(f"| {method} | {s['seconds']:.1f} | {s['target_prefill_seconds']:.1f} | {s['draft_prefill_seconds']:.1f} | "
          f"{target_rest:.1f} ({target_each:.1f}) | {draft_rest:.1f}{draft_each} | {rest:.1f} |")
print()
alone = sums["target"]
for method in ("pacer", "svip"):
    s = sums[method]
    decode = (alone["seconds"] - alone["target_prefill_seconds"]) / (
        s["seconds"] - s["target_prefill_seconds"] - s["draft_prefill_seconds"])
    print(f"{method}: decoding alone (both runs without their prefills) {decode:.2f}x the target alone")
