"""The int4 draft's decoding step (one token after a 128-token prompt): eager on pacer's attention kernel (as
load_draft runs it, DynamicCache), eager on sdpa with a StaticCache, and torch.compile of the latter. Median of
20 steps, rounds interleaved (ms)."""
import statistics, time, sys
import torch
from transformers import DynamicCache, StaticCache
from modeling_pacer.pairs.loading import load_draft, resolve_pair
from modeling_pacer.pairs.registry import DEFAULT_PAIR
from modeling_pacer.custom_generate.generate import cache_kwargs

torch.manual_seed(0)
src = resolve_pair(DEFAULT_PAIR).draft
live = load_draft(src, torch.bfloat16, "int4")
plain = load_draft(src, torch.bfloat16, "int4", attn_implementation="sdpa")
V, P = live.config.vocab_size, 128
prompt = torch.randint(0, V, (1, P))

@torch.no_grad()
def live_steps(n):
    cache = DynamicCache(config=live.config)
    live(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_kwargs(live, cache))
    out = []
    tok = torch.tensor([[5]])
    for i in range(n):
        t = time.perf_counter(); live(input_ids=tok, use_cache=True, **cache_kwargs(live, cache)); out.append(time.perf_counter() - t)
    return out

static = StaticCache(config=plain.config, max_cache_len=P + 64)
def step(ids, pos):
    return plain(input_ids=ids, past_key_values=static, cache_position=pos, use_cache=True).logits
compiled = torch.compile(step, mode=sys.argv[1] if len(sys.argv) > 1 else "default", dynamic=False)

@torch.no_grad()
def static_steps(fn, n):
    static.reset()
    plain(input_ids=prompt, past_key_values=static, cache_position=torch.arange(P), use_cache=True, logits_to_keep=1)
    out = []
    tok = torch.tensor([[5]])
    for i in range(n):
        pos = torch.tensor([P + i])
        t = time.perf_counter(); fn(tok, pos); out.append(time.perf_counter() - t)
    return out

t = time.perf_counter(); static_steps(compiled, 3); print(f"compile + 3 steps: {time.perf_counter() - t:.1f} s", flush=True)
with torch.no_grad():
    a = step(torch.tensor([[5]]), torch.tensor([P + 3])); b = compiled(torch.tensor([[5]]), torch.tensor([P + 3]))
print("compiled vs eager logits max diff", float((a.float() - b.float()).abs().max()))
res = {"live (pacer attention, DynamicCache)": [], "sdpa, StaticCache, eager": [], "sdpa, StaticCache, torch.compile": []}
for r in range(3):
    res["live (pacer attention, DynamicCache)"] += live_steps(20)
    res["sdpa, StaticCache, eager"] += static_steps(step, 20)
    res["sdpa, StaticCache, torch.compile"] += static_steps(compiled, 20)
for k, v in res.items():
    print(f"| {k} | {statistics.median(v) * 1e3:.1f} |")
