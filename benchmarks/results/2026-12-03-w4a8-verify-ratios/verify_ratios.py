"""Issue 28's first test, measured several times in one process: the w4a8 target's forward of 1, 4 and 8 tokens after
a cached 128-token prefix (costs.measure_costs: sizes interleaved in rounds, median of 5), six curves a few seconds
apart; each curve's 4- and 8-token costs over its one-token cost."""
import statistics

import torch

from modeling_pacer.costs import fixed_prefix, measure_costs
from modeling_pacer.pairs.loading import load_pair

torch.set_num_threads(2)
pair = load_pair(quantize_target="w4a8")
prefix = fixed_prefix(pair.target)
print("| curve | 1 token, ms | 4 tokens, ms | 8 tokens, ms | 4 / 1 | 8 / 1 |")
print("|---|---|---|---|---|---|")
ratios = []
for i in range(6):
    costs = measure_costs(pair.target, pair.draft, None, prefix, 8)
    one, four, eight = (costs.target(n) for n in (1, 4, 8))
    ratios.append((four / one, eight / one))
    print(f"| {i + 1} | {1e3 * one:.1f} | {1e3 * four:.1f} | {1e3 * eight:.1f} | {four / one:.2f}x | {eight / one:.2f}x |")
print(f"| median | | | | {statistics.median(r[0] for r in ratios):.2f}x | {statistics.median(r[1] for r in ratios):.2f}x |")
