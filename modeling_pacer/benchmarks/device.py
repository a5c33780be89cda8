"""`pacer-bench device`: what exact verification costs on the device that runs it, and whether it is exact there.

No real weights reach a lent GPU, so the models are built from the real configurations' shapes with random weights
([`QWEN25_SHAPES`]): cost depends on the shapes alone, and random weights make near-ties common (a stricter test of
exactness than a trained model's peaked distributions). For each shape and each way to exact verification
([`modeling_pacer.exact.exact_candidates`], and the model as loaded, "plain"), it measures

- row agreement ([`modeling_pacer.gpu.fixed_rows.row_agreement`]): the largest logit difference between a call of
  k = 1..rows tokens and k single steps, after a short and a long prefix, and a prefill's last row (0.0: bitwise);
- the cost curve: a forward of k = 1..rows tokens after a cached prefix, the median of interleaved rounds, timed with
  the device synchronized ([`modeling_pacer.costs.device_clock`]).

It writes `device.json` and `device.md` to `--out`. On a CPU (`--shapes tiny --device cpu`) it runs the same code in
seconds, which is how CI tests it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from ..custom_generate.costs import CostModel
from .provenance import run_meta

# the published Qwen2.5 configurations' shapes (the Coder models share them); vocabularies as their configs give them
QWEN25_SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # for tests on a CPU: the same code in seconds
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
SETTINGS = ("plain", "fixed-rows", "fixed-rows-eager", "rows-alone", "captured", "fixed-rows-captured")
# "captured": the model as loaded, its one-token step captured (`modeling_pacer.capture`): the target alone as a user
# runs it fast, and the draft's step; "fixed-rows-captured": the exact target's one row shape captured
CAPTURED_ROWS = (1,)


def random_model(shape: str, dtype: torch.dtype = torch.bfloat16, device="cpu", seed: int = 0, vocab_size=None):
    """A Qwen2 causal LM of one of [`QWEN25_SHAPES`] with random weights, built on `device` in `dtype`, eval mode
    (`vocab_size` overrides the shape's, e.g. a draft and a target made to share one)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = dict(QWEN25_SHAPES[shape])
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    config = Qwen2Config(**fields, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         use_sliding_window=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def forward_curve(model, prefix: torch.LongTensor, max_tokens: int, repeats: int) -> dict[int, float]:
    """Seconds of a forward of 1..`max_tokens` tokens after the cached `prefix`, median of `repeats` interleaved
    rounds (one warm-up round excluded), the device synchronized at every clock reading: the cost model's target
    curve ([`modeling_pacer.costs.measure_costs`]) without a draft."""
    from ..costs import measure_costs

    return measure_costs(model, None, None, prefix, max_tokens, repeats).target_forward


@torch.no_grad()
def kernel_ms(model, prefix: torch.LongTensor, tokens: int, calls: int = 20) -> float | None:
    """Milliseconds of GPU kernel time in one forward of `tokens` tokens after the cached `prefix` (the profiler's sum
    over `calls` forwards, divided), or None off CUDA: what a step would cost if launching cost nothing."""
    if prefix.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    from ..custom_generate.steps import crop_cache, model_forward, new_cache

    cache = new_cache(model, prefix.shape[1] + tokens + 1)
    model_forward(model, prefix, cache, 1)
    feed = prefix[:, -1:].repeat(1, tokens)

    def step():
        model_forward(model, feed, cache, tokens)
        crop_cache(cache, prefix.shape[1])

    for _ in range(3):  # warm: a captured call is recorded here
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return sum(event.self_device_time_total for event in prof.key_averages()) / calls / 1000


def measure_device(shapes, settings=SETTINGS, *, device="cuda", dtype=torch.bfloat16, rows: int = 16,
                   prefixes=(37, 256), repeats: int = 5, capture_backend: str = "inductor", log=print,
                   checkpoint=None) -> dict:
    """For each shape and setting: row agreement and the cost curve (see the module's docstring), and where the
    device is a GPU the kernels' own time at 1 and `rows` tokens ([`kernel_ms`]). Returns `{"shapes": {shape:
    {setting: {"agreement": {prefix: {k: diff}}, "curve_ms": {k: ms}, "exact": bool, "kernel_ms": {k: ms}}}}}`.
    `capture_backend`: the captured settings' torch.compile backend ("inductor" with mode="reduce-overhead", or
    "cudagraphs": the eager kernels recorded as they are, compiled in seconds). `checkpoint(results)`, if given, is
    called after each setting with what was measured so far (a run cut short keeps it)."""
    from transformers import CompileConfig

    from ..costs import device_name, fixed_prefix
    from ..exact import exact_candidates, undo_exact
    from ..gpu.captured import capture, uncapture
    from ..gpu.fixed_rows import row_agreement

    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=capture_backend)

    results = {}
    for shape in shapes:
        t0 = time.perf_counter()
        model = random_model(shape, dtype, device)
        attention = model.config._attn_implementation
        candidates = exact_candidates(rows)
        results[shape] = {"build_seconds": time.perf_counter() - t0}
        for setting in settings:
            t0 = time.perf_counter()
            captured = setting.endswith("captured")
            exact_way = setting.removesuffix("-captured") if setting != "captured" else "plain"
            if exact_way != "plain":
                candidates[exact_way](model)
            if captured:
                capture(model, rows=CAPTURED_ROWS, compile_config=compile_config)
            agreement = {}
            for length in prefixes:
                agreement[str(length)] = {str(k): v for k, v in row_agreement(
                    model, fixed_prefix(model, length), sizes=range(1, rows + 1), static=captured).items()}
            curve = forward_curve(model, fixed_prefix(model, max(prefixes)), rows, repeats)
            kernels = {str(k): kernel_ms(model, fixed_prefix(model, max(prefixes)), k) for k in sorted({1, rows})}
            exact = all(v == 0.0 for per_prefix in agreement.values() for v in per_prefix.values())
            results[shape][setting] = dict(agreement=agreement, exact=exact, kernel_ms=kernels,
                                           curve_ms={str(k): 1000 * s for k, s in curve.items()},
                                           seconds=time.perf_counter() - t0)
            log(f"pacer-bench device: {shape} {setting}: exact={exact}, ms " +
                ", ".join(f"{k}: {1000 * s:.1f}" for k, s in curve.items() if k in (1, 2, 4, 8, 16, rows))
                + (f"; kernels alone at 1 token {kernels['1']:.2f} ms" if kernels["1"] is not None else ""))
            if checkpoint is not None:
                checkpoint(results)
            if captured:
                uncapture(model)
            undo_exact(model, attention)
        del model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return dict(shapes=results, device=str(device), device_name=device_name(device) or "cpu", dtype=str(dtype),
                rows=rows, prefixes=list(prefixes), repeats=repeats, torch=torch.__version__,
                capture_backend=capture_backend, captured_rows=list(CAPTURED_ROWS))


def layer_draft(target, layers: int, noise: float = 0.0, seed: int = 1):
    """A draft made of `target`'s first `layers` decoder layers, its embeddings, final norm and LM head (the weights
    copied; `noise` times each tensor's std of Gaussian noise added): what can travel to a GPU instead of a trained
    draft, cheaper than the target and agreeing with it part of the time."""
    import copy

    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    draft.config.layer_types = draft.config.layer_types[:layers] if getattr(draft.config, "layer_types", None) else None
    if noise:
        generator = torch.Generator(device=next(draft.parameters()).device).manual_seed(seed)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(noise * p.float().std().to(p.dtype) * torch.randn(p.shape, generator=generator, device=p.device,
                                                                         dtype=p.dtype))
    return draft.eval()


@torch.no_grad()
def end_to_end(shape: str, *, device="cuda", dtype=torch.bfloat16, draft_layers: int = 4, noise: float = 0.0,
               prompts: int = 3, prompt_tokens: int = 64, new_tokens: int = 128, rows: int = 16,
               capture_backend: str = "inductor", log=print) -> dict:
    """PACER against the target alone on this device, eager and captured: a random-weight target of `shape` made
    exact by `fixed_rows(rows)`, a [`layer_draft`] of its first `draft_layers` layers, the default rule without a
    head (`stopping_policy="throughput"`, its costs measured here). Per mode: tokens/s of each (the first prompt's
    runs are a warm-up, excluded), whether every output is the target alone's, drafted/accepted tokens."""
    from transformers import CompileConfig

    from .. import enable_pacer
    from ..custom_generate.steps import new_cache
    from ..gpu.captured import capture, uncapture
    from ..gpu.fixed_rows import fixed_rows
    from ..costs import device_clock

    model = random_model(shape, dtype, device)
    draft = layer_draft(model, draft_layers, noise)  # copied before the target's forward is wrapped
    target = enable_pacer(fixed_rows(model, rows))
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, vocab, (1, prompt_tokens), generator=generator).to(device) for _ in range(prompts + 1)]
    clock = device_clock(torch.device(device))
    report = dict(shape=shape, draft_layers=draft_layers, noise=noise, prompts=prompts, prompt_tokens=prompt_tokens,
                  new_tokens=new_tokens, rows=rows, modes={})
    for mode in ("eager", "captured"):
        if mode == "captured":
            config = CompileConfig(fullgraph=True, dynamic=False, backend=capture_backend)
            capture(target, compile_config=config)
            capture(draft, compile_config=config)
        seconds = {"target alone": 0.0, "pacer": 0.0}
        same, drafted, accepted = 0, 0, 0
        for i, ids in enumerate(inputs):
            start = clock()
            alone = target.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                    past_key_values=new_cache(target, prompt_tokens + new_tokens, static=mode == "captured"))
            middle = clock()
            out = target.generate(ids, assistant_model=draft, stopping_policy="throughput", max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
            end = clock()
            if i == 0:
                continue  # the warm-up: compilation, graphs recorded, costs measured
            seconds["target alone"] += middle - start
            seconds["pacer"] += end - middle
            same += bool(torch.equal(out.sequences, alone))
            drafted += sum(st.drafted for st in out.pacer_stats.steps)
            accepted += sum(st.accepted for st in out.pacer_stats.steps)
        tokens = prompts * new_tokens
        result = dict(tokens_per_s={k: tokens / v for k, v in seconds.items()}, identical=f"{same}/{prompts}",
                      drafted=drafted, accepted=accepted, speedup=seconds["target alone"] / seconds["pacer"])
        report["modes"][mode] = result
        log(f"pacer-bench device --e2e: {shape} {mode}: target alone {result['tokens_per_s']['target alone']:.1f} "
            f"tok/s, pacer {result['tokens_per_s']['pacer']:.1f} tok/s ({result['speedup']:.2f}x), identical "
            f"{result['identical']}, accepted {accepted}/{drafted}")
        if mode == "captured":
            uncapture(target)
            uncapture(draft)
    return report


# (the target's setting, the draft's setting) a projection prices: the exact target and the draft, captured or eager
PAIR_SETTINGS = {"captured": ("fixed-rows-captured", "captured"), "eager": ("fixed-rows", "plain")}


def pair_costs(report: dict, draft_shape: str = "0.5b") -> dict:
    """Cost models for replaying CPU traces at this device's costs (`pacer-bench replay --costs`): for each measured
    target shape other than `draft_shape` and each of [`PAIR_SETTINGS`] measured, the exact target's curve and the
    draft's one-token step, as `CostModel.to_dict()`, with `alone_ms`: the plain target's one-token step in the same
    mode (what a user runs without pacer, not exact). Name -> that dict."""
    shapes, out = report["shapes"], {}
    draft = shapes.get(draft_shape, {})
    for target_shape, settings in shapes.items():
        if target_shape == draft_shape:
            continue
        for mode, (target_setting, draft_setting) in PAIR_SETTINGS.items():
            plain = "captured" if mode == "captured" else "plain"
            if not all(isinstance(x, dict) for x in (settings.get(target_setting), draft.get(draft_setting),
                                                     settings.get(plain))):
                continue
            curve = {int(k): ms / 1000 for k, ms in settings[target_setting]["curve_ms"].items()}
            costs = CostModel(curve, draft[draft_setting]["curve_ms"]["1"] / 1000, 0.0).to_dict()
            out[f"{target_shape}-{draft_shape}-{mode}"] = dict(costs, alone_ms=settings[plain]["curve_ms"]["1"])
    return out


def markdown(report: dict) -> str:
    """`device.md`: per shape and setting, exact or not (the largest difference), and the curve relative to one token."""
    rows = report["rows"]
    ks = [k for k in (1, 2, 4, 8, 12, 16) if k <= rows]
    lines = [f"Command: `{report['command']}`", "",
             f"Device: {report['device_name']} ({report['device']}), {report['dtype']}, torch {report['torch']}; "
             f"row agreement after prefixes of {report['prefixes']} tokens; forwards timed after "
             f"{max(report['prefixes'])} tokens, median of {report['repeats']} interleaved rounds, synchronized.", "",
             "Captured settings: torch.compile backend %s; the setting \"captured\" captures one-token calls only "
             "(its longer calls run eagerly). Kernels: the profiler's GPU kernel time of a one-token call." % report.get(
                 "capture_backend", "inductor"), "",
             "| shape | setting | exact 1..%d + prefill | largest difference | " % rows
             + " | ".join(f"{k} tok ms" for k in ks) + f" | {min(8, rows)} / 1 | kernels 1 tok ms | 1 tok / kernels |",
             "|---|---|---|---|" + "---|" * (len(ks) + 3)]
    for shape, settings in report["shapes"].items():
        for setting, r in settings.items():
            if not isinstance(r, dict):
                continue
            worst = max(v for per in r["agreement"].values() for v in per.values())
            curve = r["curve_ms"]
            lines.append(f"| {shape} | {setting} | {'yes' if r['exact'] else 'no'} | {worst:.3g} | "
                         + " | ".join(f"{curve[str(k)]:.2f}" for k in ks)
                         + f" | {curve[str(min(8, rows))] / curve['1']:.2f}x | "
                         + (f"{kern:.2f} | {curve['1'] / kern:.2f}x |" if (kern := r.get("kernel_ms", {}).get("1")) else "- | - |"))
    e2e = report.get("end_to_end")
    if e2e:
        lines += ["", f"End to end: the exact {e2e['shape']}-shaped target (fixed rows of {e2e['rows']}) alone and under "
                  f"PACER (the default rule, no head) with a draft of its first {e2e['draft_layers']} layers, "
                  f"{e2e['prompts']} random prompts of {e2e['prompt_tokens']} tokens, {e2e['new_tokens']} new tokens "
                  "each (a warm-up prompt excluded).", "",
                  "| steps | target alone tok/s | PACER tok/s | speedup | identical to the target alone | accepted / drafted |",
                  "|---|---|---|---|---|---|"]
        for mode, r in e2e["modes"].items():
            lines.append(f"| {mode} | {r['tokens_per_s']['target alone']:.1f} | {r['tokens_per_s']['pacer']:.1f} | "
                         f"{r['speedup']:.2f}x | {r['identical']} | {r['accepted']} / {r['drafted']} |")
    return "\n".join(lines) + "\n"


def run_device(args) -> dict:
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "device.partial.json"  # what was measured so far, for a run cut short
    report = measure_device(args.shapes, args.settings, device=args.device, dtype=dtype, rows=args.rows,
                            prefixes=tuple(args.prefixes), repeats=args.repeats, capture_backend=args.capture_backend,
                            log=lambda line: print(line, file=sys.stderr, flush=True),
                            checkpoint=lambda results: partial.write_text(json.dumps(results, indent=1)))
    if args.e2e:
        report["end_to_end"] = end_to_end(args.e2e, device=args.device, dtype=dtype, draft_layers=args.draft_layers,
                                          rows=args.rows, capture_backend=args.capture_backend,
                                          log=lambda line: print(line, file=sys.stderr, flush=True))
    report.update(run_meta(getattr(args, "argv", None)))
    partial.unlink(missing_ok=True)
    for name, costs in pair_costs(report).items():
        (out / "costs").mkdir(exist_ok=True)
        (out / "costs" / f"{name}.json").write_text(json.dumps(costs, indent=1))
    (out / "device.json").write_text(json.dumps(report, indent=1))
    (out / "device.md").write_text(markdown(report))
    print(markdown(report))
    print(f"pacer-bench: wrote {out / 'device.json'}, {out / 'device.md'}")
    return report
