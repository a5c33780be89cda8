"""Free drafts: tokens looked up in what the sequence already holds (the prompt and the output so far) and proposed
without a draft forward, under the stopping rule's control.

Code, and answers that quote their prompt, repeat long spans: where the last few tokens occurred before, the tokens
that followed them then are a good guess now (transformers' prompt lookup, llama.cpp's lookup decoding). Here such a
continuation opens a step's draft; the rule reads, for each looked-up token, an estimate of its acceptance (the
accepted share of earlier looked-up tokens with the same match length, refitted as the call goes), decides how many to
send, and where the continuation ends before the rule stops, the draft model extends it (one forward reads the
looked-up tokens and drafts the next). A looked-up token costs no draft forward; the cost-aware rule counts it so.

Lossless as every proposal is: greedy verification keeps only the target's own tokens; in sampled decoding a looked-up
token is a proposal from a point mass (q = 1 on it), which speculative sampling accepts with probability p(token) and
otherwise replaces by a draw from p without it: exactly the target's distribution.

This file travels with `generate.py` as a `custom_generate` folder: it imports nothing.
"""

from __future__ import annotations


class NgramLookup:
    """One `generate` call's lookup: an index of the sequence's n-grams (`min_ngram`..`max_ngram` tokens) to the end of
    their most recent occurrence, and the acceptance seen so far of looked-up tokens (per match length) and of the
    draft model's tokens.

    Args:
        max_ngram: the longest suffix matched (longer matches are tried first: they predict better).
        min_ngram: the shortest. On the default pair's greedy outputs of the 30 benchmark prompts, the token after a
            match of 1 or 2 tokens was the target's in 15-60% of lookups, after 3 or more in 33-100% (by dataset):
            shorter matches cost a step's progress more often than a draft does.
        max_tokens: the most tokens one lookup proposes (the rule usually stops before).
        prior: `(accepted, rejected)` pseudo-counts each estimate starts from: (3, 1) starts looked-up tokens at 0.75,
            a little above a typical draft, so that a call tries its lookups and then follows what it sees.
        decay: weight of older outcomes per verification (0.98: a half-life of about 35 steps), so the estimates
            follow the text (a quoted block, then free prose).
    """

    EXPLORE = 2.0  # looked-up tokens verified per match length before the comparison with the draft decides

    def __init__(self, max_ngram: int = 5, min_ngram: int = 3, max_tokens: int = 16, prior: tuple = (3.0, 1.0),
                 decay: float = 0.98):
        if not isinstance(min_ngram, int) or not isinstance(max_ngram, int) or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramLookup needs integers 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}.")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"NgramLookup max_tokens must be an integer >= 1, got {max_tokens!r}.")
        if len(prior) != 2 or min(prior) <= 0:
            raise ValueError(f"NgramLookup prior must be two positive pseudo-counts (accepted, rejected), got {prior!r}.")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"NgramLookup decay must lie in (0, 1], got {decay}.")
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens
        self.prior, self.decay = tuple(float(p) for p in prior), decay
        self._tokens: list[int] = []
        self._index: dict[tuple, int] = {}  # n-gram -> the position just after its most recent indexed occurrence
        self._seen = 0  # n-grams ending before this position are indexed
        self._lookup = {n: [0.0, 0.0] for n in range(min_ngram, max_ngram + 1)}  # match length -> [accepted, verified]
        self._draft = [0.0, 0.0]  # the draft model's tokens: [accepted, verified]

    def to_dict(self) -> dict:
        return dict(max_ngram=self.max_ngram, min_ngram=self.min_ngram, max_tokens=self.max_tokens,
                    prior=list(self.prior), decay=self.decay)

    def __repr__(self) -> str:
        return "NgramLookup(" + ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items()) + ")"

    def _rate(self, counts) -> float:
        accepted, rejected = self.prior
        return (counts[0] + accepted) / (counts[1] + accepted + rejected)

    def estimate(self, match: int) -> float:
        """The chance that a token looked up after a match of `match` tokens is accepted, as seen so far."""
        return self._rate(self._lookup[match])

    def draft_rate(self) -> float:
        """The same for the draft model's tokens."""
        return self._rate(self._draft)

    def worth_trying(self, match: int) -> bool:
        """Whether a step should open with tokens looked up after a match of `match` tokens: while fewer than
        `EXPLORE` of them have been verified (so that each match length is measured), then while they are accepted
        at least as often as the draft model's tokens."""
        return self._lookup[match][1] < self.EXPLORE or self.estimate(match) >= self.draft_rate()

    def continuation(self, tokens: list[int]) -> tuple[list[int], int]:
        """`(max_tokens tokens copied from just after the most recent earlier occurrence of the longest matching suffix
        of `tokens`, that suffix's length)`; `([], 0)` where no suffix of `min_ngram` tokens or more occurred before. `tokens` is the whole sequence so far; it only grows between calls of one generation (a rolled-back
        draft never enters it)."""
        if tokens[: len(self._tokens)] != self._tokens:  # another sequence: index it afresh
            self._tokens, self._index, self._seen = [], {}, 0
        self._tokens = list(tokens)
        last = len(tokens) - 1
        # index every n-gram that ends before the last token (its continuation is known)
        for end in range(self._seen, last):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._index[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self._seen = max(self._seen, last)
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            after = self._index.get(tuple(tokens[len(tokens) - n:]))
            if after is not None:
                # copy from there on, the copy included once it reaches the end: a period shorter than the
                # continuation (a repeated line, "ab" after "abab") continues as it went
                proposed = []
                for i in range(self.max_tokens):
                    position = after + i
                    proposed.append(tokens[position] if position < len(tokens) else proposed[position - len(tokens)])
                return proposed, n
        return [], 0

    def update(self, match: int, looked_up: int, drafted: int, num_accepted: int) -> None:
        """After a verification: the step proposed `looked_up` tokens found after a match of `match` tokens, then
        `drafted - looked_up` of the draft model's, and the target accepted the first `num_accepted`. Tokens after
        the first rejected one say nothing about either estimate."""
        seen = min(num_accepted + 1, drafted)  # the tokens whose fate the verification decided
        for counts, verified, accepted in (
                (self._lookup.get(match), min(seen, looked_up), min(num_accepted, looked_up)),
                (self._draft, max(seen - looked_up, 0), max(num_accepted - looked_up, 0))):
            if counts is None or verified == 0:
                continue
            counts[0] = self.decay * counts[0] + accepted
            counts[1] = self.decay * counts[1] + verified
