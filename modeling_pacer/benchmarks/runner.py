"""The live benchmark: methods interleaved per prompt, warm-up excluded, every output checked against
the target alone (except llama.cpp's, which computes with its own numerics), forwards counted and timed with
hooks so that transformers' own methods are measured too."""

import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from .llamacpp import LlamaCppFailed, LlamaCppRunner
from .llamaserver import LlamaServerRunner
from .methods import LLAMA_CPP, Method, run_method
from ..replay import CostModel, Trace, oracle, record_match


@dataclass
class Record:
    """One method on one prompt."""

    dataset: str
    prompt_id: str
    method: str
    seconds: float
    new_tokens: int
    target_forwards: int
    draft_forwards: int
    # True/False: the output equals the target's or not; None: not comparable, the method computes with its
    # own numerics (llama.cpp's quantized kernels), so a difference is no loss of exactness, or it sampled
    matches_target: bool | None
    head_seconds: float = 0.0
    # wall time inside the target's and the draft's forward calls; the rest of `seconds` minus
    # `head_seconds` is the decoding loop's own overhead (sampling, cache crops, Python)
    target_seconds: float | None = None
    draft_seconds: float | None = None
    # wall time of the run's first forward of each model (None: not called): the prompt's prefill for the target
    # alone and for pacer's loop (target first, then the draft's); in transformers' assisted generation the
    # target's first forward also verifies the first draft. The oracle's end-to-end bound prices prefills with them
    target_prefill_seconds: float | None = None
    draft_prefill_seconds: float | None = None
    draft_lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    # how many new tokens equal the target's before the first difference (results before it: absent)
    agree_prefix: int | None = None
    # sampled decoding: outputs are draws, not comparable token for token (losslessness in distribution is what
    # tests/test_sampling.py checks); the seed makes the run repeatable
    sampled: bool = False
    # llama.cpp's speculative methods: the draft tokens it proposed and the target accepted, by its own count
    peer_drafted: int | None = None
    peer_accepted: int | None = None
    # ... and whether the output equals plain llama.cpp's (the same server build without a draft, else
    # llama-cpp-python's) on this prompt, and how many new tokens agree before the first difference
    same_as_plain_llamacpp: bool | None = None
    plain_llamacpp_prefix: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class ForwardMeter:
    """Counts and times the forward calls of a module with hooks, so it sees transformers' internal calls
    too. On CUDA it synchronizes before and after each forward, so the time is the forward's and not its
    launch's (this costs every method alike, a little)."""

    def __init__(self, module):
        self.count = 0
        self.seconds = 0.0
        self.first_seconds: float | None = None  # the first forward's wall time since `start_run`
        self._started: list[float] = []  # a stack, should the module's forward call itself
        device = next(module.parameters()).device
        self._sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *args):
        self._sync()
        self._started.append(time.perf_counter())

    def _post(self, *args):
        self._sync()
        elapsed = time.perf_counter() - self._started.pop()
        self.seconds += elapsed
        self.count += 1
        if self.first_seconds is None and not self._started:  # an outermost call
            self.first_seconds = elapsed

    def start_run(self):
        """Forget the previous run's first forward."""
        self.first_seconds = None

    def remove(self):
        for handle in self._handles:
            handle.remove()


def _timed(method: Method, target, draft, head, input_ids, max_new_tokens, meters, llamacpp=None, sampling=None,
           seed=0):
    """Run one method once: `(sequences, stats, seconds, [(forwards, forward seconds, first forward's seconds)
    per meter])`. Sampled (`sampling` set), every method starts from torch's generator seeded with `seed`."""
    before = [(m.count, m.seconds) for m in meters]
    for m in meters:
        m.start_run()
    if sampling is not None:
        torch.manual_seed(seed)
    start = time.perf_counter()
    sequences, stats = run_method(method, target, draft, head, input_ids, max_new_tokens, llamacpp, sampling)
    seconds = time.perf_counter() - start
    used = [(m.count - n, m.seconds - t, m.first_seconds) for m, (n, t) in zip(meters, before)]
    return sequences, stats, seconds, used


def build_llamacpp_runners(pair, methods: list[Method], prompts, max_new_tokens: int) -> dict:
    """A runner per llama.cpp method, by name (each its own process, loaded here, outside every timed region)."""
    runners = {}
    try:
        for m in methods:
            if m.family == "llamacpp":
                runners[m.name] = LlamaCppRunner.for_pair(pair, prompts, max_new_tokens, lookup=m.lookup)
            elif m.family == "llama-server":
                runners[m.name] = LlamaServerRunner.for_pair(pair, prompts, max_new_tokens, speculation=m.speculation)
    except BaseException:
        for runner in runners.values():
            runner.close()
        raise
    return runners


def plain_llamacpp(methods: list[Method]) -> str | None:
    """The plain llama.cpp method a speculative one is compared with: the server without a draft (the same build),
    else llama-cpp-python's; None where neither runs."""
    names = [m.name for m in methods]
    return next((name for name in ("llama.cpp-server", "llama.cpp") if name in names), None)


def agree_prefix(a: torch.Tensor, b: torch.Tensor, start: int) -> int:
    """How many tokens of `a` and `b` (1, *) from position `start` on are equal before the first difference."""
    a, b = a[0, start:].tolist(), b[0, start:].tolist()
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_live(pair, head, methods: list[Method], prompts, max_new_tokens: int, progress=None, oracle_max_draft=8,
             llamacpp=None, sampling: dict | None = None, seed: int = 0, failures: dict | None = None):
    """Run every method on every prompt. `prompts`: list of `(dataset, prompt_id, input_ids (1, L))`.

    `sampling` ([`sampling_settings`]): sampled decoding, each prompt's runs seeded with `seed` plus the prompt's
    index; outputs are then not compared with the target's (draws differ; `matches_target` None, `sampled`
    True) and no oracle is replayed (its trace follows a greedy output), so `traces` is empty.

    `llamacpp`: the [`LlamaCppRunner`] for the llama.cpp methods (or one per method, by name); built here from
    `pair.target_source` (its GGUF file, loaded once per method, outside the timed region) when one is selected
    and none is given.
    Returns `(records, traces)`: a [`Record`] per method and prompt, and the oracle's cheap trace per
    prompt (recorded from the target's own output, outside the timed region). A method whose native library
    dies (llama.cpp's `LlamaCppFailed`) is dropped from the run, with no records, and its message put in
    `failures` (a dict, if given) under its name: the other methods' rows still come.
    """
    target, draft = pair.target, pair.draft
    if not any(m.name == "target" for m in methods):
        raise ValueError("The benchmark needs the 'target' method: every speedup is relative to it.")
    built = {}  # runners built here are closed here (their child processes end with the run)
    if llamacpp is None and any(m.family in LLAMA_CPP for m in methods):
        llamacpp = built = build_llamacpp_runners(pair, methods, prompts, max_new_tokens)
    failures = {} if failures is None else failures
    methods = list(methods)
    meters = [ForwardMeter(target), ForwardMeter(draft)]

    def attempt(method, input_ids, new_tokens, run_seed):
        """`_timed(method, ...)`, or None when the method's native library died (then it is dropped)."""
        try:
            return _timed(method, target, draft, head, input_ids, new_tokens, meters, llamacpp, sampling, run_seed)
        except LlamaCppFailed as error:
            failures[method.name] = str(error)
            methods.remove(method)
            print(f"pacer-bench: {error}; its rows are left out", file=sys.stderr)
            return None

    try:
        # warm-up (excluded): every method once, on the first prompt, a few tokens
        for method in list(methods):
            attempt(method, prompts[0][2], min(8, max_new_tokens), seed)
        records, traces = [], []
        for j, (dataset, prompt_id, input_ids) in enumerate(prompts):
            order = methods[j % len(methods):] + methods[: j % len(methods)]  # rotate: no method always first
            results = {}
            for method in order:
                result = attempt(method, input_ids, max_new_tokens, seed + j)
                if result is not None:
                    results[method.name] = result
                if progress is not None:
                    progress.update(1)
            reference = results["target"][0]
            plain = plain_llamacpp(methods)
            for method in methods:
                sequences, stats, seconds, ((target_fw, target_s, target_first), (draft_fw, draft_s, draft_first)) = \
                    results[method.name]
                records.append(Record(
                    dataset, prompt_id, method.name, seconds,
                    new_tokens=sequences.shape[1] - input_ids.shape[1],
                    target_forwards=target_fw, draft_forwards=draft_fw,
                    matches_target=None if method.own_numerics or sampling else sequences.tolist() == reference.tolist(),
                    head_seconds=stats.head_time if stats else 0.0,
                    draft_lengths=[s.drafted for s in stats.steps] if stats else [],
                    accepted=[s.accepted for s in stats.steps] if stats else [],
                    target_seconds=target_s, draft_seconds=draft_s,
                    target_prefill_seconds=target_first, draft_prefill_seconds=draft_first,
                    agree_prefix=None if sampling else agree_prefix(sequences, reference, input_ids.shape[1]),
                    sampled=sampling is not None,
                    **_peer_fields(method, sequences, results.get(plain), llamacpp, input_ids.shape[1]),
                ))
            if sampling is None:
                output = reference[0, input_ids.shape[1]:].cpu()
                traces.append(record_match(draft, input_ids, output, oracle_max_draft, dataset, prompt_id))
    finally:
        for m in meters:
            m.remove()
        for runner in built.values():
            runner.close()
    return records, traces


def _peer_fields(method: Method, sequences, plain, runners, start: int) -> dict:
    """A llama.cpp speculative method's Record fields: its counts (its runner's, for the request just made) and its
    agreement with `plain` (plain llama.cpp's `_timed` result on the prompt, None where it did not run)."""
    if method.speculation is None:
        return {}
    runner = runners.get(method.name) if isinstance(runners, dict) else runners
    counts = getattr(runner, "last", None) or {}
    fields = dict(peer_drafted=counts.get("drafted"), peer_accepted=counts.get("accepted"))
    if plain is not None:
        fields.update(same_as_plain_llamacpp=sequences.tolist() == plain[0].tolist(),
                      plain_llamacpp_prefix=agree_prefix(sequences, plain[0], start))
    return fields


def measured_prefills(records: list[Record]) -> tuple[float | None, float | None]:
    """One prompt's prefills as the live run measured them (`records`: that prompt's): the target alone's first
    target forward, and the median of the draft-using methods' first draft forwards (each the draft reading the same
    prompt). None where absent."""
    target = next((r.target_prefill_seconds for r in records if r.method == "target"), None)
    drafts = [r.draft_prefill_seconds for r in records if r.draft_prefill_seconds is not None]
    return target, (statistics.median(drafts) if drafts else None)


def oracle_records(traces: list[Trace], costs: CostModel, max_draft: int, records: list[Record] = ()) -> list[dict]:
    """Per prompt: the oracle's replayed schedule and its speedup over the target alone (same cost model), and
    with `records` (the live run's) the prompt's measured prefills (`measured_prefills`), which the cost model
    does not price: with them the report bounds the end-to-end speedup of any stopping rule."""
    by_prompt = defaultdict(list)
    for r in records:
        by_prompt[(r.dataset, r.prompt_id)].append(r)
    rows = []
    for trace in traces:
        result = oracle(trace, costs, max_draft)
        target_prefill, draft_prefill = measured_prefills(by_prompt[(trace.dataset, trace.prompt_id)])
        end_to_end = {}
        if target_prefill is not None and draft_prefill is not None and trace.length:
            # both schedules price their prefill as one target token; the live one reads the whole prompt, and a
            # schedule that drafts also pays the draft's prefill, whose forward gives its first drafted token
            drafts = any(s.drafted for s in result.steps)
            end_to_end = dict(
                end_to_end_target_alone_seconds=result.target_alone_seconds - costs.target(1) + target_prefill,
                end_to_end_seconds=result.seconds - costs.target(1) + target_prefill
                + (draft_prefill - costs.draft_forward if drafts else 0.0),
            )
        rows.append(dict(
            dataset=trace.dataset, prompt_id=trace.prompt_id, method="oracle",
            seconds=result.seconds, target_alone_seconds=result.target_alone_seconds,
            draft_lengths=[s.drafted for s in result.steps], accepted=[s.accepted for s in result.steps],
            new_tokens=trace.length, target_prefill_seconds=target_prefill, draft_prefill_seconds=draft_prefill,
            **end_to_end,
        ))
    return rows
