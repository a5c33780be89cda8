"""The int4 draft against the same draft on pacer's VNNI kernels (W4A8Linear, each layer's input zero-padded from 896
to 1024 columns: the kernel takes multiples of 256), a decoding step after a 128-token prompt, rounds interleaved,
the first round excluded, median (ms); and how often the two drafts' greedy choices agree on 64 positions."""
import statistics, time, torch, torch.nn as nn, torch.nn.functional as F
from transformers import DynamicCache
from modeling_pacer.pairs.loading import load_draft, resolve_pair
from modeling_pacer.pairs.registry import DEFAULT_PAIR
from modeling_pacer.custom_generate.generate import cache_kwargs
from modeling_pacer.quantization import W4A8Linear, _replace, SUPER_BLOCK

class Padded(nn.Module):
    def __init__(self, linear):
        super().__init__()
        k = linear.in_features
        self.pad = -k % SUPER_BLOCK
        lin = nn.Linear(k + self.pad, linear.out_features, bias=linear.bias is not None)
        with torch.no_grad():
            lin.weight.zero_(); lin.weight[:, :k] = linear.weight.float()
            if linear.bias is not None: lin.bias.copy_(linear.bias.float())
        self.inner = W4A8Linear.from_linear(lin)
    def forward(self, x):
        return self.inner(F.pad(x, (0, self.pad)) if self.pad else x)

src = resolve_pair(DEFAULT_PAIR).draft
int4 = load_draft(src, torch.bfloat16, "int4")
w4 = load_draft(src, torch.bfloat16, None)
for name, m in list(w4.named_modules()):
    if type(m) is nn.Linear and m.out_features % 16 == 0:
        _replace(w4, name, Padded(m))
print(w4.model.layers[0].self_attn.q_proj, w4.lm_head)
P = 128; prompt = torch.randint(0, int4.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(0))

@torch.no_grad()
def steps(model, n=20):
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    tok = torch.tensor([[5]]); out = []
    for i in range(n):
        t = time.perf_counter(); lg = model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits; out.append(time.perf_counter() - t)
        tok = lg[:, -1:].argmax(-1)
    return out
res = {"int4": [], "w4a8 padded": []}
for r in range(4):
    res["int4"] += steps(int4); res["w4a8 padded"] += steps(w4)
for k, v in res.items(): print(k, f"{statistics.median(v[20:]) * 1e3:.1f} ms")
with torch.no_grad():
    ids = prompt[:, :64]
    a, b = int4(input_ids=ids).logits[0].float(), w4(input_ids=ids).logits[0].float()
print("argmax agreement int4 vs w4a8 over 64 positions", float((a.argmax(-1) == b.argmax(-1)).float().mean()))
