"""Paired per-prompt comparison of PACER with other methods in the two sampled runs: ratio of summed seconds
and a 95% bootstrap interval over prompts (2,000 resamples, seed 0).

    python benchmarks/results/2026-12-02-sampling-n10-t1.0/paired.py
"""
import json, sys, random
for path in sys.argv[1:] or ["benchmarks/results/2026-12-02-sampling-n10-t1.0/results.json", "benchmarks/results/2026-12-02-sampling-n10-t0.7/results.json"]:
    d = json.load(open(path)); sec = {}
    for r in d["records"]: sec[(r["dataset"], r["prompt_id"], r["method"])] = r["seconds"]
    prompts = sorted({(k[0], k[1]) for k in sec})
    for a, b in [("pacer", "throughput"), ("pacer", "hf-assisted"), ("pacer", "specdec++")]:
        pairs = [(sec[p + (b,)], sec[p + (a,)]) for p in prompts]
        ratio = sum(x for x, _ in pairs) / sum(y for _, y in pairs)
        rng = random.Random(0); boots = []
        for _ in range(2000):
            s = [rng.choice(pairs) for _ in pairs]; boots.append(sum(x for x, _ in s) / sum(y for _, y in s))
        boots.sort()
        print(path.split("/")[-2], f"{a} vs {b}: {ratio:.3f} ({boots[50]:.3f}-{boots[1949]:.3f}), faster on {sum(y < x for x, y in pairs)}/{len(pairs)} prompts")
