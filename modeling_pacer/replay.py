"""Replay: record what the draft would propose at every position of the target's greedy output once,
then evaluate any stopping rule (and the oracle) on the recordings without running the models.

Under greedy decoding the target's output is fixed, so a decode step that starts at output position
i and drafts k tokens accepts `min(k, match[i])` of them, where `match[i]` is how many of the draft's
tokens from position i agree with the target's. What a stopping rule sees while drafting (the draft's
token probabilities, entropies, hidden states) is recorded per position too, so the rule can be
replayed exactly; time comes from a cost model measured on the same machine.
"""

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from .costs import CostModel
from .custom_generate.generate import DecodeStep, cache_kwargs, crop_cache, entropy, model_forward
from .custom_generate.policies import DraftView, StoppingPolicy
from .cpu.exact_attention import any_mask_attention
from .cpu.quantization import kernel_rows_only


@dataclass
class Trace:
    """The recording of one prompt.

    Attributes:
        match: `(N,)` how many draft tokens from output position i agree with the target's output
            (capped at the recorded draft length).
        token_probs, entropies: `(N, max_draft)` what the draft's own draft from position i looked like.
        hidden: `(N, max_draft, hidden)` float16 draft hidden states for head-based rules, or None.
        output: `(N,)` the target's greedy output the trace follows.
        target_probs: `(N, max_draft)` the target's probability of each of those draft tokens in the draft's
            context, or None: with `token_probs` (the draft's), the acceptance probability min(1, p/q) a
            sampled draft of that token would have, the soft labels of [`examples_from_trace`].
    """

    dataset: str
    prompt_id: str
    match: torch.Tensor
    output: torch.Tensor | None = None
    token_probs: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    target_probs: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.match.shape[0])


# --------------------------------------------------------------------------------------------------
# trace files: safetensors (tensors) + JSON in its string metadata; loading one runs no code
# --------------------------------------------------------------------------------------------------
_TRACE_TENSORS = ("match", "output", "token_probs", "entropies", "hidden", "target_probs")


@dataclass
class TraceFile:
    """What a trace file holds: the traces, the cost model measured where they were recorded (if
    any), and free-form JSON metadata (e.g. the pair's name)."""

    traces: list[Trace]
    costs: CostModel | None = None
    meta: dict = field(default_factory=dict)


def save_traces(path, traces: list[Trace], costs: CostModel | None = None, **meta) -> None:
    """Write `traces` as one safetensors file (`.safetensors` is the conventional suffix)."""
    from safetensors.torch import save_file

    tensors = {f"{i}.{name}": getattr(trace, name).contiguous() for i, trace in enumerate(traces)
               for name in _TRACE_TENSORS if getattr(trace, name) is not None}
    header = dict(format="pacer-traces/1", traces=[dict(dataset=t.dataset, prompt_id=t.prompt_id) for t in traces],
                  costs=costs.to_dict() if costs is not None else None, meta=meta)
    save_file(tensors, str(path), metadata={"pacer": json.dumps(header)})


def load_traces(path) -> TraceFile:
    """Read a file written by [`save_traces`]. Only tensors and JSON are read: nothing in the file can
    execute (a pickle, such as the `.pt` files of earlier versions, is refused)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get("pacer", "null"))
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no trace file at {path}") from None
        raise ValueError(
            f"{path} is not a pacer trace file (safetensors written by pacer-bench --record-traces or pacer-train): "
            f"{error}. Files of earlier versions (torch pickles, .pt) are not read, since loading a pickle can run "
            "code: record the traces again."
        ) from None
    if not isinstance(header, dict) or header.get("format") != "pacer-traces/1":
        raise ValueError(f"{path} is a safetensors file but not a pacer trace file (no 'pacer' metadata).")
    traces = []
    for i, names in enumerate(header["traces"]):
        fields = {name: tensors.get(f"{i}.{name}") for name in _TRACE_TENSORS}
        if fields["match"] is None:
            raise ValueError(f"{path}: trace {i} has no 'match' tensor.")
        traces.append(Trace(names["dataset"], names["prompt_id"], **fields))
    costs = CostModel.from_dict(header["costs"]) if header.get("costs") else None
    return TraceFile(traces, costs, header.get("meta") or {})


def _run_lengths(correct: torch.Tensor, cap: int) -> torch.Tensor:
    """`(N,)` bools -> `(N,)` length of the run of Trues starting at each position, capped at `cap`."""
    out = torch.zeros(correct.shape[0], dtype=torch.long)
    run = 0
    for i in range(correct.shape[0] - 1, -1, -1):
        run = run + 1 if correct[i] else 0
        out[i] = min(run, cap)
    return out


@torch.no_grad()
def record_match(draft, input_ids: torch.Tensor, output: torch.Tensor, cap: int, dataset="", prompt_id="") -> Trace:
    """Cheap trace for the oracle: one teacher-forced draft forward over prompt + target output. The
    draft's context equals the target's output until its first miss, so the run of correct greedy
    predictions from position i is exactly what a draft from i would get accepted."""
    ids = torch.cat([input_ids, output[None]], dim=1)
    logits = draft(input_ids=ids[:, :-1].to(draft.device)).logits[0, input_ids.shape[1] - 1 :]
    correct = logits.argmax(-1).cpu() == output
    return Trace(dataset, prompt_id, _run_lengths(correct, cap), output)


@torch.no_grad()
def record_trace_by_decoding(draft, input_ids: torch.Tensor, output: torch.Tensor, max_draft: int, with_hidden: bool,
                             dataset="", prompt_id="") -> Trace:
    """Full trace: at every output position, let the draft draft `max_draft` tokens greedily from the
    target's prefix, as the live loop would, and record its features."""
    n = output.shape[0]
    ids = torch.cat([input_ids, output[None]], dim=1)
    cache = DynamicCache(config=draft.config)
    prefix = input_ids.shape[1]
    if prefix > 1:
        model_forward(draft, ids[:, : prefix - 1], cache, 1)
    match = torch.zeros(n, dtype=torch.long)
    probs = torch.zeros(n, max_draft)
    entropies = torch.zeros(n, max_draft)
    hidden = None
    for i in range(n):
        base = prefix + i  # tokens of context for output position i
        crop_cache(cache, base - 1)
        feed = ids[:, cache.get_seq_length() : base]
        drafted = []
        for j in range(max_draft):
            logits, states = model_forward(draft, feed, cache, 1, hidden=with_hidden)
            dist = logits[0, 0].softmax(-1)
            token = int(dist.argmax())
            probs[i, j] = dist[token]
            entropies[i, j] = entropy(dist)
            if with_hidden:
                if hidden is None:
                    hidden = torch.zeros(n, max_draft, states.shape[-1], dtype=torch.float16)
                hidden[i, j] = states[0, 0].to(torch.float16)
            drafted.append(token)
            feed = torch.tensor([[token]])
        agree = torch.tensor(drafted[: n - i]) == output[i : i + max_draft]
        match[i] = int(agree.int().cumprod(0).sum())
    return Trace(dataset, prompt_id, match, output, probs, entropies, hidden)


@dataclass
class ReplayResult:
    steps: list[DecodeStep] = field(default_factory=list)
    seconds: float = 0.0
    head_calls: int = 0
    target_alone_seconds: float = 0.0

    @property
    def speedup(self) -> float:
        return self.target_alone_seconds / self.seconds if self.seconds else float("nan")


def head_acceptance(head, trace: Trace) -> torch.Tensor:
    """`(N, max_draft)` the head's P(accept) for the recorded draft at every position, in one call (the
    head is causal, so row i serves every prefix of the draft from position i). A head with
    `use_draft_features` also reads the recorded token probabilities and entropies, as the live loop does."""
    features = None
    if getattr(head.config, "use_draft_features", False):
        features = torch.stack([trace.token_probs, trace.entropies], -1).to(torch.float32)
    with torch.no_grad():
        return head.acceptance_probabilities(trace.hidden.to(head.dtype), draft_features=features)


def _prefill_step(result: ReplayResult, length: int, costs: CostModel) -> int:
    """The live loop's first step: the target reads the prompt and gives output token 0, nothing drafted
    (priced as one target token, as the target alone's first token is). Returns the next position."""
    if length == 0:
        return 0
    result.steps.append(DecodeStep(0, 0, 1, "prefill"))
    result.seconds += costs.step(0)
    return 1


def replay(policy: StoppingPolicy, trace: Trace, costs: CostModel, head=None, acceptance: torch.Tensor | None = None) -> ReplayResult:
    """Run `policy` over `trace` as the live loop would (same calls, same budget rule).

    Head-based policies read `acceptance` (from [`head_acceptance`]; computed from `head` when not given,
    pass it to replay many policies on the same trace cheaply).
    """
    if trace.token_probs is None:
        raise ValueError("This trace holds no draft features: record it with record_trace_by_decoding to replay policies.")
    if policy.needs_head and acceptance is None:
        if head is None or trace.hidden is None:
            raise ValueError(f"Replaying {policy.name!r} needs a head and a trace recorded with hidden states.")
        acceptance = head_acceptance(head, trace)
    max_draft = trace.token_probs.shape[1]
    result = ReplayResult(target_alone_seconds=trace.length * costs.target(1))
    policy.reset()
    pos = _prefill_step(result, trace.length, costs)
    while pos < trace.length:
        budget = trace.length - pos - 1
        step_cap = policy.begin_step()
        cap = min(step_cap, budget)
        calls_before = result.head_calls

        def predicted(pos=pos):
            result.head_calls += 1
            return acceptance[pos, :k]

        k, view, reason = 0, None, "budget" if budget < step_cap else "max_draft_length"
        while k < cap:
            if k == max_draft:
                raise ValueError(f"The trace holds drafts of {max_draft} tokens; {policy!r} drafted on: record longer ones.")
            k += 1
            view = DraftView(trace.token_probs[pos, :k], trace.entropies[pos, :k], predicted if policy.needs_head else None)
            stop = policy.stop_reason(view)
            if stop is not None:
                reason = stop
                break
        accepted = min(k, int(trace.match[pos]))
        policy.update(view, accepted)
        result.steps.append(DecodeStep(k, accepted, accepted + 1, reason))
        result.seconds += costs.step(k, result.head_calls - calls_before)
        pos += accepted + 1
    return result


def oracle(trace: Trace, costs: CostModel, max_draft: int) -> ReplayResult:
    """The fastest schedule for a draft length chooser that knows `match`: dynamic programming over
    output positions, T(i) = min over k of cost(k) + T(i + min(k, match[i]) + 1). Drafting past the
    first miss never gains tokens but is allowed, since a measured cost curve need not be monotone;
    drafting nothing is allowed too."""
    n = trace.length
    best = [0.0] * (n + 1)
    choice = [0] * n
    for i in range(n - 1, -1, -1):
        options = range(0, min(max_draft, n - i - 1) + 1)
        best[i], choice[i] = min((costs.step(k) + best[i + min(k, int(trace.match[i])) + 1], k) for k in options)
    result = ReplayResult(target_alone_seconds=n * costs.target(1))
    pos = _prefill_step(result, n, costs)
    result.seconds += best[pos]
    while pos < n:
        k = choice[pos]
        accepted = min(k, int(trace.match[pos]))
        result.steps.append(DecodeStep(k, accepted, accepted + 1, "oracle"))
        pos += accepted + 1
    return result


def _features(logits: torch.Tensor):
    """`(n, vocab)` draft logits -> (greedy tokens, their probabilities, entropies), each `(n,)`."""
    dist = logits.float().softmax(-1)
    tokens = dist.argmax(-1)
    return tokens, dist.gather(-1, tokens[:, None])[:, 0], entropy(dist)


@torch.no_grad()
def _continuations(draft, cache, prefix: int, misses: list[int], first: torch.Tensor, steps: int) -> dict:
    """What the draft drafts after a miss, for every miss position at once.

    `cache` holds the teacher-forced draft over prompt + output. The continuation after the miss at output
    position p sees the keys of prompt + output[:p], then its own tokens: `first[i]` (the miss itself, at
    position prefix + p) and what it drafts after it. All misses advance together, one draft forward of
    len(misses) tokens per drafted token, with a 4-D mask that lets each see only its own keys (as a tree
    of drafts), instead of one forward per token per miss. Returns `{p: [(prob, entropy, hidden, token), ...]}`
    for the `steps` tokens after each miss; the cache is cropped back."""
    base, m = cache.get_seq_length(), len(misses)
    starts = prefix + torch.tensor(misses)
    context = torch.arange(base)[None, :] < starts[:, None]  # (m, base) keys of prompt + output[:p]
    own = torch.eye(m, dtype=torch.bool)
    feed, rows = first.view(1, m), {p: [] for p in misses}
    for s in range(steps):
        mask = torch.cat([context] + [own] * (s + 1), dim=1)[None, None].to(draft.device)  # (1, 1, m, base + (s+1) m)
        out = draft(input_ids=feed.to(draft.device), attention_mask=mask, position_ids=(starts + s)[None].to(draft.device),
                    use_cache=True, output_hidden_states=True, **cache_kwargs(draft, cache))
        tokens, probs, entropies = _features(out.logits[0].cpu())
        hidden = out.hidden_states[-1][0].cpu()
        for i, p in enumerate(misses):
            rows[p].append((probs[i], entropies[i], hidden[i], int(tokens[i])))
        feed = tokens.view(1, m)
    crop_cache(cache, base)
    return rows


@torch.no_grad()
def record_trace(draft, target, input_ids: torch.Tensor, output: torch.Tensor, max_draft: int,
                 dataset="", prompt_id="", target_choice: torch.Tensor | None = None,
                 with_target_probs: bool = False) -> Trace:
    """The same trace as [`record_trace_by_decoding`] for greedy decoding (up to float rounding in the
    features: the draft runs on other shapes), at the cost of one target forward, one draft forward, and
    `max_draft - 1` draft forwards that continue every draft past its first miss at once.

    Teacher forcing: along the target's greedy output the draft's context equals the output until its
    first miss, so a draft that starts at position i proposes the teacher-forced prediction at i, i+1,
    ... up to and including the miss at p = i + match[i]. Only what it drafts after the miss needs the
    draft's own continuation from `output[:p] + miss`, and that continuation is the same for every start
    that misses at p ([`_continuations`] runs them all together).
    The target forward gives the target's greedy choice at every position (equal to `output` when
    `output` is the target's greedy output; computed, not assumed). `target_choice` `(N,)`: those choices
    when they are already known (`output` itself, produced by the target's exact greedy decoding), which
    saves the target forward. `with_target_probs`: also record the target's probability of every draft
    token ([`Trace`]'s `target_probs`, for soft labels), with one more sweep of the target ([`_target_probs`]).
    """
    from .pairs.loading import row_variant_linears

    if row_variant_linears(draft):
        warnings.warn(
            "The draft has dynamic-int8 Linear layers, which quantize each call's input with one scale: the trace's "
            "features (one long forward) differ from what the draft computes in decoding steps, and a head trained "
            "on them misjudges live drafts. Record with a row-invariant draft (--quantize-draft int4, or none).",
            stacklevel=2,
        )
    n, prefix = output.shape[0], input_ids.shape[1]
    ids = torch.cat([input_ids, output[None]], dim=1)
    if target_choice is None:
        target_choice = target(input_ids=ids[:, :-1].to(target.device)).logits[0, prefix - 1 :].argmax(-1).cpu()
    cache = DynamicCache(config=draft.config.get_text_config(decoder=True))
    # the draft reads what live decoding feeds it: its first forward the prompt and the first output token in
    # one call (an int4 draft's long call runs on its dense copy, as live), then the rest of the output in one
    # call computed row by row as its short decoding steps compute it (kernel_rows_only; a draft whose one-token
    # steps run fused, modeling_pacer.cpu.fused_layers, computes them within bf16 rounding of these rows)
    fed = min(prefix + 1, ids.shape[1] - 1)
    first = draft(input_ids=ids[:, :fed].to(draft.device), use_cache=True, output_hidden_states=True,
                  **cache_kwargs(draft, cache))
    logits, hidden = [first.logits[0, prefix - 1 :]], [first.hidden_states[-1][0, prefix - 1 :]]
    if fed < ids.shape[1] - 1:
        with kernel_rows_only(draft):
            rest = draft(input_ids=ids[:, fed:-1].to(draft.device), use_cache=True,
                         output_hidden_states=True, **cache_kwargs(draft, cache))
        logits.append(rest.logits[0])
        hidden.append(rest.hidden_states[-1][0])
    tf_tokens, tf_probs, tf_entropy = _features(torch.cat(logits).cpu())
    tf_hidden = torch.cat(hidden).cpu()
    correct = tf_tokens == target_choice
    match = _run_lengths(correct, max_draft)
    misses = torch.nonzero(~correct).flatten().tolist()
    cont = {}
    if misses and max_draft > 1:
        # a tree mask (all continuations in one forward) that a draft on pacer's causal attention kernel cannot
        # take: those forwards run sdpa (features equal to the live draft's up to float rounding, as documented)
        with any_mask_attention(draft), kernel_rows_only(draft):
            cont = _continuations(draft, cache, prefix, misses, tf_tokens[misses], max_draft - 1)

    # draft tokens past the end of the output are never drafted (the budget stops them): left as zeros
    probs = torch.zeros(n, max_draft)
    entropies = torch.zeros(n, max_draft)
    hidden = torch.zeros(n, max_draft, tf_hidden.shape[-1], dtype=torch.float16)
    target_probs = torch.zeros(n, max_draft) if with_target_probs else None
    if with_target_probs:
        on_path, after_miss = _target_probs(target, ids, prefix, tf_tokens, cont)
    for i in range(n):
        m = int(match[i])
        for j in range(min(max_draft, n - i)):
            if j <= m:  # up to and including the first miss the context is the target's output
                probs[i, j], entropies[i, j], hidden[i, j] = tf_probs[i + j], tf_entropy[i + j], tf_hidden[i + j]
                if with_target_probs:
                    target_probs[i, j] = on_path[i + j]
            else:  # after the miss at p = i + m: the draft's own continuation
                probs[i, j], entropies[i, j], hidden[i, j] = cont[i + m][j - m - 1][:3]
                if with_target_probs:
                    target_probs[i, j] = after_miss[i + m][j - m - 1]
    return Trace(dataset, prompt_id, match, output, probs, entropies, hidden, target_probs)


@torch.no_grad()
def _target_probs(target, ids: torch.Tensor, prefix: int, tf_tokens: torch.Tensor, cont: dict):
    """The target's probability of every token a trace's drafts propose, for soft labels.

    `ids` `(1, prefix + N)`: prompt + output; `tf_tokens` `(N,)`: the draft's teacher-forced tokens (what a
    draft proposes up to its first miss, in the output's context); `cont`: [`_continuations`]'s rows, whose
    tokens follow the miss at p. One sweep along the output with the target's cache: the output is fed in
    chunks that end at each miss (their logits give the on-path probabilities), and at the miss at p the
    cache holds prompt + output[:p], so the miss and its continuation are fed there as their own short
    sequence (causal: the exact attention refuses tree masks) and cropped away again. Returns `(on_path (N,),
    {p: [prob of the s-th token after the miss, ...]})`."""
    n = tf_tokens.shape[0]
    cache = DynamicCache(config=target.config.get_text_config(decoder=True))
    path_logits, after_miss, fed = [], {}, 0
    for stop, p in [(prefix + p, p) for p in sorted(cont)] + [(prefix + n - 1, None)]:
        if stop > fed:
            logits, _ = model_forward(target, ids[:, fed:stop], cache, stop - fed)
            path_logits.append(logits[0].cpu())
            fed = stop
        if p is not None:
            branch = torch.tensor([[int(tf_tokens[p])] + [row[3] for row in cont[p][:-1]]])
            logits, _ = model_forward(target, branch, cache, branch.shape[1])
            dist = logits[0].cpu().softmax(-1)
            after_miss[p] = [float(dist[s, row[3]]) for s, row in enumerate(cont[p])]
            crop_cache(cache, fed)
    # row r of the path logits predicts ids[r + 1]: output position k is predicted by row prefix - 1 + k
    dist = torch.cat(path_logits)[prefix - 1 :].softmax(-1)
    return dist.gather(-1, tf_tokens[:, None])[:, 0], after_miss
