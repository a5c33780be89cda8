"""Stopping policies: when to stop drafting and send the draft to the target.

Every policy plugs into the same decoding loop (`generate.py` beside this file), so they are
compared on equal terms: same models, same caches, same verification. The loop calls, per decode
step::

    cap = policy.begin_step()              # most tokens this step may draft (0 = plain target step)
    after each drafted token:  reason = policy.stop_reason(draft)   # None = keep drafting
    after verification:        policy.update(draft, num_accepted)     # draft is None if k = 0

with `policy.reset()` once at the start. `generate` runs this on its own copy of a policy instance passed to it
(so one instance can serve concurrent calls, and is never modified); the copy comes back as `out.pacer_policy`.

This file is published with `generate.py` as a `custom_generate` folder: it imports only torch.
"""

import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class DraftView:
    """What a policy may read about the draft of the current step, after each drafted token.

    Attributes:
        token_probs: `(k,)` draft probability of each drafted token, after logits processing.
        entropies: `(k,)` entropy (nats) of the draft distribution that produced each token.
        acceptance: callable returning `(k,)` head-predicted P(accept) for the whole draft so far; the
            loop owns the head, counts and times its calls, and caches the answer per length.
        free: how many of the first tokens were looked up in the sequence ([`NgramLookup`]) rather than drafted:
            they cost no draft forward, their `token_probs` are the lookup's acceptance estimate and their
            entropies 0 (a point-mass proposal).
        free_ahead: looked-up tokens still on offer after these (free too, should drafting go on).
    """

    token_probs: torch.Tensor
    entropies: torch.Tensor
    acceptance: Callable[[], torch.Tensor] | None = None
    free: int = 0
    free_ahead: int = 0

    @property
    def length(self) -> int:
        return int(self.token_probs.shape[0])


def _check_range(name: str, value: float, low: float, high: float = math.inf) -> None:
    if not low <= value <= high:
        span = f"[{low}, {high}]" if high != math.inf else f">= {low}"
        raise ValueError(f"{name} must be {span}, got {value}.")


class StoppingPolicy:
    """Base class. Subclasses override `stop_reason` and, if they adapt, `begin_step`/`update`."""

    name = "policy"
    needs_head = False  # True: the loop must be given a `pacer_head` and passes `DraftView.acceptance`

    def __init__(self, max_draft_length: int):
        if not isinstance(max_draft_length, int) or max_draft_length < 0:
            raise ValueError(f"max_draft_length must be an integer >= 0, got {max_draft_length!r}.")
        self.max_draft_length = max_draft_length

    def reset(self) -> None:
        """Called once at the start of each `generate` call (on that call's own copy of the instance passed)."""

    def begin_step(self) -> int:
        return self.max_draft_length

    def stop_reason(self, draft: DraftView) -> str | None:
        return None

    def update(self, draft: DraftView | None, num_accepted: int) -> None:
        """Called after verification with the step's draft (`None` if nothing was drafted) and how many
        of its tokens the target accepted."""

    def to_dict(self) -> dict:
        """The rule as JSON-ready settings: `{"name": ..., <each constructor argument>: value}`, what
        [`policy_from_dict`] builds it back from. A cost model is this machine's, not the rule's: never included."""
        params = inspect.signature(type(self)).parameters
        return {"name": self.name, **{key: getattr(self, key) for key in params if key != "costs"}}

    @classmethod
    def from_dict(cls, settings: dict, costs=None) -> "StoppingPolicy":
        """The rule `settings` name (see [`policy_from_dict`])."""
        return policy_from_dict(settings, costs)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


class FixedLength(StoppingPolicy):
    """Vanilla speculative decoding: always draft `gamma` tokens."""

    name = "fixed"

    def __init__(self, gamma: int = 2):
        super().__init__(max_draft_length=gamma)
        self.gamma = gamma


class Heuristic(StoppingPolicy):
    """transformers' `num_assistant_tokens_schedule="heuristic"`: gamma += 2 if every drafted token
    was accepted, else gamma -= 1 (never below 1)."""

    name = "heuristic"

    def __init__(self, initial_gamma: int = 20, max_draft_length: int = 64):
        super().__init__(max_draft_length=max_draft_length)
        _check_range("initial_gamma", initial_gamma, 1)
        self.initial_gamma = initial_gamma
        self._gamma = initial_gamma

    def reset(self) -> None:
        self._gamma = self.initial_gamma

    def begin_step(self) -> int:
        return min(self._gamma, self.max_draft_length)

    def update(self, draft: DraftView | None, num_accepted: int) -> None:
        if draft is None:
            return
        self._gamma = self._gamma + 2 if num_accepted == draft.length else max(1, self._gamma - 1)


class Confidence(StoppingPolicy):
    """transformers' `assistant_confidence_threshold`: stop once the draft's probability of its own token
    falls below the threshold. With `adaptive=True` the threshold is re-tuned after every step as
    transformers does: on the ROC of (draft probability, accepted) pairs seen so far, take the threshold
    minimising FPR + 3 * FNR."""

    name = "confidence"

    def __init__(self, threshold: float = 0.4, adaptive: bool = True, max_draft_length: int = 20):
        super().__init__(max_draft_length=max_draft_length)
        _check_range("Confidence threshold", threshold, 0.0, 1.0)
        self.threshold = threshold
        self.adaptive = adaptive
        self._current = threshold
        self._probs: list[float] = []
        self._matches: list[int] = []

    def reset(self) -> None:
        self._current = self.threshold
        self._probs, self._matches = [], []

    def stop_reason(self, draft: DraftView) -> str | None:
        return "confidence" if float(draft.token_probs[-1]) < self._current else None

    def update(self, draft: DraftView | None, num_accepted: int) -> None:
        if not self.adaptive or draft is None:
            return
        # as transformers: the accepted tokens are positives, the first rejected one a negative,
        # tokens after it say nothing about the threshold
        seen = min(num_accepted + 1, draft.length)
        self._probs.extend(draft.token_probs[:seen].tolist())
        self._matches.extend([1] * num_accepted + [0] * (seen - num_accepted))
        if len(self._probs) > 5 and {0, 1}.issubset(self._matches):
            self._current = _min_cost_threshold(torch.tensor(self._probs), torch.tensor(self._matches))


def _min_cost_threshold(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The ROC threshold minimising FPR + 3 * FNR (positives predicted as `score >= threshold`)."""
    thresholds = torch.unique(scores)  # ascending
    predicted = scores[None, :] >= thresholds[:, None]  # (num_thresholds, n)
    positives, negatives = labels.bool(), ~labels.bool()
    tpr = (predicted & positives).sum(1) / positives.sum()
    fpr = (predicted & negatives).sum(1) / negatives.sum()
    costs = fpr + 3 * (1 - tpr)
    return float(thresholds[torch.argmin(costs)])


class SVIP(StoppingPolicy):
    """SVIP (training-free): stop once sqrt(0.15 * entropy of the draft distribution) exceeds the
    threshold; a flat draft distribution means the draft is guessing."""

    name = "svip"

    def __init__(self, threshold: float = 0.4, max_draft_length: int = 20):
        super().__init__(max_draft_length=max_draft_length)
        _check_range("SVIP threshold", threshold, 0.0)
        self.threshold = threshold

    def stop_reason(self, draft: DraftView) -> str | None:
        return "entropy" if math.sqrt(0.15 * float(draft.entropies[-1])) > self.threshold else None


class SpecDecPP(StoppingPolicy):
    """SpecDec++: stop once the predicted probability that at least one drafted token is rejected,
    1 - prod(P(accept)), exceeds the threshold; the prediction comes from a trained head."""

    name = "specdec++"
    needs_head = True

    def __init__(self, threshold: float = 0.7, max_draft_length: int = 16):
        super().__init__(max_draft_length=max_draft_length)
        _check_range("SpecDec++ threshold", threshold, 0.0, 1.0)
        self.threshold = threshold

    def stop_reason(self, draft: DraftView) -> str | None:
        # SpecDec++'s head predicts per-token conditionals P(accept i | 0..i-1 accepted), whose
        # product is P(whole draft accepted). A PACER head is trained on cumulative labels (token i
        # is 1 only if it and every token before it are accepted), so its last prediction already
        # is that product: the rule becomes 1 - p[-1] > threshold.
        p_all_accepted = float(draft.acceptance()[-1])
        return "cumulative" if 1.0 - p_all_accepted > self.threshold else None


class Pacer(StoppingPolicy):
    """PACER: draft in blocks of `block_size`; after each block, stop if the head's mean predicted
    acceptance over that block is below the threshold t; else t *= growth and draft another block.

    The growth factor makes the rule stricter as the draft grows: a rejection at position i wastes
    every token drafted after it, so late blocks must be more certain to be worth drafting.
    `first_block_size` (not in the paper; 0 = `block_size`) sets the first block's length apart, so that
    blocks can end where the target's verification cost steps up (see `PacerConfig`).
    """

    name = "pacer"
    needs_head = True

    def __init__(self, block_size: int = 3, threshold: float = 0.5, growth: float = 1.1, max_draft_length: int = 16,
                 first_block_size: int = 0):
        super().__init__(max_draft_length=max_draft_length)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"PACER block_size must be an integer >= 1, got {block_size!r}.")
        if not isinstance(first_block_size, int) or not 0 <= first_block_size <= max_draft_length:
            raise ValueError(
                f"PACER first_block_size must be an integer in [0, max_draft_length] (0: block_size), got {first_block_size!r}."
            )
        _check_range("PACER threshold", threshold, 0.0, 1.0)
        _check_range("PACER growth", growth, 1.0)
        self.block_size = block_size
        self.threshold = threshold
        self.growth = growth
        self.first_block_size = first_block_size
        self._t = threshold

    @classmethod
    def from_config(cls, config, **overrides) -> "Pacer":
        """Defaults from a `PacerConfig` (a trained head stores its tuned rule there)."""
        params = head_policy(config, rule="blocks")
        del params["name"]
        params.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**params)

    def begin_step(self) -> int:
        self._t = self.threshold
        return self.max_draft_length

    def stop_reason(self, draft: DraftView) -> str | None:
        first = self.first_block_size or self.block_size
        k = draft.length
        if k < first or (k - first) % self.block_size != 0:
            return None
        block_start = 0 if k == first else k - self.block_size
        block_mean = float(draft.acceptance()[block_start:].mean())
        if block_mean < self._t:
            return "head"
        self._t *= self.growth
        return None


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.float().clamp(1e-4, 1.0 - 1e-4)
    return torch.log(p) - torch.log1p(-p)


class OnlineCalibration:
    """Platt scaling learnt while decoding: P(token j accepted | tokens before it accepted) =
    sigmoid(w . [1, x_j]), where x_j are the logits of the per-token estimates (the draft's token probability,
    the head's conditional prediction, or both), fitted to the accept/reject outcome of every verified draft token.

    An estimate trained or read on one kind of text is off on another (a head trained on chat is pessimistic
    on code, where the draft agrees more); every verification says, for free, which draft tokens were right,
    so the estimate can follow the text it is decoding. The fit is a Bayesian logistic regression updated one
    outcome at a time with a Newton step (the Laplace approximation: H accumulates q(1-q) x x^T), starting at
    the raw estimate itself (bias 0, slopes summing to 1) with a Gaussian prior worth `strength` outcomes per
    weight, so a few outcomes move it little and a few hundred (one prompt) decide it.
    """

    def __init__(self, num_features: int = 1, strength: float = 4.0):
        if not strength > 0.0:
            raise ValueError(f"calibration strength must be > 0 (the prior keeps the first steps stable), got {strength}.")
        self.weights0 = [0.0] + [1.0 / num_features] * num_features
        self.strength = strength
        self.reset()

    def reset(self) -> None:
        self.w = torch.tensor(self.weights0, dtype=torch.float64)
        self.H = torch.eye(self.w.shape[0], dtype=torch.float64) * self.strength
        self.observed = 0

    def probability(self, x: torch.Tensor) -> torch.Tensor:
        """`(k, num_features)` estimate logits (on any device) -> `(k,)` calibrated conditional acceptance
        probabilities, on the CPU, where the fit lives (a few numbers: the rule reads them as floats anyway)."""
        return torch.sigmoid(self.w[1:] @ x.detach().to("cpu", torch.float64).T + self.w[0])

    def observe(self, x: torch.Tensor, num_accepted: int) -> None:
        """One verified draft: `x` `(m, num_features)` the logits of its first m tokens' estimates, of which the
        first `num_accepted` were accepted. Token j's conditional outcome is known for j <= num_accepted."""
        x = x.detach().to("cpu", torch.float64)
        for j in range(min(num_accepted + 1, x.shape[0])):
            features = torch.cat([torch.ones(1, dtype=torch.float64), x[j]])
            q = float(torch.sigmoid(self.w @ features))
            self.H += q * (1.0 - q) * torch.outer(features, features)
            self.w -= torch.linalg.solve(self.H, (q - float(j < num_accepted)) * features)
            self.observed += 1


class ExpectedThroughput(StoppingPolicy):
    """Stop drafting when no longer draft is expected to emit more tokens per second than stopping now,
    with the verification cost curve measured on this machine (`costs`: a `modeling_pacer.costs.CostModel`,
    e.g. from `host_costs(target, draft, head)`).

    After k drafted tokens, let c_j estimate P(the first j draft tokens are all accepted). A step that
    stops at k emits 1 + sum_{j<=k} c_j tokens on average (the target always adds one) and costs
    k * draft + verify(k + 1) (+ head calls), so its rate is R(k) = (1 + sum c_j) / cost(k). Lengths
    k' > k are judged with c_j extrapolated as c_k * r^(j - k), r = c_k / c_{k-1} (the last token's
    conditional estimate), over every reachable k' up to `max_draft_length`, so a rule can look past a
    stair of the cost curve. Stop when max R(k') <= R(k): maximising each step's rate is maximising the
    long-run tokens per second (renewal-reward), and it reduces to "the expected extra tokens are worth
    less than their extra time at the current rate".

    `estimate="draft"`: c_j = product of the draft's own token probabilities (training-free);
    `estimate="head"`: c_j = the head's prediction (a PACER head is trained on cumulative labels, so its
    j-th output already is P(first j accepted)), read every `block_size` tokens as in the paper;
    `estimate="both"` (needs `calibration`): the draft's probability and the head's conditional prediction
    combined by the online fit.

    `calibration` (a prior strength, e.g. 4.0; None: the raw estimate): the per-token conditional estimates
    go through an [`OnlineCalibration`] fitted to this call's accept/reject outcomes, c_j their product.
    `draft_nothing`: before each step, judge drafting at all with the acceptance rate seen so far in the call
    (a decayed mean over verified tokens, each token's conditional chance taken as that rate); when no length
    is expected to beat the target alone (1 token per target(1) seconds), the step drafts nothing, except
    every `probe_every`-th such step, which drafts so that the rate keeps being measured.

    In a batch, `costs` is the row's view of the batch's step (`BatchCosts` in costs.py): the rate is the whole
    batch's, (the tokens the other rows expect + this row's) / the step's seconds with every row's draft, and the rule
    reports where its draft stands so that the other rows judge theirs against it. With `draft_nothing`, the rows judge
    drafting at all by the acceptance the whole batch has seen, and one row a step drafts to measure it (before any
    was seen, and to probe): the others need not read their prompts into the draft while drafting does not pay.
    """

    name = "throughput"

    def __init__(self, costs=None, estimate: str = "draft", max_draft_length: int = 12, block_size: int = 1,
                 calibration: float | None = None, draft_nothing: bool = False, probe_every: int = 8):
        super().__init__(max_draft_length=max_draft_length)
        if costs is None or not hasattr(costs, "step"):
            raise ValueError("ExpectedThroughput needs `costs`: this machine's cost model, e.g. "
                             "modeling_pacer.costs.host_costs(target, draft, head) (generate measures and caches it "
                             "for stopping_policy='throughput' when pacer is installed).")
        if estimate not in ("draft", "head", "both"):
            raise ValueError(f"ExpectedThroughput estimate must be 'draft', 'head' or 'both', got {estimate!r}.")
        if estimate == "both" and calibration is None:
            raise ValueError("ExpectedThroughput estimate='both' combines two estimates by the online fit: pass calibration=.")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"ExpectedThroughput block_size must be an integer >= 1, got {block_size!r}.")
        if not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"ExpectedThroughput probe_every must be an integer >= 1, got {probe_every!r}.")
        self.costs = costs
        self.estimate = estimate
        self.block_size = block_size
        self.needs_head = estimate != "draft"
        self.calibration = calibration
        self.draft_nothing = draft_nothing
        self.probe_every = probe_every
        self._fit = OnlineCalibration(2 if estimate == "both" else 1, calibration) if calibration is not None else None
        self.reset()

    def reset(self) -> None:
        if self._fit is not None:
            self._fit.reset()
        self._x = None  # the estimate logits of the tokens the rule has seen this step
        self._accepted, self._verified = 0.0, 0.0  # decayed counts of accepted / verified draft tokens
        self._skipped = 0

    def _head_calls(self, k: int) -> int:
        return -(-k // self.block_size) if self.needs_head else 0

    def _besides(self) -> float:
        """The tokens the other rows of a batch expect from this step (none alone)."""
        return getattr(self.costs, "tokens_besides", 0.0)

    def _report(self, drafted: int, tokens: float, free: int = 0, head_calls: int = 0, stopped: bool = False) -> None:
        """Where this row's draft stands, for a batch's other rows (nothing alone)."""
        report = getattr(self.costs, "report", None)
        if report is not None:
            report(drafted, tokens, free, head_calls, stopped)

    def begin_step(self) -> int:
        self._x = None
        if not self.draft_nothing:
            return self.max_draft_length
        pooled = getattr(self.costs, "pooled", None)
        if pooled is not None:
            return self._begin_in_batch(pooled())
        if self._verified < 1.0:
            return self.max_draft_length
        # each token's conditional chance taken as the rate a seen so far: c_j = a^j
        a = min(self._accepted / self._verified, 1.0)
        besides = self._besides()
        rate_alone = (besides + 1.0) / self.costs.step(0)
        tokens, c = 1.0, 1.0
        for k in range(1, self.max_draft_length + 1):
            c *= a
            tokens += c
            if (besides + tokens) / self.costs.step(k, self._head_calls(k)) > rate_alone:
                self._skipped = 0
                return self.max_draft_length
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return self.max_draft_length
        return 0

    def _begin_in_batch(self, seen: tuple[float, float] | None) -> int:
        """`begin_step` in a batch: draft if a drafting step of the length the batch's rows draft, giving the tokens
        theirs gave (`seen`, the batch's average: `pooled`), outprices a plain step at the batch's rate, with this row
        priced as one of the rows doing the same; else draft nothing, but for the batch's probe (one row a step, before
        anything was seen, then `probe_every` steps after, each further one waiting twice as long while drafting does
        not pay: `probe`), which keeps the average measured, and which is not
        made where even a draft the target accepts whole would not pay (a batch whose verification rows cost more than
        they give at any length: no row reads its prompt into the draft)."""
        besides = self._besides()
        plain = (besides + 1.0) / self.costs.step(0)
        if seen is not None:
            tokens, drafted = seen
            k = max(1, min(self.max_draft_length, round(drafted)))
            if (besides + tokens) / self.costs.step(k, self._head_calls(k)) > plain:
                self.costs.pays()
                return self.max_draft_length
        # probe only where a draft could pay at all: one the target accepted whole, at some length
        could_pay = self.costs.could_pay(lambda: any(
            (besides + k + 1.0) / self.costs.step(k, self._head_calls(k)) > plain
            for k in range(1, self.max_draft_length + 1)))
        if could_pay and self.costs.probe(self.probe_every):
            return self.max_draft_length
        self._report(0, 1.0, stopped=True)
        return 0

    def _features(self, draft: DraftView) -> torch.Tensor:
        """`(k, f)` logits of the per-token conditional estimates the fit reads."""
        columns = []
        if self.estimate in ("draft", "both"):
            columns.append(_logit(draft.token_probs))
        if self.estimate in ("head", "both"):
            c = torch.cummin(draft.acceptance().float().clamp(1e-4, 1.0), dim=0).values
            columns.append(_logit(c / torch.cat([c.new_ones(1), c[:-1]])))  # P(j | first j-1 accepted)
        return torch.stack(columns, dim=1)

    def _cumulative(self, draft: DraftView) -> list[float]:
        if self._fit is not None:
            self._x = self._features(draft)
            return torch.cumprod(self._fit.probability(self._x), dim=0).tolist()
        if self.estimate == "head":
            # cumulative predictions; a later one can only be less likely than an earlier one
            return torch.cummin(draft.acceptance().float().clamp(0.0, 1.0), dim=0).values.tolist()
        return torch.cumprod(draft.token_probs.float().clamp(0.0, 1.0), dim=0).tolist()

    def stop_reason(self, draft: DraftView) -> str | None:
        k = draft.length
        if k % self.block_size != 0 and k < self.max_draft_length:
            return None
        c = self._cumulative(draft)
        calls = self._head_calls(k)
        tokens = 1.0 + sum(c)
        self._report(k, tokens, draft.free, calls)
        besides = self._besides()
        rate_now = (besides + tokens) / self.costs.step(k, calls, draft.free)
        r = c[-1] / c[-2] if k > 1 and c[-2] > 0 else c[-1]
        expected, c_j = tokens, c[-1]
        for longer in range(k + 1, self.max_draft_length + 1):
            c_j *= r
            expected += c_j
            free = draft.free + (min(longer - k, draft.free_ahead) if draft.free == k else 0)  # still looked up
            if (besides + expected) / self.costs.step(longer, self._head_calls(longer), free) > rate_now:
                return None
        self._report(k, tokens, draft.free, calls, stopped=True)
        return "throughput"

    def update(self, draft: DraftView | None, num_accepted: int) -> None:
        if draft is None:
            return
        if self._fit is not None:
            # the draft estimate is known for every drafted token; the head's only as far as the rule read it
            x = self._features(draft) if self.estimate == "draft" else self._x
            if x is not None:
                self._fit.observe(x, num_accepted)
        # decayed so that the rate follows the text (a half-life of about 14 steps)
        self._accepted = 0.95 * self._accepted + num_accepted
        self._verified = 0.95 * self._verified + min(num_accepted + 1, draft.length)
        observe = getattr(self.costs, "observe", None)  # a batch's shared count
        if observe is not None:
            observe(draft.length, num_accepted)

    def __repr__(self) -> str:
        extra = f", calibration={self.calibration}" if self.calibration is not None else ""
        extra += f", draft_nothing=True, probe_every={self.probe_every}" if self.draft_nothing else ""
        return (f"ExpectedThroughput(estimate={self.estimate!r}, max_draft_length={self.max_draft_length}, "
                f"block_size={self.block_size}{extra})")


POLICIES: dict[str, type[StoppingPolicy]] = {
    cls.name: cls for cls in (FixedLength, Heuristic, Confidence, SVIP, SpecDecPP, Pacer, ExpectedThroughput)
}


def policy_from_dict(settings: dict, costs=None) -> StoppingPolicy:
    """A rule from its `to_dict()` settings: `{"name": <a name in POLICIES>, ...its constructor's arguments}`; `costs`
    (this machine's cost model) for the cost-aware rule. An unknown name or setting is a `ValueError` naming it."""
    if not isinstance(settings, dict) or not isinstance(settings.get("name"), str):
        raise ValueError(f"A stopping rule's settings are a dict with a 'name' (one of {sorted(POLICIES)}), got {settings!r}.")
    name = settings["name"]
    if name not in POLICIES:
        raise ValueError(f"Unknown stopping rule {name!r} in {settings!r}: one of {sorted(POLICIES)}.")
    cls = POLICIES[name]
    params = inspect.signature(cls).parameters
    unknown = sorted(set(settings) - {"name"} - set(params) | ({"costs"} & set(settings)))
    if unknown:
        raise ValueError(f"The {name!r} rule has no setting {unknown[0]!r}; its settings: "
                         f"{sorted(set(params) - {'costs'})}.")
    kwargs = {k: v for k, v in settings.items() if k != "name"}
    if "costs" in params:
        kwargs["costs"] = costs
    return cls(**kwargs)


def head_policy(head_config, do_sample: bool = False, rule: str | None = None) -> dict:
    """The settings (`to_dict()` form) of a head's default rule for greedy or sampled decoding, as its config gives
    them (`rule="blocks"`: its block rule, whatever its default); fields absent from heads saved before they existed
    read as the defaults then."""
    default, estimate = head_rule(head_config, do_sample)
    rule = rule or default
    if rule == "throughput":  # the head read at every token
        return dict(name=ExpectedThroughput.name, estimate=estimate, max_draft_length=head_config.max_draft_length,
                    block_size=1, calibration=getattr(head_config, "calibration", None),
                    draft_nothing=getattr(head_config, "draft_nothing", False))
    return dict(name=Pacer.name, block_size=head_config.block_size, threshold=head_config.threshold,
                growth=head_config.growth, max_draft_length=head_config.max_draft_length,
                first_block_size=getattr(head_config, "first_block_size", 0))


def head_rule(head_config, do_sample: bool = False) -> tuple[str, str]:
    """`(stopping_rule, throughput_estimate)` of a head's default rule for greedy or sampled decoding (its config's
    `sampling_*` fields, where set, for sampling); fields absent from heads saved before they existed read as the
    defaults then."""
    rule = getattr(head_config, "stopping_rule", "blocks")
    estimate = getattr(head_config, "throughput_estimate", "head")
    if do_sample:
        rule = getattr(head_config, "sampling_stopping_rule", None) or rule
        estimate = getattr(head_config, "sampling_throughput_estimate", None) or estimate
    return rule, estimate


def make_policy(policy: "str | dict | StoppingPolicy | None", head_config=None, costs=None, do_sample: bool = False) -> StoppingPolicy:
    """A policy instance from an instance, a name in `POLICIES`, settings as `to_dict()` writes them, or `None` (the
    head's default rule for greedy or, with `do_sample`, sampled decoding: PACER's blocks, or the cost-aware rule with
    `costs`, this machine's cost model, when the head's config says so)."""
    # duck-typed: a copy of this module loaded as remote code defines its own (equal) classes
    if all(hasattr(policy, attr) for attr in ("begin_step", "stop_reason", "update", "reset", "needs_head")):
        return policy
    if isinstance(policy, dict):
        return policy_from_dict(policy, costs)
    if policy is None or policy == Pacer.name:
        if head_config is None:
            raise ValueError("The PACER policy needs a head: pass `pacer_head=PacerHead(...)`.")
        # named "pacer": the paper's block rule with the head's settings, whatever its default
        settings = head_policy(head_config, do_sample, rule="blocks" if policy == Pacer.name else None)
        if settings["name"] == ExpectedThroughput.name and costs is None:
            raise ValueError(
                "This head's default stopping rule is cost-aware (stopping_rule='throughput') and needs this "
                "machine's cost model: pass pacer_costs=modeling_pacer.host_costs(target, draft, head), or choose "
                "another rule with stopping_policy=... (e.g. 'pacer' for the paper's block rule)."
            )
        return policy_from_dict(settings, costs)
    if policy == ExpectedThroughput.name:
        return ExpectedThroughput(costs)  # the cost-aware rule on the draft's probability, the default head's rule
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise ValueError(
        f"Unknown stopping_policy {policy!r}: pass a StoppingPolicy instance or one of {sorted(POLICIES)}."
    )
