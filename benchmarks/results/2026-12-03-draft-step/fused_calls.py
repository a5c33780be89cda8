"""The draft's linear layers at one row on torch's int4 kernel, as they are (per decoder layer q, k, v, o, gate, up,
down: 7 calls) against fused (qkv, o, gate-up, down: 4 calls), 24 layers' worth of distinct random weights plus
the LM head; rounds interleaved, median of 20 (ms). What fusing the projections would save, before building it."""
import statistics, time
import torch
from modeling_pacer.quantization import Int4Linear

torch.manual_seed(0)
H, KV, I, V, LAYERS = 896, 128, 4864, 151936, 24  # Qwen2.5-0.5B
lin = lambda i, o: Int4Linear.from_linear(torch.nn.Linear(i, o, bias=False))  # noqa: E731
plain = [[lin(H, H), lin(H, KV), lin(H, KV), lin(H, H), lin(H, I), lin(H, I), lin(I, H)] for _ in range(LAYERS)]
fused = [[lin(H, H + 2 * KV), lin(H, H), lin(H, 2 * I), lin(I, H)] for _ in range(LAYERS)]
head = lin(H, V)
x, xi = torch.randn(1, H, dtype=torch.bfloat16), torch.randn(1, I, dtype=torch.bfloat16)


@torch.no_grad()
def run(layers):
    start = time.perf_counter()
    for layer in layers:
        for m in layer:
            m(xi if m.in_features == I else x)
    head(x)
    return (time.perf_counter() - start) * 1e3


times = {"7 calls a layer (as today)": [], "4 calls a layer (qkv, gate-up fused)": []}
for _ in range(3):
    run(plain), run(fused)
for _ in range(20):
    times["7 calls a layer (as today)"].append(run(plain))
    times["4 calls a layer (qkv, gate-up fused)"].append(run(fused))
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
print("| linear layers of one draft step, 1 row | ms |\n|---|---|")
for name, t in times.items():
    print(f"| {name} | {statistics.median(t):.1f} |")
