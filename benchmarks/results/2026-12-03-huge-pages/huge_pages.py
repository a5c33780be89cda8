"""A/B: the w4a8 target's and the int4 draft's steps with weights on transparent huge pages (load_pair now) and on
4 KiB pages (a deep copy), interleaved."""
import copy, statistics, time
import torch
from transformers import DynamicCache
from modeling_pacer.custom_generate.generate import cache_kwargs
from modeling_pacer.pairs.loading import load_pair
torch.set_num_threads(2)
def anon_huge():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"): return line.strip()
pair = load_pair(quantize_target="w4a8")
print("after load:", anon_huge(), flush=True)
models = {"target huge": pair.target, "draft huge": pair.draft}
models["target 4k"] = copy.deepcopy(pair.target)
models["draft 4k"] = copy.deepcopy(pair.draft)
print("after copies:", anon_huge(), flush=True)
prompt = torch.randint(100, 20000, (1, 128))
caches = {}
with torch.no_grad():
    for name, m in models.items():
        caches[name] = DynamicCache(config=m.config)
        m(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_kwargs(m, caches[name]))
    times = {(name, rows): [] for name in models for rows in ((1, 4) if "target" in name else (1, 2))}
    for _ in range(12):
        for (name, rows) in times:
            m, c = models[name], caches[name]
            t = time.perf_counter()
            m(input_ids=prompt[:, :rows], use_cache=True, logits_to_keep=rows, **cache_kwargs(m, c))
            times[(name, rows)].append(time.perf_counter() - t)
            c.crop(-rows)
for key, v in times.items():
    v = sorted(v)[2:]
    print(key, "median %.1f ms" % (statistics.median(v) * 1e3), "q1-q3 %.1f-%.1f" % (v[len(v)//4]*1e3, v[3*len(v)//4]*1e3))
