# llama.cpp's cost of a forward of n tokens after a cached prefix (llama-cpp-python, the target's Q4_K_M GGUF)
import time, statistics, sys
from pathlib import Path
import llama_cpp
G = Path.home() / ".cache/pacer/gguf"
for name in ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct-q4.gguf"):
    llm = llama_cpp.Llama(model_path=str(G / name), n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
    prefix = [(i * 7919) % 150000 for i in range(128)]
    llm.reset(); llm.eval(prefix)
    res = {}
    for rnd in range(6):
        for n in (1, 2, 4, 8, 16):
            llm.n_tokens = 128
            llm._ctx.kv_cache_seq_rm(-1, 128, -1) if hasattr(llm._ctx, "kv_cache_seq_rm") else None
            t = time.perf_counter(); llm.eval(prefix[-n:]); dt = time.perf_counter() - t
            if rnd: res.setdefault(n, []).append(dt)
    base = statistics.median(res[1])
    print(name, " ".join(f"n={n}: {1000*statistics.median(v):.1f} ms ({statistics.median(v)/base:.2f}x)" for n, v in res.items()))
