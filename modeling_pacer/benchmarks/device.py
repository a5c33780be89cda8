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
SETTINGS = ("plain", "fixed-rows", "fixed-rows-eager", "rows-alone")


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


def measure_device(shapes, settings=SETTINGS, *, device="cuda", dtype=torch.bfloat16, rows: int = 16,
                   prefixes=(37, 256), repeats: int = 5, log=print) -> dict:
    """For each shape and setting: row agreement and the cost curve (see the module's docstring). Returns
    `{"shapes": {shape: {setting: {"agreement": {prefix: {k: diff}}, "curve_ms": {k: ms}, "exact": bool}}}}`."""
    from ..costs import device_name, fixed_prefix
    from ..exact import exact_candidates, undo_exact
    from ..gpu.fixed_rows import row_agreement

    results = {}
    for shape in shapes:
        t0 = time.perf_counter()
        model = random_model(shape, dtype, device)
        attention = model.config._attn_implementation
        candidates = exact_candidates(rows)
        results[shape] = {"build_seconds": time.perf_counter() - t0}
        for setting in settings:
            if setting != "plain":
                candidates[setting](model)
            agreement = {}
            for length in prefixes:
                agreement[str(length)] = {str(k): v for k, v in row_agreement(
                    model, fixed_prefix(model, length), sizes=range(1, rows + 1)).items()}
            curve = forward_curve(model, fixed_prefix(model, max(prefixes)), rows, repeats)
            exact = all(v == 0.0 for per_prefix in agreement.values() for v in per_prefix.values())
            results[shape][setting] = dict(agreement=agreement, exact=exact,
                                           curve_ms={str(k): 1000 * s for k, s in curve.items()})
            log(f"pacer-bench device: {shape} {setting}: exact={exact}, ms " +
                ", ".join(f"{k}: {1000 * s:.1f}" for k, s in curve.items() if k in (1, 2, 4, 8, 16, rows)))
            undo_exact(model, attention)
        del model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return dict(shapes=results, device=str(device), device_name=device_name(device) or "cpu", dtype=str(dtype),
                rows=rows, prefixes=list(prefixes), repeats=repeats, torch=torch.__version__)


def markdown(report: dict) -> str:
    """`device.md`: per shape and setting, exact or not (the largest difference), and the curve relative to one token."""
    rows = report["rows"]
    ks = [k for k in (1, 2, 4, 8, 12, 16) if k <= rows]
    lines = [f"Command: `{report['command']}`", "",
             f"Device: {report['device_name']} ({report['device']}), {report['dtype']}, torch {report['torch']}; "
             f"row agreement after prefixes of {report['prefixes']} tokens; forwards timed after "
             f"{max(report['prefixes'])} tokens, median of {report['repeats']} interleaved rounds, synchronized.", "",
             "| shape | setting | exact 1..%d + prefill | largest difference | " % rows
             + " | ".join(f"{k} tok ms" for k in ks) + f" | {min(8, rows)} / 1 |",
             "|---|---|---|---|" + "---|" * (len(ks) + 1)]
    for shape, settings in report["shapes"].items():
        for setting, r in settings.items():
            if not isinstance(r, dict):
                continue
            worst = max(v for per in r["agreement"].values() for v in per.values())
            curve = r["curve_ms"]
            lines.append(f"| {shape} | {setting} | {'yes' if r['exact'] else 'no'} | {worst:.3g} | "
                         + " | ".join(f"{curve[str(k)]:.2f}" for k in ks)
                         + f" | {curve[str(min(8, rows))] / curve['1']:.2f}x |")
    return "\n".join(lines) + "\n"


def run_device(args) -> dict:
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    report = measure_device(args.shapes, args.settings, device=args.device, dtype=dtype, rows=args.rows,
                            prefixes=tuple(args.prefixes), repeats=args.repeats,
                            log=lambda line: print(line, file=sys.stderr, flush=True))
    report.update(run_meta(getattr(args, "argv", None)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device.json").write_text(json.dumps(report, indent=1))
    (out / "device.md").write_text(markdown(report))
    print(markdown(report))
    print(f"pacer-bench: wrote {out / 'device.json'}, {out / 'device.md'}")
    return report
