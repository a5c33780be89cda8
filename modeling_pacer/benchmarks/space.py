"""`pacer-bench space`: does the Space show each side at the speed it makes alone?

The Space times each side's own generation while it streams tokens to the page and re-renders the page a few times
a second from another thread. This command measures, interleaved in rounds (one warm-up round excluded), on the
same prompt and settings:

- `outside`: the target alone, `GenerationMixin.generate` in the main thread, no streamer (what a user's script does);
- `outside, thread + streamer`: the same call in a thread started for it, with the Space's streamer;
- `outside, long-lived thread + streamer`: the same on a long-lived thread (the Space's generation worker's kind);
- `space`: the target alone through the running Space (`gradio_client`, the `/compare` endpoint), its rate as the
  page shows it; and the method side's rate and the speedup the page shows.

It writes `space.json` and `space.md`. Each figure is a median over the rounds; ratios are of medians of one run.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import sys
import threading
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rate(stats: str) -> float:
    return float(re.search(r"([\d.]+) tokens/s", stats).group(1))


def measure_space(models, prompt: str, *, max_new_tokens: int = 128, rounds: int = 3, method: str = "PACER",
                  log=print) -> dict:
    """The rates above for `models` (a `modeling_pacer.demo.DemoModels`), `rounds` rounds after a warm-up."""
    from gradio_client import Client
    from transformers import GenerationMixin

    from ..demo import CSS, GenerationWorker, ModelHolder, Side, _Streamer, build_demo
    from ..prompts import apply_chat_template

    ids = apply_chat_template(models.tokenizer, prompt)
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False)  # the page's settings for greedy decoding

    def outside() -> float:
        start = time.perf_counter()
        out = GenerationMixin.generate(models.target, ids, **settings)
        return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)

    def streamed(run_on) -> float:
        """The call with the Space's streamer, handed to `run_on` (which runs it on some thread and waits)."""
        side, result = Side("target"), {}

        def run():
            start = time.perf_counter()
            GenerationMixin.generate(models.target, ids, streamer=_Streamer(side, []), **settings)
            result["rate"] = len(side.tokens) / (time.perf_counter() - start)

        run_on(run)
        return result["rate"]

    def on_new_thread(run):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()

    worker = GenerationWorker()  # a long-lived thread of its own, as the Space's

    demo = build_demo(ModelHolder(lambda progress: models))
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, css=CSS, quiet=True)
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    samples = {"outside": [], "outside, thread + streamer": [], "outside, long-lived thread + streamer": [],
               "space: target alone": [], "space: method": [], "space: speedup shown": []}
    try:
        for round_ in range(rounds + 1):
            rates = {"outside": outside(), "outside, thread + streamer": streamed(on_new_thread),
                     "outside, long-lived thread + streamer": streamed(lambda run: worker.submit(lambda jobs: run()).wait())}
            _, target_stats, _, method_stats, _, _ = client.predict(
                prompt, max_new_tokens, "greedy", 0.7, method, 3, api_name="/compare")
            rates["space: target alone"] = _rate(target_stats)
            rates["space: method"] = _rate(method_stats)
            rates["space: speedup shown"] = float(re.search(r"([\d.]+)x\*\* the target alone", method_stats).group(1))
            log(f"pacer-bench space: round {round_}{' (warm-up)' if not round_ else ''}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in rates.items()))
            if round_:
                for key, value in rates.items():
                    samples[key].append(value)
    finally:
        demo.close()
    medians = {key: statistics.median(values) for key, values in samples.items()}
    return dict(samples=samples, medians=medians, rounds=rounds, max_new_tokens=max_new_tokens, method=method,
                prompt=prompt, space_over_outside=medians["space: target alone"] / medians["outside"],
                threaded_over_outside=medians["outside, thread + streamer"] / medians["outside"])


def markdown(report: dict) -> str:
    m = report["medians"]
    lines = [f"Command: `{report['command']}`", "",
             f"Greedy, {report['max_new_tokens']} new tokens, the prompt `{report['prompt'][:60]}...`, "
             f"median of {report['rounds']} interleaved rounds (a warm-up round excluded); host {report['host']['cpu']}, "
             f"{report['host']['threads']} threads.", "",
             "| the target alone | tokens/s | / outside |", "|---|---|---|"]
    for key in ("outside", "outside, thread + streamer", "outside, long-lived thread + streamer", "space: target alone"):
        lines.append(f"| {key} | {m[key]:.2f} | {m[key] / m['outside']:.3f} |")
    lines += ["", f"The method ({report['method']}) in the Space: {m['space: method']:.2f} tokens/s; the speedup the "
              f"page shows: {m['space: speedup shown']:.2f}x (its target alone's rate in the page: "
              f"{m['space: target alone']:.2f}; against the outside rate the method makes "
              f"{m['space: method'] / m['outside']:.2f}x)."]
    return "\n".join(lines) + "\n"


def run_space(args) -> dict:
    from .provenance import run_meta
    from ..demo import EXAMPLES, load_models

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    models = load_models()
    report = measure_space(models, EXAMPLES[args.prompt], max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                           method=args.method, log=lambda line: print(line, file=sys.stderr, flush=True))
    report.update(run_meta(getattr(args, "argv", None)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "space.json").write_text(json.dumps(report, indent=1))
    (out / "space.md").write_text(markdown(report))
    print(markdown(report))
    return report
