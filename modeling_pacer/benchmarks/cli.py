"""`pacer-bench`: methods x datasets x prompts on a model pair; JSON, a Markdown table and PNG plots.

    pacer-bench run --quick                               # a few minutes on a CPU (`run` may be left out)
    pacer-bench run --n 10 --max-new-tokens 128 --head path/to/head --out bench-out
    pacer-bench run --record-traces traces.safetensors ...   # also record full traces for replay
    pacer-bench run --do-sample --temperature 1 ...            # sampled decoding's speed (seeded)
    pacer-bench replay traces.safetensors --head path/to/head  # evaluate stopping rules without the models
    pacer-bench merge a/results.json b/results.json --out all  # one report from runs split by dataset
    pacer-bench costs --dtypes bfloat16 float32 --out costs    # this machine's cost curves, measured and plotted
    pacer-bench kernel-rows --rows 16                          # one quantized layer at 1..16 rows: what bounds verification
    pacer-bench batch --batch-sizes 1 2 4 8 --n 10             # throughput: the prompts decoded B at a time
    pacer-bench agreement --quantize-target int4 --n 10        # a quantized target's greedy agreement with bf16
    pacer-bench draft-agreement --quantize-draft --aligned-draft adapters/qwen2.5-coder-0.5b-aligned   # before/after

Every argument is checked before a model is loaded.
"""

import argparse
import fnmatch
import json
import re
import sys
from pathlib import Path

import torch

from modeling_pacer.pairs import PairArguments, add_pair_arguments
from modeling_pacer.prompts import DATASETS
from modeling_pacer.extras import MissingExtra, require
from modeling_pacer.resources import ensure_writable_folder, portable_path

from .provenance import run_meta

# `--quick`: the 30-prompt benchmark's methods and length on its first prompt of each dataset, the shortest run
# that reproduced that benchmark's ranking (at 32 tokens the prompt's prefill, the same for every method, hides it)
QUICK_METHODS = ["target", "hf-assisted", "fixed-4", "svip", "specdec++", "pacer"]
QUICK_NEW_TOKENS = 96
COMMANDS = ("run", "replay", "merge", "breakdown", "paired", "costs", "agreement", "draft-agreement", "device", "space",
            "kernel-rows", "batch", "overlap", "llama-costs")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _layer_shape(text: str) -> tuple[int, int]:
    """`IN x OUT` (e.g. 1536x8960): a linear layer's in_features and out_features."""
    try:
        k, n = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected IN x OUT, e.g. 1536x8960") from None
    if k <= 0 or n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: both sizes must be positive")
    return k, n


def _rule_settings(text: str) -> dict:
    """A `--rules` value: a rule's settings as JSON, checked as far as can be without a cost curve or a head."""
    from modeling_pacer.custom_generate.policies import policy_from_dict

    try:
        settings = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from None
    try:
        policy_from_dict(settings, costs=_SettingsCheck())
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return settings


class _SettingsCheck:
    """A cost model's stand-in while `--rules` settings are checked (the traces carry the real ones)."""

    def step(self, drafted: int, head_calls: int = 0, free: int = 0) -> float:
        return 1.0


def _add_output(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--out", default=default, help="output folder (created; checked writable before any work)")


def _add_method_choice(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", help="a trained PacerHead folder or repo id (default: the pair's head, if pacer ships "
                   "one); head-based methods are skipped without one")
    p.add_argument("--methods", nargs="+", help="method names or globs (e.g. 'fixed-*'); default: all")
    p.add_argument("--gammas", type=_positive, nargs="+", default=[1, 2, 3, 4, 5, 6],
                   help="draft lengths for fixed/constant methods")
    p.add_argument("--oracle-max-draft", type=_positive, default=8, help="longest draft the oracle may choose")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pacer-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")

    run = sub.add_parser("run", help="run every method on real prompts, interleaved (the default command)")
    add_pair_arguments(run)
    _add_method_choice(run)
    run.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    run.add_argument("--n", type=_positive, default=10, help="prompts per dataset (the first n)")
    run.add_argument("--max-new-tokens", type=_positive, default=128)
    run.add_argument("--record-traces", metavar="FILE",
                     help="also record full per-position draft traces (safetensors) for `pacer-bench replay`")
    run.add_argument("--trace-max-draft", type=_positive, default=12, help="draft length recorded per position")
    run.add_argument("--do-sample", action="store_true",
                     help="sampled decoding (every method, exactly --max-new-tokens tokens, no top-k, --top-p): a speed "
                          "row for sampling; outputs are draws, so they are not compared with the target's")
    run.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --do-sample)")
    run.add_argument("--top-p", type=float, default=1.0,
                     help="with --do-sample: sample from the smallest set of tokens holding this share of the "
                          "probability (transformers' top_p; 1.0, the default, keeps every token)")
    run.add_argument("--seed", type=int, default=0, help="with --do-sample: prompt i's runs start from seed + i")
    run.add_argument("--quick", action="store_true",
                     help=f"1 prompt per dataset, {QUICK_NEW_TOKENS} tokens, methods {QUICK_METHODS}, a one-line verdict")
    run.add_argument("--threads", type=_positive, help="torch CPU threads (default: torch's choice)")
    _add_output(run, "bench-out")

    replay = sub.add_parser("replay", help="evaluate stopping rules on recorded traces, without the models")
    replay.add_argument("traces", metavar="FILE", nargs="+", help="trace files from `pacer-bench run --record-traces`")
    _add_method_choice(replay)
    replay.add_argument("--rules", nargs="+", type=_rule_settings, default=[], metavar="JSON",
                        help="also replay these rules, each as its settings (StoppingPolicy.to_dict()), e.g. "
                             "'{\"name\": \"throughput\", \"calibration\": 4.0}': variants of a rule beside the methods")
    replay.add_argument("--costs", metavar="JSON", help="price every trace at this cost model instead of the one its run "
                        "measured (CostModel.to_dict(); e.g. a GPU's, from `pacer-bench device`'s costs/ folder): a "
                        "projection of the recorded acceptance onto another machine")
    replay.add_argument("--alone-ms", type=float, metavar="MS", help="the target alone's one-token step in ms, where "
                        "the baseline is not the cost model's target(1) (default: the cost file's alone_ms, if any)")
    _add_output(replay, "replay-out")

    merge = sub.add_parser("merge", help="one report from runs over disjoint prompts (e.g. one run per dataset)")
    merge.add_argument("results", metavar="RESULTS", nargs="+", help="results.json files; each prompt's ratios stay "
                       "within the run that measured them")
    merge.add_argument("--methods", nargs="+", help="only these methods (exact names), e.g. those every run measured")
    _add_output(merge, "bench-out")

    breakdown = sub.add_parser("breakdown", help="where each method's time went in a run: prefills, the other "
                               "forwards of each model, the rest; decoding alone against the target alone")
    breakdown.add_argument("results", metavar="RESULTS", help="a results.json of `pacer-bench run` or `merge`")
    _add_output(breakdown, "breakdown-out")

    paired = sub.add_parser("paired", help="one method against others, paired per prompt: the ratio of summed seconds "
                            "with its 95%% bootstrap interval over prompts")
    paired.add_argument("results", metavar="RESULTS", nargs="+", help="results.json files (each compared on its own)")
    paired.add_argument("--method", default="pacer", help="the method compared (default: pacer)")
    paired.add_argument("--against", nargs="+", required=True, help="the methods it is compared with")
    _add_output(paired, "paired-out")

    from .kernel_rows import PATHS as KERNEL_PATHS

    costs = sub.add_parser("costs", help="measure this machine's cost curves (target verification of 1..n tokens, "
                           "draft, head) for one or more target dtypes, cached, and plot them")
    add_pair_arguments(costs)
    costs.add_argument("--dtypes", nargs="+", default=None,
                       help="target settings to measure (each loads the pair once): dtypes, or int4 / int4+int8 / w4a8 "
                            "(a bf16 target with 4-bit weights, as --quantize-target), e.g. bfloat16 int4 float32; "
                            "default: bfloat16 float32, or the --quantize-target setting alone")
    costs.add_argument("--head", help="a PacerHead folder or repo id whose call is timed (default: the pair's head)")
    costs.add_argument("--max-tokens", type=_positive, default=12, help="verification forwards of 1..max-tokens tokens")
    costs.add_argument("--compare-exact", action="store_true",
                       help="measure every dtype with and without exact verification (the cost of invariance)")
    costs.add_argument("--refresh", action="store_true", help="measure again even where this host's curve is cached")
    costs.add_argument("--split", action="store_true",
                       help="also split the time of a target forward of 1 and 8 tokens and a draft step between linear "
                            "layers, attention and the rest (a fused model: its layers' two kernel calls and cache update, its LM "
                            "head, the rest), beside the memory floor (weight bytes / this host's bandwidth), measured "
                            "now (not cached)")
    costs.add_argument("--repeat", type=_positive, default=1,
                       help="also measure this many fresh curves in a row (not cached) and report each curve's cost of "
                            "4, 8 and 16 tokens over one, with the medians: how much one curve of this host varies")
    costs.add_argument("--kernel-paths", nargs="+", choices=list(KERNEL_PATHS), default=["default"],
                       help="with --repeat: the fresh curves of each kernel path, interleaved: default (AMX tiles "
                       f"from {KERNEL_PATHS['default']} rows where the CPU has them), vnni (never the tiles), amx (the "
                       "tiles from one row); the same bits on every path")
    costs.add_argument("--threads", type=_positive, help="torch CPU threads (default: torch's choice)")
    _add_output(costs, "costs-out")

    agreement = sub.add_parser("agreement", help="a quantized target (--quantize-target) against the same model in "
                               "bf16: greedy agreement and perplexity on the benchmark prompts")
    add_pair_arguments(agreement)
    agreement.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    agreement.add_argument("--n", type=_positive, default=10, help="prompts per dataset (the first n)")
    agreement.add_argument("--max-new-tokens", type=_positive, default=96)
    agreement.add_argument("--threads", type=_positive, help="torch CPU threads (default: torch's choice)")
    _add_output(agreement, "agreement-out")

    drafts = sub.add_parser("draft-agreement", help="the draft's next-token agreement with the target's greedy output "
                            "on the benchmark prompts; with --aligned-draft, the plain and the aligned draft side by side")
    add_pair_arguments(drafts)
    drafts.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    drafts.add_argument("--n", type=_positive, default=10, help="prompts per dataset (the first n)")
    drafts.add_argument("--max-new-tokens", type=_positive, default=128)
    drafts.add_argument("--batch-size", type=_positive, default=8,
                        help="prompts the (exact) target generates together")
    drafts.add_argument("--lookup", action="store_true",
                        help="also: how often a lookup in the sequence (pacer_lookup's free drafts), by match length, "
                             "proposes the target's next tokens at the positions where one is found")
    drafts.add_argument("--threads", type=_positive, help="torch CPU threads (default: torch's choice)")
    _add_output(drafts, "draft-agreement-out")

    from .device import QWEN25_SHAPES, SETTINGS

    device = sub.add_parser("device", help="on this device (a GPU), random-weight models of the Qwen2.5 shapes: whether "
                            "each way to exact verification is exact there, and the cost curve of each")
    device.add_argument("--shapes", nargs="+", choices=list(QWEN25_SHAPES), default=["0.5b", "1.5b", "7b"])
    device.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    device.add_argument("--device", default="cuda", help="torch device (default cuda)")
    device.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    device.add_argument("--rows", type=_positive, default=16, help="verification calls of 1..rows tokens")
    device.add_argument("--prefixes", type=_positive, nargs="+", default=[37, 256],
                        help="prefix lengths the rows are compared after (the curve is timed after the longest)")
    device.add_argument("--repeats", type=_positive, default=5)
    device.add_argument("--e2e", choices=list(QWEN25_SHAPES), metavar="SHAPE",
                        help="also PACER end to end against the exact target alone of this shape, eager and captured, "
                             "with a draft of its first --draft-layers layers")
    device.add_argument("--draft-layers", type=_positive, default=4)
    device.add_argument("--capture-backend", choices=("inductor", "cudagraphs"), default="inductor",
                        help="torch.compile backend of the captured settings (inductor: mode reduce-overhead; "
                             "cudagraphs: the eager kernels recorded, compiled in seconds)")
    _add_output(device, "device-out")

    space = sub.add_parser("space", help="the Space's target alone against the same call outside it, interleaved: "
                           "does the page show each side at its own speed (the default pair)")
    space.add_argument("--prompt", choices=("code", "maths", "chat"), default="code", help="one of the page's examples")
    space.add_argument("--method", default="PACER", help="the page's method beside the target alone")
    space.add_argument("--max-new-tokens", type=_positive, default=128)
    space.add_argument("--rounds", type=_positive, default=3)
    space.add_argument("--threads", type=_positive, help="torch CPU threads (default: torch's choice)")
    _add_output(space, "space-out")

    from .kernel_rows import KINDS, TARGET_ATTENTION, TARGET_SHAPES

    rows = sub.add_parser("kernel-rows", help="one of pacer's quantized layers (w4a8, w8a8) on this CPU for 1..rows rows: "
                          "its cost curve, the bandwidth of one row, the best multiply-add rate, and the least ratio "
                          "that rate allows (what bounds verification of many tokens)")
    rows.add_argument("--kinds", nargs="*", choices=KINDS, default=list(KINDS),
                      help="layer kinds to time (none: only the attention of --attention-keys)")
    rows.add_argument("--shapes", nargs="+", type=_layer_shape, default=[list(s) for s in TARGET_SHAPES],
                      metavar="INxOUT", help="layer shapes (default: the 1.5B target's: 1536x1536 1536x256 1536x8960 "
                      "8960x1536)")
    rows.add_argument("--rows", type=_positive, default=16, help="calls of 1..rows rows")
    rows.add_argument("--repeats", type=_positive, default=15, help="interleaved rounds (the median is reported)")
    rows.add_argument("--stream-mb", type=_positive, default=256,
                      help="copies of each layer until their weights pass this many MB, so that they stream from memory")
    rows.add_argument("--paths", nargs="+", choices=list(KERNEL_PATHS), default=["default"],
                      help="which kernel paths to time, interleaved: default (AMX tiles from "
                      f"{KERNEL_PATHS['default']} rows where the CPU has "
                      "them), vnni (never the tiles), amx (the tiles from one row); the same bits on every path")
    rows.add_argument("--attention-keys", nargs="+", type=_positive, metavar="N",
                      help="also time the exact attention kernel for 1..rows rows ending a sequence of N keys, each N")
    rows.add_argument("--attention-heads", nargs=3, type=_positive, default=list(TARGET_ATTENTION),
                      metavar=("HEADS", "KV_HEADS", "HEAD_DIM"), help="the attention's shape (default: the 1.5B target's)")
    rows.add_argument("--threads", type=_positive, help="torch CPU threads (default: torch's choice)")
    _add_output(rows, "kernel-rows-out")

    from .batch import BATCH_METHODS, DEFAULT_BATCH_METHODS

    batch = sub.add_parser("batch", help="throughput at several batch sizes: the prompts decoded B at a time (left-padded "
                           "batches), every method on each batch, interleaved; tokens per second of all rows, the "
                           "latency a sequence sees, every row checked against the target alone")
    add_pair_arguments(batch)
    batch.add_argument("--head", help="the PacerHead whose default rule the pacer method runs (default: the pair's)")
    batch.add_argument("--methods", nargs="+", choices=BATCH_METHODS, default=list(DEFAULT_BATCH_METHODS),
                       help="default: every method but llama.cpp (opt-in: the llamacpp extra, the target's GGUF)")
    batch.add_argument("--batch-sizes", nargs="+", type=_positive, default=[1, 2, 4, 8], metavar="B")
    batch.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    batch.add_argument("--n", type=_positive, default=10, help="prompts per dataset (the first n)")
    batch.add_argument("--max-new-tokens", type=_positive, default=96)
    batch.add_argument("--threads", type=_positive, help="torch CPU threads (default: torch's choice)")
    _add_output(batch, "batch-out")

    overlap = sub.add_parser("overlap", help="whether the draft drafting while the target verifies (PEARL) can pay here: "
                             "each model's step on one core alone and both at once, on every core, and the memory "
                             "bandwidth one and two cores reach (two processes, one a model)")
    add_pair_arguments(overlap)
    overlap.add_argument("--draft-tokens", type=_positive, default=3,
                         help="k: the draft steps a verification of k + 1 tokens overlaps (default 3)")
    overlap.add_argument("--seconds", type=float, default=2.0, help="each case's timed loop, a round (default 2)")
    overlap.add_argument("--rounds", type=_positive, default=3, help="interleaved rounds; medians over them (default 3)")
    _add_output(overlap, "overlap-out")

    llama_costs = sub.add_parser("llama-costs", help="llama.cpp's cost curve (llama-cpp-python) on the pair's GGUF files: "
                                 "a forward of n tokens after a cached prefix, as `costs` measures torch's")
    add_pair_arguments(llama_costs)
    llama_costs.add_argument("--sizes", type=_positive, nargs="+", default=[1, 2, 4, 8, 16], help="the n measured")
    llama_costs.add_argument("--repeats", type=_positive, default=5, help="interleaved rounds; medians over them")
    llama_costs.add_argument("--threads", type=_positive, help="llama.cpp's threads (default: torch's count)")
    _add_output(llama_costs, "llama-costs-out")
    return p


def apply_presets(args) -> None:
    """`--quick`: one prompt per dataset, `QUICK_NEW_TOKENS` new tokens, `QUICK_METHODS` unless methods are named.
    `costs` without `--dtypes`: the `--quantize-target` setting alone, else bfloat16 and float32."""
    if getattr(args, "quick", False):
        args.n, args.max_new_tokens = 1, QUICK_NEW_TOKENS
        args.methods = args.methods or QUICK_METHODS
    if args.command == "costs" and args.dtypes is None:
        args.dtypes = [args.quantize_target] if args.quantize_target else ["bfloat16", "float32"]


def validate(args) -> None:
    """Raise ValueError naming the first argument that cannot work, before anything expensive runs."""
    from modeling_pacer.prompts import prompt_file

    from .methods import LLAMA_CPP, all_methods, select_methods

    if args.command in ("breakdown", "paired"):  # every file readable before anything is written
        paths = [args.results] if args.command == "breakdown" else args.results
        files = {path: _read_results(path) for path in paths}
        if args.command == "paired":
            for path, data in files.items():
                methods = {r["method"] for r in data["records"]}
                for name in [args.method, *args.against]:
                    if name not in methods:
                        raise ValueError(f"{path} has no method {name!r}; it has {sorted(methods)}")
    if args.command == "space":
        require("demo", "pacer-bench space (it drives the Space)", ("gradio", "gradio_client", "pandas", "gguf"))
        from modeling_pacer.demo import METHODS

        if args.method not in METHODS or args.method == "target alone":
            raise ValueError(f"--method must be one of {[m for m in METHODS if m != 'target alone']}, got {args.method!r}")
    if args.command == "kernel-rows":
        from .kernel_rows import check_shapes

        check_shapes(args.kinds, [tuple(shape) for shape in args.shapes])
        from modeling_pacer.cpu.kernels import ATTENTION_SHAPES, attention_shape_ok

        if not attention_shape_ok(*args.attention_heads):
            raise ValueError(f"--attention-heads {' '.join(map(str, args.attention_heads))}: the kernel needs "
                             f"{ATTENTION_SHAPES}")
        if not args.kinds and not args.attention_keys:
            raise ValueError("--kinds with no kind times nothing: name a kind or give --attention-keys")
    if args.command == "device":
        import torch

        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device {args.device}: not a torch device") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device here (pass --device cpu --shapes tiny to try it)")
    head = getattr(args, "head", None)  # run, replay, costs
    if head is not None and not Path(head).exists() and not re.fullmatch(r"[\w.-]+/[\w.-]+", head):
        raise ValueError(f"--head {head}: no such folder, and not a Hub repo id (org/name).")
    llama_cpp_methods = [name for name, m in all_methods().items() if m.family in LLAMA_CPP]  # greedy only
    if args.command == "run" and args.do_sample and any(fnmatch.fnmatchcase(name, m) for m in args.methods or []
                                                         for name in llama_cpp_methods):
        # before the methods are resolved: resolving llama.cpp first asks for its library
        raise ValueError("--do-sample: the llama.cpp methods run greedy decoding only; leave them out of --methods.")
    if args.command in ("run", "replay"):
        chosen = select_methods(args.methods, all_methods(tuple(args.gammas)))  # unknown: an error
        if args.command == "run" and "target" not in [m.name for m in chosen]:
            raise ValueError("--methods must include 'target': every speedup is relative to the target alone.")
        vocab = [m.name for m in chosen if m.draft_vocab]
        if vocab and getattr(args, "draft_vocab", None):
            raise ValueError(f"{vocab} reduce the draft's full LM head in the run: leave out --draft-vocab "
                             f"{args.draft_vocab}, or those methods")
    if args.command == "agreement" and not args.quantize_target:
        raise ValueError("agreement compares a quantized target with its bf16 form: pass --quantize-target int4 "
                         "(or int4+int8, w4a8)")
    if args.command in ("run", "agreement", "draft-agreement", "batch"):
        require("bench", f"pacer-bench {args.command} (the prompt sets)", ("datasets",))
    if args.command in ("run", "costs", "agreement", "draft-agreement", "batch", "overlap") and (
            not args.target or str(args.target).endswith(".gguf") or getattr(args, "quantize_target", None)):
        require("bench", f"pacer-bench {args.command} on GGUF weights (the default pair's, or --quantize-target)",
                ("gguf",))
    if args.command in ("run", "costs", "agreement", "draft-agreement", "batch", "overlap"):
        # the names, checked (nothing loads), and the draft setting that runs: the pair's own unless one is named
        args.quantize_draft = PairArguments(args.pair, args.target, args.draft, args.quantize_draft, args.quantize_target,
                                            args.dtype, args.exact, args.aligned_draft,
                                            getattr(args, "draft_vocab", None)).quantize_draft
    if getattr(args, "aligned_draft", None) and not Path(args.aligned_draft).exists() \
            and not re.fullmatch(r"[\w.-]+/[\w.-]+", args.aligned_draft):
        raise ValueError(f"--aligned-draft {args.aligned_draft}: no such folder, and not a Hub repo id (org/name).")
    if args.command == "costs":
        from modeling_pacer.pairs.loading import TARGET_QUANTIZATIONS, resolve_dtype

        plain = [d for d in args.dtypes if d not in TARGET_QUANTIZATIONS and d not in ("bfloat16", "bf16")]
        if args.quantize_target and plain:
            # a 4-bit target computes in bf16: the plain dtypes would load after minutes of measuring, then fail
            raise ValueError(f"--quantize-target {args.quantize_target} runs the target in bfloat16, so --dtypes cannot "
                             f"also measure {' '.join(plain)}; drop --quantize-target and name every setting in "
                             f"--dtypes instead (e.g. --dtypes bfloat16 {args.quantize_target} {' '.join(plain)})")
        for dtype in args.dtypes:
            try:
                if dtype not in TARGET_QUANTIZATIONS:
                    resolve_dtype(dtype)
            except ValueError as error:
                raise ValueError(f"--dtypes: {error} (or one of {sorted(TARGET_QUANTIZATIONS)})") from None
    if args.command == "llama-costs":  # the library and the target's GGUF file, before anything is timed
        from .llamacpp import check_target_args, require_llama_cpp

        require_llama_cpp()
        check_target_args(args)
    if args.command == "overlap":
        import os

        if not args.seconds > 0:
            raise ValueError(f"--seconds must be positive, got {args.seconds}")
        if len(os.sched_getaffinity(0)) < 2:
            raise ValueError("pacer-bench overlap splits two cores between the models; this process may use "
                             f"{len(os.sched_getaffinity(0))}")
    if args.command == "batch":
        for dataset in args.datasets:
            prompt_file(dataset)
        if len(set(args.methods)) != len(args.methods):
            raise ValueError(f"--methods {' '.join(args.methods)}: a method named twice")
        if "llama.cpp" in args.methods:  # the library and the target's GGUF file, found before a model loads
            from .llamacpp import check_target_args, require_llama_cpp

            require_llama_cpp()
            check_target_args(args)
    if args.command == "run":
        if any(m.family in LLAMA_CPP for m in chosen):  # the GGUF files, found before a model loads
            from .llamacpp import check_target_args

            check_target_args(args, draft=any(m.speculation is not None for m in chosen))
        for dataset in args.datasets:
            prompt_file(dataset)  # PromptsNotInstalledError names the command that installs it
        if args.record_traces:
            ensure_writable_folder(Path(args.record_traces).resolve().parent, "--record-traces")
        if args.do_sample:
            from .methods import sampling_settings

            sampling_settings(args.temperature, args.top_p)  # a setting that cannot sample: the error names it
            if args.record_traces:
                raise ValueError("--record-traces follows the target's greedy output: run it without --do-sample.")
        elif args.temperature != 1.0:
            raise ValueError(f"--temperature {args.temperature} without --do-sample: greedy decoding has no temperature.")
        elif args.top_p != 1.0:
            raise ValueError(f"--top-p {args.top_p} without --do-sample: greedy decoding has no top-p.")
    files = getattr(args, "traces", None) or getattr(args, "results", None) or []
    for path in [files] if isinstance(files, str) else files:
        if not Path(path).is_file():
            raise ValueError(f"{path}: no such file.")
    ensure_writable_folder(Path(args.out))


def _setup(args):
    """`run`'s and `costs`' common start: torch's thread count, and the head (the pair's own by default)."""
    from modeling_pacer.pairs import DEFAULT_PAIR, default_head_path, resolve_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.head is None:  # the pair's own head (none once --draft replaces the pair's draft, or for another target)
        args.head = default_head_path(resolve_pair(args.target or args.pair or DEFAULT_PAIR, args.draft))
    return _load_head(args.head)


def _load_head(path):
    if path is None:
        return None
    from modeling_pacer import PacerHead

    return PacerHead.from_pretrained(path).eval()


def _llama_server_build(methods) -> str | None:
    """llama.cpp's build, as its server reports it, where a method of the run ran it."""
    if not any(m.family == "llama-server" for m in methods):
        return None
    from .llamaserver import server_binary, server_version

    return server_version(server_binary())


def _available_methods(args, head, costs=None, announce=False):
    from .methods import all_methods, select_methods

    available = all_methods(tuple(args.gammas), head.config if head is not None else None, costs,
                            do_sample=getattr(args, "do_sample", False))
    methods = select_methods(args.methods, available)
    skipped = [m.name for m in methods if m.needs_head and head is None]
    if skipped and announce:
        print(f"pacer-bench: skipping {skipped}: they need a trained head (--head)", file=sys.stderr)
    return [m for m in methods if not (m.needs_head and head is None)]


def _prompts(args, tokenizer):
    from modeling_pacer.prompts import apply_chat_template, load_prompts

    out = []
    for dataset in args.datasets:
        for prompt in load_prompts(dataset, args.n):
            out.append((dataset, str(prompt.id), apply_chat_template(tokenizer, prompt)))
    return out


def _print_result(result: dict) -> None:
    print(result["table"])
    print("pacer-bench: wrote " + ", ".join(str(path) for path in result["files"]))
    if "verdict" in result:
        print("pacer-bench verdict: " + result["verdict"])


def run(args) -> dict:
    from tqdm.auto import tqdm

    from modeling_pacer.pairs import pair_from_args

    from .methods import sampling_settings
    from .report import write_report
    from .runner import oracle_records, run_live
    from ..costs import host_costs
    from ..replay import record_trace, save_traces

    head = _setup(args)
    _available_methods(args, head, announce=True)  # says now, before the models load, which are skipped
    pair = pair_from_args(args)
    print(f"pacer-bench: {pair.describe()}", file=sys.stderr)
    # this machine's cost curve (cached per host, models and dtype): the oracle and cost-aware rules use it
    longest = head.config.max_draft_length if head is not None else 16  # the cost-aware rules' longest draft
    costs = host_costs(pair.target, pair.draft, head, max_tokens=max(args.oracle_max_draft, longest) + 1, check=True)
    methods = _available_methods(args, head, costs)
    _reduced_vocab_heads(methods, pair, head, max(args.oracle_max_draft, longest) + 1)
    prompts = _prompts(args, pair.tokenizer)
    with tqdm(total=len(prompts) * len(methods), desc="pacer-bench", unit="run") as bar:
        failures = {}
        records, traces = run_live(pair, head, methods, prompts, args.max_new_tokens, bar, args.oracle_max_draft,
                                   sampling=sampling_settings(args.temperature, args.top_p) if args.do_sample else None,
                                   seed=args.seed,
                                   failures=failures)
    oracle_rows = oracle_records(traces, costs, args.oracle_max_draft, records)
    meta = run_meta(args.argv, pair=pair.name,
                head=portable_path(args.head), max_new_tokens=args.max_new_tokens, threads=torch.get_num_threads(),
                quantize_draft=args.quantize_draft, aligned_draft=pair.aligned_draft, quantize_target=pair.quantize_target,
                fused_target=pair.fused_target,
                draft_vocab=args.draft_vocab, dtype=str(pair.dtype).removeprefix("torch."), exact=pair.exact,
                costs=costs.to_dict(), torch=torch.__version__,
                # the methods that decided on costs of their own (a reduced draft head's), by name
                method_costs={m.name: m.costs.to_dict() for m in methods if m.draft_vocab} or None,
                sampling=dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed) if args.do_sample else None,
                failed=failures or None, llama_server=_llama_server_build(methods))
    result = write_report(Path(args.out), [r.to_dict() for r in records], oracle_rows, meta)
    if args.record_traces:
        full = [
            record_trace(pair.draft, pair.target, input_ids, trace.output, args.trace_max_draft, dataset, prompt_id)
            for (dataset, prompt_id, input_ids), trace in tqdm(list(zip(prompts, traces)), desc="recording traces")
        ]
        save_traces(args.record_traces, full, costs, pair=pair.name)
    _print_result(result)
    return result


def _reduced_vocab_heads(methods, pair, head, max_tokens: int) -> None:
    """Each `pacer-*vocab-N` method's draft LM head over N tokens, made from the draft's own (the same bits for the
    kept tokens), and this machine's costs with that head: its cost-aware rule decides on its own draft step."""
    from ..costs import host_costs
    from ..draft_vocab import output_head, reduced_head

    built = {}
    for method in methods:
        if method.draft_vocab:
            if method.draft_vocab not in built:
                reduced = reduced_head(pair.draft, method.draft_vocab, tokenizer=pair.tokenizer)
                with output_head(pair.draft, reduced):
                    costs = host_costs(pair.target, pair.draft, head, max_tokens=max_tokens, check=True)
                built[method.draft_vocab] = reduced, costs
            method.draft_head, method.costs = built[method.draft_vocab]


def _rule_method(settings: dict):
    """A `--rules` entry as a replayable method, named by its settings."""
    from modeling_pacer.custom_generate.policies import policy_from_dict

    from .methods import Method

    label = settings["name"] + "(" + ", ".join(f"{k}={v}" for k, v in settings.items() if k != "name") + ")"
    needs_head = policy_from_dict(settings, costs=_SettingsCheck()).needs_head
    return Method(label, "pacer", lambda costs: policy_from_dict(settings, costs), needs_head=needs_head, needs_costs=True)


def _given_costs(args):
    """`(CostModel from --costs or None, the target alone's step in ms or None)`, checked before any trace is read."""
    from ..custom_generate.costs import CostModel

    alone_ms = getattr(args, "alone_ms", None)
    if alone_ms is not None and alone_ms <= 0:
        raise ValueError(f"--alone-ms must be positive, got {alone_ms}")
    if not getattr(args, "costs", None):
        return None, alone_ms
    try:
        fields = json.loads(Path(args.costs).read_text())
        costs = CostModel.from_dict({k: fields[k] for k in ("target_forward", "draft_forward", "head_call")})
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--costs {args.costs}: not a cost model (CostModel.to_dict()): {error}") from None
    if not costs.target_forward or min(costs.target_forward.values()) <= 0 or costs.draft_forward < 0:
        raise ValueError(f"--costs {args.costs}: costs must be positive")
    return costs, alone_ms if alone_ms is not None else fields.get("alone_ms")


def run_replay(args) -> dict:
    from ..replay import load_traces, oracle, replay

    # each file's traces are replayed with the cost model measured in the run that recorded them
    given, alone_ms = _given_costs(args)
    recorded = []
    for path in args.traces:
        saved = load_traces(path)
        if saved.costs is None and given is None:
            raise ValueError(f"{path} holds no cost model: replay needs the costs measured where it was recorded "
                             "(or --costs).")
        recorded += [(trace, given or saved.costs) for trace in saved.traces]
    head = _load_head(args.head)
    # a method that looks tokens up drafts from the live sequence, and one whose draft reads a window of the prompt
    # or computes fewer tokens drafts otherwise than the traces' draft did: none is replayed (nor a layerwise one:
    # its decisions are its method's, only its kernels' calls differ; nor one with the draft's prompt untiled)
    methods = [m for m in _available_methods(args, head, announce=True)
               if m.policy is not None and not m.lookup and not m.draft_window and not m.draft_vocab and not m.layerwise
               and not m.int8_prompt]
    rules = [_rule_method(settings) for settings in args.rules]
    if head is None and any(rule.needs_head for rule in rules):
        raise ValueError(f"--rules: {[r.name for r in rules if r.needs_head]} read a head: pass --head.")
    methods += rules
    # a method that may draft past the recorded drafts cannot be replayed on them: skipped, and said so
    recorded_draft = min(trace.token_probs.shape[1] for trace, _ in recorded) if recorded else 0
    longer = {m.name: m.make_policy(recorded[0][1]).max_draft_length for m in methods} if recorded else {}
    too_long = [name for name, length in longer.items() if length > recorded_draft]
    if too_long:
        print(f"pacer-bench: skipping {', '.join(f'{n} (up to {longer[n]})' for n in too_long)}: they may draft "
              f"more tokens than the traces hold ({recorded_draft}); record longer drafts (--trace-max-draft) to "
              "replay them", file=sys.stderr)
        methods = [m for m in methods if m.name not in too_long]
    rows = []
    for method in methods + [None]:
        seconds = alone = 0.0
        for trace, costs in recorded:
            result = oracle(trace, costs, args.oracle_max_draft) if method is None else replay(method.make_policy(costs), trace, costs, head)
            seconds += result.seconds
            # the target alone at its own step cost where that is not the cost model's one-token call
            alone += result.target_alone_seconds * (alone_ms / 1000 / costs.target(1) if alone_ms else 1.0)
        rows.append(dict(method="oracle" if method is None else method.name, replayed_speedup=alone / seconds))
    lines = ["| method | replayed speedup |", "|---|---|"] + [f"| {r['method']} | {r['replayed_speedup']:.2f}x |" for r in rows]
    print("\n".join(lines))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    meta = run_meta(args.argv, traces=len(recorded), alone_ms=alone_ms,
                costs=[c.to_dict() for c in {id(c): c for _, c in recorded}.values()])
    (Path(args.out) / "replay.json").write_text(json.dumps(dict(rows=rows, meta=meta), indent=1))
    (Path(args.out) / "replay.md").write_text(f"Command: `{meta['command']}`\n\n" + "\n".join(lines) + "\n")
    return dict(rows=rows)


def _repeat_table(repeats: dict[str, list[dict[int, float]]]) -> list[str]:
    import statistics

    lines = []
    for label, ratios in repeats.items():
        sizes = list(ratios[0])
        lines += [f"| {label}, curve | " + " | ".join(f"{k} / 1" for k in sizes) + " |", "|---|" + "---|" * len(sizes)]
        lines += [f"| {i + 1} | " + " | ".join(f"{r[k]:.2f}x" for k in sizes) + " |" for i, r in enumerate(ratios)]
        lines.append("| median | " + " | ".join(f"{statistics.median(r[k] for r in ratios):.2f}x" for k in sizes) + " |")
    return lines


def _split_tables(splits: dict, bandwidth: float) -> list[str]:
    """costs.md's split: one table for eager forwards (hooks on the modules), one for fused ones (a fused layer's
    kernel calls timed where they are made), each row beside its memory floor."""
    floor_words = ("against the memory floor: the weights it reads (every linear layer and norm, packed buffers "
                   f"included) over this host's read bandwidth measured now ({bandwidth / 1e9:.1f} GB/s, a sum over 1 GiB)")
    rows = [(label, role, t) for label, roles in splits.items() for role, t in roles.items()]
    tables = (
        ([r for r in rows if not r[2].get("fused")], ("linear", "attention", "other"),
         "Where a forward's time goes, ms (median of 5; linear layers, attention without its projections, the rest: "
         "norms, activations, embeddings, Python), " + floor_words,
         "linear | attention | rest"),
        ([r for r in rows if r[2].get("fused")], ("qkv_kernel", "cache_update", "rest_kernel", "linear", "other"),
         "Where a fused forward's time goes, ms (median of 5; summed over the layers: the kernel call that norms, "
         "projects q/k/v and rotates, transformers' cache update, the kernel call that attends and runs o_proj and "
         "the MLP; then the linear layers outside the layers (the LM head), the rest: embedding, final norm, "
         "Python), " + floor_words,
         "layers: norm + q/k/v kernel | layers: cache update | layers: attention + o + MLP kernel | LM head | rest"),
    )
    lines = []
    for chosen, keys, title, columns in tables:
        if not chosen:
            continue
        lines += ["", title + ":", "", f"| target setting | model, forward | weights MB | floor | {columns} | total | total / floor |",
                  "|---|---|---|---|" + "---|" * (len(keys) + 2)]
        for label, role, t in chosen:
            floor = t["weight_bytes"] / bandwidth
            lines.append(f"| {label} | {role} | {t['weight_bytes'] / 1e6:.0f} | {1000 * floor:.1f} | "
                         + " | ".join(f"{1000 * t[k]:.1f}" for k in (*keys, "total")) + f" | {t['total'] / floor:.2f}x |")
    return lines


def run_costs(args) -> dict:
    """Load the pair once per dtype, read or measure this host's cost curve, write costs.json/.md/.png."""
    import statistics

    from modeling_pacer.pairs import pair_from_args
    from modeling_pacer.pairs.loading import TARGET_QUANTIZATIONS

    from ..costs import fixed_prefix, host_costs, measure_bandwidth, measure_costs, time_split, weight_bytes
    from ..cpu import kernels
    from .kernel_rows import PATHS as KERNEL_PATHS

    if args.kernel_paths != ["default"] and args.repeat < 2:
        raise SystemExit("pacer-bench costs: --kernel-paths times fresh curves: give --repeat 2 or more")
    head = _setup(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {}
    splits = {}
    repeats = {}  # label -> each fresh curve's k-token cost over its one-token cost
    repeat_ms = {}  # label -> each fresh curve's seconds for 1..k tokens
    bandwidth = measure_bandwidth() if args.split else None
    quantize_target = args.quantize_target  # for the settings that are plain dtypes
    for dtype, exact in [(d, e) for d in args.dtypes for e in ((True, False) if args.compare_exact else (args.exact,))]:
        quantized = dtype in TARGET_QUANTIZATIONS  # int4 / int4+int8 / w4a8: a bf16 target with 4-bit weights
        args.dtype, args.exact = ("bfloat16" if quantized else dtype), exact
        args.quantize_target = dtype if quantized else quantize_target
        pair = pair_from_args(args)
        label = pair.setting
        costs = host_costs(pair.target, pair.draft, head, max_tokens=args.max_tokens, refresh=args.refresh)
        curves[label] = costs.to_dict()
        if args.split:
            splits[label] = {}
            for role, model, tokens in (("target", pair.target, 1), ("target", pair.target, min(8, args.max_tokens)),
                                        ("draft", pair.draft, 1)):
                split = time_split(model, fixed_prefix(model), tokens=tokens)
                split.update(tokens=tokens, weight_bytes=weight_bytes(model))
                splits[label][f"{role}, {tokens} token{'s' if tokens > 1 else ''}"] = split
        if args.repeat > 1:
            prefix, sizes = fixed_prefix(pair.target), [k for k in (4, 8, 16) if k <= args.max_tokens]
            paths = args.kernel_paths
            named = {path: label if paths == ["default"] else f"{label}, kernels: {path}" for path in paths}
            for path in paths:
                repeats[named[path]] = []
            for _ in range(args.repeat):
                for path in paths:  # interleaved: a slow moment of the host falls on every path alike
                    with kernels.amx_rows(KERNEL_PATHS[path]):
                        fresh = measure_costs(pair.target, None, None, prefix, max(sizes, default=1))
                    repeats[named[path]].append({k: fresh.target(k) / fresh.target(1) for k in sizes})
                    repeat_ms.setdefault(named[path], []).append({k: fresh.target(k) for k in range(1, max(sizes, default=1) + 1)})
        print(f"pacer-bench costs: {label}: target " + ", ".join(
            f"{n}: {1000 * t:.0f}" for n, t in costs.target_forward.items()) + f" ms; draft {1000 * costs.draft_forward:.0f} ms",
            file=sys.stderr)
        del pair
    meta = run_meta(args.argv, head=portable_path(args.head), quantize_draft=args.quantize_draft, draft_vocab=args.draft_vocab,
                bandwidth=bandwidth)
    meta.update(amx_tiles=kernels.available() and kernels.amx_available())
    (out / "costs.json").write_text(json.dumps(dict(curves=curves, splits=splits, repeats=repeats, repeat_ms=repeat_ms,
                                                    meta=meta), indent=1, default=str))
    tokens = range(1, args.max_tokens + 1)
    lines = [f"Command: `{meta['command']}` (host CPU: {meta['host']['cpu']}, {meta['host']['threads']} threads)", "",
             "Milliseconds per forward after a cached 128-token prefix (median of 5):", "",
             "| target | " + " | ".join(str(n) for n in tokens) + " | draft (1 token) | head |",
             "|---|" + "---|" * (len(tokens) + 2)]
    for label, c in curves.items():
        lines.append(f"| {label} | " + " | ".join(f"{1000 * c['target_forward'][n]:.0f}" for n in tokens)
                     + f" | {1000 * c['draft_forward']:.0f} | {1000 * c['head_call']:.1f} |")
    if splits:
        lines += _split_tables(splits, bandwidth)
    if repeats:
        lines += ["", f"{args.repeat} fresh curves in a row (the target alone, interleaved sizes, median of 5 each): "
                  "each curve's cost of k tokens over its cost of one, and the median over the curves:", ""]
        lines += _repeat_table(repeats)
        lines += ["", "The same curves' milliseconds (median over the curves):", "",
                  "| curves | " + " | ".join(str(k) for k in next(iter(repeat_ms.values()))[0]) + " |",
                  "|---|" + "---|" * len(next(iter(repeat_ms.values()))[0])]
        for label, curves_ms in repeat_ms.items():
            lines.append(f"| {label} | " + " | ".join(f"{1000 * statistics.median(c[k] for c in curves_ms):.1f}"
                                                      for k in curves_ms[0]) + " |")
    (out / "costs.md").write_text("\n".join(lines) + "\n")
    files = [out / "costs.json", out / "costs.md"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for label, c in curves.items():
            ax.plot(list(tokens), [1000 * c["target_forward"][n] for n in tokens], marker="o", label=f"target {label}")
        ax.set_xlabel("tokens in the target's forward (k drafted + 1)")
        ax.set_ylabel("ms per forward")
        ax.set_ylim(bottom=0)
        ax.set_title("Verification cost on this machine")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "costs.png", dpi=120)
        plt.close(fig)
        files.append(out / "costs.png")
    except ImportError:
        print("pacer-bench costs: matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
    print("\n".join(lines))
    print("pacer-bench: wrote " + ", ".join(str(f) for f in files))
    return dict(curves=curves, files=files)


def run_agreement(args) -> dict:
    """The quantized target's greedy output on each prompt, read by the bf16 target: agreement.json/.md."""
    from tqdm.auto import tqdm

    from modeling_pacer.exact import make_exact
    from modeling_pacer.pairs import pair_from_args
    from modeling_pacer.pairs.loading import load_model

    from .agreement import greedy_agreement, summarize

    if args.threads:
        torch.set_num_threads(args.threads)
    pair = pair_from_args(args)
    reference = load_model(pair.target_source, dtype=torch.bfloat16, pair_name=pair.name)
    if args.exact:
        make_exact(reference)
    rows = []
    for dataset, prompt_id, input_ids in tqdm(_prompts(args, pair.tokenizer), desc="pacer-bench agreement"):
        rows.append(dict(dataset=dataset, prompt_id=prompt_id,
                         **greedy_agreement(reference, pair.target, input_ids, args.max_new_tokens)))
    summary = summarize(rows)
    meta = run_meta(args.argv, pair=pair.name,
                model=pair.setting, reference="bfloat16" + (" exact" if args.exact else ""),
                max_new_tokens=args.max_new_tokens, threads=torch.get_num_threads(), torch=torch.__version__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"Command: `{meta['command']}`", "",
             f"The target with {pair.quantize_target} weights ({pair.setting}) writes greedily; the same target in "
             f"{meta['reference']} reads its text (modeling_pacer/benchmarks/agreement.py).", "",
             "| dataset | prompts | tokens | agree prefix (mean tokens) | next-token agreement | bf16 perplexity of the text |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['prompts']} | {r['tokens']} | {r['agree_prefix']:.1f} | {r['agreement']:.3f} | "
              f"{r['reference_perplexity']:.3f} |" for r in summary]
    (out / "agreement.json").write_text(json.dumps(dict(rows=rows, summary=summary, meta=meta), indent=1))
    (out / "agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"pacer-bench: wrote {out / 'agreement.json'}, {out / 'agreement.md'}")
    return dict(summary=summary)


def run_draft_agreement(args) -> dict:
    """The target's greedy output on each prompt, read teacher-forced by the draft (and by the aligned draft
    with --aligned-draft): draft_agreement.json/.md."""
    from tqdm.auto import tqdm

    from modeling_pacer.pairs import default_draft_dtype, load_draft, pair_from_args
    from modeling_pacer.training.pipeline import greedy_outputs, pad_token_id

    from .agreement import draft_agreement, lookup_agreement, summarize_drafts, summarize_lookups

    if args.threads:
        torch.set_num_threads(args.threads)
    aligned = args.aligned_draft
    pair = pair_from_args(argparse.Namespace(**{**vars(args), "aligned_draft": None}))
    drafts = {"plain": pair.draft}
    if aligned:
        drafts["aligned"] = load_draft(pair.draft_source, default_draft_dtype(args.quantize_draft, pair.dtype),
                                       args.quantize_draft, aligned, draft_vocab=args.draft_vocab,
                                       tokenizer=pair.tokenizer, pair_name=pair.name)
    prompts = list(_prompts(args, pair.tokenizer))
    pad = pad_token_id(pair)
    size = args.batch_size if pair.exact else 1  # only an exact target's batched outputs are its own greedy outputs
    rows, lookups = [], []
    with tqdm(total=len(prompts), desc="pacer-bench draft-agreement", unit="prompt") as bar:
        for first in range(0, len(prompts), size):
            batch = prompts[first : first + size]
            outputs = greedy_outputs(pair.target, [ids[0] for _, _, ids in batch], args.max_new_tokens, pad)
            for (dataset, prompt_id, input_ids), output in zip(batch, outputs):
                for name, draft in drafts.items():
                    rows.append(dict(draft=name, dataset=dataset, prompt_id=prompt_id,
                                     **draft_agreement(draft, input_ids, output)))
                if args.lookup:
                    lookups.append(dict(dataset=dataset, prompt_id=prompt_id, **lookup_agreement(input_ids, output)))
                bar.update(1)
    summary = summarize_drafts(rows)
    lookup_summary = summarize_lookups(lookups) if args.lookup else None
    meta = run_meta(args.argv, pair=pair.name,
                target=pair.setting, draft_quantization=args.quantize_draft, aligned_draft=aligned,
                max_new_tokens=args.max_new_tokens, threads=torch.get_num_threads(), torch=torch.__version__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"Command: `{meta['command']}`", "",
             f"The target ({pair.setting}) writes greedily; each draft"
             f"{f' ({args.quantize_draft} Linear layers)' if args.quantize_draft else ''} reads the text teacher-forced "
             "(modeling_pacer/benchmarks/agreement.py): agreement = share of the target's tokens that are the draft's "
             "greedy choice; run = mean agreeing tokens in a row from a position, at most 8.", "",
             "| draft | dataset | prompts | tokens | next-token agreement | run (of 8) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['draft']} | {r['dataset']} | {r['prompts']} | {r['tokens']} | {r['agreement']:.3f} | {r['run']:.2f} |"
              for r in summary]
    if lookup_summary is not None:
        lines += ["", "Lookups in the sequence (pacer_lookup's free drafts, every match length, the most recent occurrence, "
                  "16 tokens): at the positions of the target's output where the last `match` tokens occurred before "
                  "(found: share of positions), how often the token that followed them then is the target's next "
                  "(first), and how many in a row are (run).", "",
                  "| dataset | match | lookups | found | first | run |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['dataset']} | {r['match']} | {r['lookups']} | {r['found']:.1%} | {r['first']:.2f} | "
                  f"{r['run']:.2f} |" for r in lookup_summary]
    (out / "draft_agreement.json").write_text(json.dumps(dict(rows=rows, summary=summary, lookups=lookups,
                                                             lookup_summary=lookup_summary, meta=meta), indent=1))
    (out / "draft_agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"pacer-bench: wrote {out / 'draft_agreement.json'}, {out / 'draft_agreement.md'}")
    return dict(summary=summary)


def run_merge(args) -> dict:
    """One report from several runs' results.json (disjoint prompts); meta keeps every run's command and costs."""
    from .report import write_report

    parts = [json.loads(Path(path).read_text()) for path in args.results]
    if args.methods:  # keep only these methods (e.g. those every run measured)
        for part in parts:
            part["records"] = [r for r in part["records"] if r["method"] in args.methods]
    keys = {(r["dataset"], r["prompt_id"]) for part in parts for r in part["oracle"]}
    if len(keys) != sum(len(part["oracle"]) for part in parts):
        raise ValueError("--merge: the runs share prompts; merge only runs over disjoint prompts (e.g. one per dataset).")
    methods = [sorted({r["method"] for r in part["records"]}) for part in parts]
    if any(m != methods[0] for m in methods):
        raise ValueError(f"--merge: the runs compare different methods: {methods}; keep the common ones with --methods")
    meta = run_meta(args.argv, parts=[part["meta"] for part in parts],
                max_new_tokens=parts[0]["meta"].get("max_new_tokens"))
    result = write_report(Path(args.out), [r for part in parts for r in part["records"]],
                          [r for part in parts for r in part["oracle"]], meta)
    _print_result(result)
    return result


def _read_results(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable results.json ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path}: no `records` list: not a results.json of `pacer-bench run`")
    return data


def run_breakdown(args) -> dict:
    """Where each method's time went in one run (`analyses.time_breakdown`)."""
    from .analyses import breakdown_table, time_breakdown

    rows = time_breakdown(_read_results(args.results)["records"])
    out = Path(args.out)
    meta = run_meta(args.argv, results=portable_path(args.results))
    table = breakdown_table(rows)
    (out / "breakdown.json").write_text(json.dumps(dict(rows=rows, meta=meta), indent=1))
    (out / "breakdown.md").write_text(f"Command: `{meta['command']}`\n\n" + table)
    print(table)
    return dict(rows=rows)


def run_paired(args) -> dict:
    """`--method` against each of `--against`, paired per prompt, in each results file."""
    from .analyses import paired_comparison, paired_table

    rows = []
    for path in args.results:
        records = _read_results(path)["records"]
        for other in args.against:
            rows.append(dict(results=portable_path(path), **paired_comparison(records, args.method, other)))
    out = Path(args.out)
    meta = run_meta(args.argv)
    sections = [f"Command: `{meta['command']}`", ""]
    for path in args.results:
        sections += [f"{portable_path(path)}:", "", paired_table([r for r in rows if r["results"] == portable_path(path)])]
    (out / "paired.json").write_text(json.dumps(dict(rows=rows, meta=meta), indent=1))
    (out / "paired.md").write_text("\n".join(sections))
    print("\n".join(sections[2:]))
    return dict(rows=rows)


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check everything that can be checked without a model; `run` is the default command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    typed = list(argv)  # as the user typed it (recorded in the results), before `run` is made explicit
    if not argv or argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    parser = build_parser()
    for old, command in (("--replay", "replay"), ("--merge", "merge")):
        if old in argv:  # the flags of earlier versions
            parser.error(f"{old} is now a command of its own: pacer-bench {command} FILE... [options]")
    args = parser.parse_args(argv)
    args.argv = typed
    apply_presets(args)
    try:
        validate(args)
    except (ValueError, MissingExtra) as error:
        parser.error(str(error))
    return args


def _run_space(args) -> dict:
    from .space import run_space

    return run_space(args)


def _run_device(args) -> dict:
    from .device import run_device

    return run_device(args)


def run_batch(args) -> dict:
    from tqdm.auto import tqdm

    from modeling_pacer.pairs import pair_from_args
    from modeling_pacer.resources import write_json

    from .batch import OWN_NUMERICS, batch_table, run_batches, summarize_batches

    head = _setup(args)
    if "pacer" in args.methods and head is None:
        raise SystemExit("pacer-bench batch: the 'pacer' method runs the head's default rule: pass --head")
    pair = pair_from_args(args)
    print(f"pacer-bench: {pair.describe()}", file=sys.stderr)
    prompts = _prompts(args, pair.tokenizer)
    runs = len(prompts) + sum(-(-len(prompts) // b) for b in args.batch_sizes) * len(args.methods)
    with tqdm(total=runs, desc="pacer-bench batch", unit="call") as bar:
        records, references = run_batches(pair, head, prompts, args.batch_sizes, args.methods, args.max_new_tokens, bar)
    rows = summarize_batches([r.to_dict() for r in records])
    table = batch_table(rows)
    out = Path(args.out)
    meta = run_meta(args.argv, pair=pair.name, head=portable_path(args.head), max_new_tokens=args.max_new_tokens,
                    threads=torch.get_num_threads(), quantize_draft=args.quantize_draft,
                    quantize_target=pair.quantize_target, fused_target=pair.fused_target,
                    dtype=str(pair.dtype).removeprefix("torch."), exact=pair.exact, batch_sizes=args.batch_sizes)
    write_json(out / "batch.json", dict(meta=meta, records=[r.to_dict() for r in records], summary=rows,
                                        references=references))
    (out / "batch.md").write_text(table)
    lost = [r for r in rows if r["method"] not in OWN_NUMERICS and r["matches"] < r["sequences"]]
    result = dict(table=table, files=[out / "batch.json", out / "batch.md"], summary=rows)
    if lost:
        result["summary"] = [dict(r, dataset="all", mismatches=r["sequences"] - r["matches"]) for r in lost]
    _print_result(result)
    return result


def _run_llama_costs(args) -> dict:
    """llama.cpp's curve for the target's GGUF and, where it is one, the draft's: llama-costs.json and .md."""
    from modeling_pacer.pairs.gguf import source_gguf
    from modeling_pacer.pairs.loading import resolve_pair
    from modeling_pacer.pairs.registry import DEFAULT_PAIR

    from .llamacpp import llama_cpp_costs, target_gguf

    spec = resolve_pair(args.target or args.pair or DEFAULT_PAIR, args.draft)
    files = {"target": target_gguf(spec.target, pair_name=spec.name),
             "draft": source_gguf(spec.draft, pair_name=spec.name)}
    curves = {role: llama_cpp_costs(path, args.sizes, args.threads, repeats=args.repeats)
              for role, path in files.items() if path is not None}
    meta = run_meta(args.argv, files={role: Path(p).name for role, p in files.items() if p is not None},
                    threads=args.threads or torch.get_num_threads())
    lines = ["| model | " + " | ".join(f"{n} tokens (ms, x one)" for n in args.sizes) + " |",
             "|---|" + "---|" * len(args.sizes)]
    for role, curve in curves.items():
        lines.append(f"| {role} ({meta['files'][role]}) | " + " | ".join(
            f"{1000 * curve[n]:.1f} ({curve[n] / curve[min(curve)]:.2f}x)" for n in sorted(curve)) + " |")
    table = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llama-costs.json").write_text(json.dumps(dict(curves=curves, meta=meta), indent=1))
    (out / "llama-costs.md").write_text(f"Command: `{meta['command']}`\n\n" + table)
    result = dict(table=table, files=[out / "llama-costs.json", out / "llama-costs.md"])
    _print_result(result)
    return result


def _run_overlap(args) -> dict:
    from .overlap import run_overlap

    result = run_overlap(args)
    _print_result(result)
    return result


def _run_kernel_rows(args) -> dict:
    from .kernel_rows import run_kernel_rows

    return run_kernel_rows(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = {"run": run, "replay": run_replay, "merge": run_merge, "breakdown": run_breakdown, "paired": run_paired, "costs": run_costs,
              "agreement": run_agreement, "draft-agreement": run_draft_agreement, "device": _run_device,
              "space": _run_space, "kernel-rows": _run_kernel_rows, "batch": run_batch,
              "overlap": _run_overlap, "llama-costs": _run_llama_costs}[args.command](args)
    lost = [r for r in result.get("summary", []) if r.get("dataset") == "all" and r.get("mismatches")]
    if lost:  # the report is written, but a method that changed the target's output is a failure
        print(f"pacer-bench: NOT LOSSLESS: {[r['method'] for r in lost]} changed the target's output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
