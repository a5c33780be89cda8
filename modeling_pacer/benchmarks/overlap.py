"""`pacer-bench overlap`: whether the draft drafting while the target verifies (PEARL's post-verify) can pay on this
CPU, measured before any such loop is built.

Overlap gives each model its own cores, so each step runs on fewer cores, beside the other model's, sharing the
memory bandwidth and the caches. Two processes, one a model, each pinned to its own core (`os.sched_setaffinity`, one
torch thread; processes, not threads, so that neither waits for the other's Python), time in interleaved rounds:

- the target verifying k + 1 tokens after a cached prefix, and one draft step, each alone on one core, and both at
  once (one core each);
- each alone on every core the host has (the serial loop's costs);
- the memory bandwidth one process reaches alone on one core, two at once (one core each), and one on every core.

From them: the serial step (k draft steps, then the verification, on every core) against the overlapped one (the
longer of k draft steps and the verification, each on its half of the cores, both at once), whose ratio bounds what
PEARL's post-verify can gain at that draft length, before its own losses (drafts thrown away on a rejection).
Writes `overlap.json` and `overlap.md` to `--out`.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from .provenance import run_meta


def _step_fns(model, prefix_tokens: int, tokens: int):
    """A function that feeds `tokens` tokens to `model` after a cached `prefix_tokens`-token prefix, then takes them back."""
    from ..custom_generate.steps import crop_cache, model_forward, new_cache
    from ..costs import fixed_prefix

    ids = fixed_prefix(model, prefix_tokens)
    cache = new_cache(model, prefix_tokens + tokens + 1)
    with torch.no_grad():
        model_forward(model, ids, cache, 1)

    def step():
        with torch.no_grad():
            model_forward(model, ids[:, -1:].repeat(1, tokens), cache, tokens)
        crop_cache(cache, prefix_tokens)

    return step


def _bandwidth_fn(gib: float):
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    return lambda: data.sum(), data.numel() * 4


def _worker(connection, role: str, load, prefix_tokens: int, tokens: int, gib: float) -> None:
    """A child: its model of the pair `load()` returns (`role`: "target" verifying `tokens` tokens, or "draft" stepping
    one), then timed loops on request: `(cores, seconds, what)` -> the seconds of each call made in that time on those
    cores."""
    torch.set_num_threads(1)
    pair = load()
    model = pair.target if role == "target" else pair.draft
    fns = {"step": _step_fns(model, prefix_tokens, tokens if role == "target" else 1)}
    fns["bandwidth"], nbytes = _bandwidth_fn(gib)
    del pair
    connection.send(("ready", nbytes))
    while True:
        request = connection.recv()
        if request is None:
            return
        cores, seconds, what = request
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        fn = fns[what]
        fn()  # warm: the cores' clocks, the caches
        connection.send(("go", None))
        connection.recv()  # both start together
        samples, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        connection.send(("samples", samples))


class _Workers:
    """The two children, the target's and the draft's."""

    def __init__(self, load, prefix_tokens, tokens, gib):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.connections, self.processes = {}, {}
        for role in ("target", "draft"):
            parent, child = context.Pipe()
            process = context.Process(target=_worker, args=(child, role, load, prefix_tokens, tokens, gib),
                                      daemon=True)
            process.start()
            child.close()
            self.connections[role], self.processes[role] = parent, process
        self.nbytes = {role: self._receive(role, "ready") for role in self.connections}

    def _receive(self, role, kind):
        try:
            got, value = self.connections[role].recv()
        except EOFError:
            raise RuntimeError(f"pacer-bench overlap: the {role}'s process died (exit code "
                               f"{self.processes[role].exitcode})") from None
        if got != kind:
            raise RuntimeError(f"pacer-bench overlap: the {role}'s process answered {got!r}, expected {kind!r}")
        return value

    def run(self, jobs: dict, seconds: float) -> dict:
        """`jobs`: role -> (cores, what), run at once for `seconds`: role -> the median seconds of a call."""
        for role, (cores, what) in jobs.items():
            self.connections[role].send((cores, seconds, what))
        for role in jobs:
            self._receive(role, "go")
        for role in jobs:
            self.connections[role].send("start")
        return {role: statistics.median(self._receive(role, "samples")) for role in jobs}

    def close(self):
        for role, connection in self.connections.items():
            try:
                connection.send(None)
            except OSError:
                pass
            self.processes[role].join(timeout=10)
            if self.processes[role].is_alive():
                self.processes[role].kill()


def measure_overlap(load, draft_tokens: int = 3, prefix_tokens: int = 128, seconds: float = 2.0,
                    rounds: int = 3, gib: float = 0.5, progress=None) -> dict:
    """The measurements of the module's docstring, medians over `rounds` interleaved rounds of `seconds` each. `load`:
    a picklable callable that returns the pair (`.target`, `.draft`), called in each child (e.g. a `functools.partial`
    of `load_pair`); `gib`: the tensor the bandwidth is read over (far larger than the caches)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"pacer-bench overlap needs two cores to split between the models; this process has {len(cores)}")
    one = {"target": {cores[0]}, "draft": {cores[1]}}
    every = set(cores)
    cases = {  # name -> jobs: role -> (cores, what)
        "target alone, 1 core": {"target": (one["target"], "step")},
        "draft alone, 1 core": {"draft": (one["draft"], "step")},
        "both at once, 1 core each": {"target": (one["target"], "step"), "draft": (one["draft"], "step")},
        "target alone, every core": {"target": (every, "step")},
        "draft alone, every core": {"draft": (every, "step")},
        "bandwidth alone, 1 core": {"target": (one["target"], "bandwidth")},
        "bandwidth, 2 at once, 1 core each": {"target": (one["target"], "bandwidth"),
                                              "draft": (one["draft"], "bandwidth")},
        "bandwidth alone, every core": {"target": (every, "bandwidth")},
    }
    workers = _Workers(load, prefix_tokens, draft_tokens + 1, gib)
    try:
        samples = {name: [] for name in cases}
        for _ in range(rounds):
            for name, jobs in cases.items():
                samples[name].append(workers.run(jobs, seconds))
                if progress is not None:
                    progress.update(1)
        nbytes = workers.nbytes["target"]
    finally:
        workers.close()
    medians = {name: {role: statistics.median(r[role] for r in rounds_) for role in rounds_[0]}
               for name, rounds_ in samples.items()}
    return summarize_overlap(medians, draft_tokens, nbytes, len(cores))


def summarize_overlap(medians: dict, draft_tokens: int, nbytes: int, cores: int) -> dict:
    """Step times (ms), bandwidths (GB/s) and the bound: the serial step over the overlapped one at `draft_tokens`."""
    k = draft_tokens
    t_every, d_every = medians["target alone, every core"]["target"], medians["draft alone, every core"]["draft"]
    t_one, d_one = medians["target alone, 1 core"]["target"], medians["draft alone, 1 core"]["draft"]
    both = medians["both at once, 1 core each"]
    serial = k * d_every + t_every
    overlapped = max(k * both["draft"], both["target"])
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    two = medians["bandwidth, 2 at once, 1 core each"]
    return dict(
        draft_tokens=k, cores=cores, projected=project(t_every, d_every, t_one, d_one, both["target"] / t_one,
                                                       both["draft"] / d_one, k, cores),
        ms={name: {role: 1000 * s for role, s in by_role.items()} for name, by_role in medians.items()
            if not name.startswith("bandwidth")},
        slowdown_together=dict(target=both["target"] / t_one, draft=both["draft"] / d_one),
        bandwidth_gbps=dict(alone_1_core=gbps(medians["bandwidth alone, 1 core"]["target"]),
                            two_at_once_1_core_each=gbps(two["target"]) + gbps(two["draft"]),
                            alone_every_core=gbps(medians["bandwidth alone, every core"]["target"])),
        serial_step_ms=1000 * serial, overlapped_step_ms=1000 * overlapped, bound=serial / overlapped,
    )


def project(t_every: float, d_every: float, t_one: float, d_one: float, slow_target: float, slow_draft: float, k: int,
            cores: int, to=(4, 8)) -> dict:
    """A projection, not a measurement: the bound on `to` cores split in halves, assuming that every doubling of a
    model's cores speeds its step as the measured one from 1 core to `cores` did (per doubling) and that running
    together slows each as measured. `{cores: bound}` for each of `to` above `cores`."""
    import math

    doublings = math.log2(cores)
    if cores < 2 or doublings <= 0:
        return {}
    gain_t, gain_d = (t_one / t_every) ** (1 / doublings), (d_one / d_every) ** (1 / doublings)
    out = {}
    for c in to:
        if c <= cores:
            continue
        steps = math.log2(c / cores)
        t, d = t_every / gain_t ** steps, d_every / gain_d ** steps  # on c cores
        serial = k * d + t
        overlapped = max(k * d * gain_d * slow_draft, t * gain_t * slow_target)  # on c / 2 cores each, together
        out[c] = serial / overlapped
    return out


def overlap_table(result: dict) -> str:
    ms, k = result["ms"], result["draft_tokens"]
    lines = [f"| case | target: {k + 1} tokens after the prefix (ms) | draft: one step (ms) |", "|---|---|---|"]
    for name, by_role in ms.items():
        lines.append(f"| {name} | {by_role.get('target', float('nan')):.1f} | {by_role.get('draft', float('nan')):.1f} |"
                     .replace("| nan |", "| – |"))
    bw = result["bandwidth_gbps"]
    slow = result["slowdown_together"]
    lines += [
        "",
        f"Together, each on its own core, the target's step takes {slow['target']:.2f}x its time alone on that core and "
        f"the draft's {slow['draft']:.2f}x.",
        f"Memory bandwidth: {bw['alone_1_core']:.1f} GB/s one core alone, {bw['two_at_once_1_core_each']:.1f} GB/s two "
        f"cores at once (summed), {bw['alone_every_core']:.1f} GB/s one process on every core ({result['cores']}).",
        f"At {k} draft tokens a step: serial (k draft steps, then the verification, on every core) "
        f"{result['serial_step_ms']:.1f} ms; overlapped (the longer of k draft steps and the verification, both at "
        f"once, one core each) {result['overlapped_step_ms']:.1f} ms: overlap can gain at most {result['bound']:.2f}x "
        "a step, before the drafts a rejection throws away.",
    ]
    if result.get("projected"):
        lines.append("Projection (not measured: each doubling of a model's cores taken to speed its step as the measured "
                     "one did, and running together to slow each as measured): on " + ", ".join(
                         f"{c} cores {bound:.2f}x" for c, bound in result["projected"].items()) + ".")
    return "\n".join(lines) + "\n"


def run_overlap(args) -> dict:
    from tqdm.auto import tqdm

    from ..pairs.loading import load_arguments, load_pair

    pair_kwargs = load_arguments(args)
    with tqdm(total=8 * args.rounds, desc="pacer-bench overlap", unit="case") as bar:
        result = measure_overlap(functools.partial(load_pair, **pair_kwargs), args.draft_tokens, seconds=args.seconds,
                                 rounds=args.rounds, progress=bar)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = run_meta(args.argv, torch=torch.__version__, pair=pair_kwargs)
    table = overlap_table(result)
    (out / "overlap.json").write_text(json.dumps(dict(result=result, meta=meta), indent=1, default=str))
    (out / "overlap.md").write_text(f"Command: `{meta['command']}`\n\n" + table)
    return dict(table=table, files=[out / "overlap.json", out / "overlap.md"])
