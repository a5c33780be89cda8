"""Several sequences in one `generate` call: a left-padded batch, each row its own draft length and its own end. Over
an exact target every row is, token for token, its own batch-of-one output and the target's plain greedy output
(packed calls compute each row alone: modeling_pacer/custom_generate/rows.py), with every policy, up to 8 rows of
mixed lengths, rows ending at different steps, three architectures (one with a sliding window), float32 and bf16, free
drafts, a draft window, logits processors and stop strings per row, the fused w4a8 target; sampled rows follow the
target's distribution, each row its own, independent of its neighbours (chi-square); what a batch cannot do is
refused before any work."""

import itertools

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, TextStreamer

from modeling_pacer import FixedLength, enable_pacer, make_exact
from modeling_pacer.custom_generate import generate as loop
from modeling_pacer.custom_generate.rows import RowCache, packed_forward
from modeling_pacer.custom_generate.steps import cache_kwargs, model_forward

from conftest import VOCAB, make_head, make_model, make_pair, word_tokenizer
from test_greedy import POLICIES
from test_sampling import _chi_square_p_value

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _mistral(seed: int, layers: int = 2, hidden: int = 32, sliding_window: int = 6):
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           sliding_window=sliding_window, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return MistralForCausalLM(config).eval()


def _exact_pair(arch: str, dtype=torch.float32, draft_kind: str = "noisy"):
    """An exact target (pacer_exact attention, row-invariant linears) and a draft of it."""
    if arch == "mistral-sw6":
        target = _mistral(1)
        draft = _mistral(1)
        torch.manual_seed(3)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(0.3 * p.std() * torch.randn_like(p))
        target = enable_pacer(target)
    else:
        target, draft = make_pair(arch, arch, draft_kind)
    return make_exact(target.to(dtype)), draft.to(dtype)


def _batch(lengths, seed: int = 0, pad: int = 0):
    """Random prompts of `lengths`, and the left-padded batch a tokenizer with padding_side='left' makes of them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[1]:], mask[row, width - p.shape[1]:] = p[0], 1
    return prompts, ids, mask


def _rows_alone(out, prompts, width):
    """Each row's tokens after its prompt, without the padding after its end."""
    return [out[row, width:] for row in range(len(prompts))]


def _assert_rows_are_alone(target, draft, lengths, new, settings, head=None, seed=0, expect_plain=True):
    prompts, ids, mask = _batch(lengths, seed)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, pacer_head=head, max_new_tokens=new,
                          pad_token_id=0, return_dict_in_generate=True, **settings())
    width = ids.shape[1]
    for row, prompt in enumerate(prompts):
        alone = target.generate(prompt, assistant_model=draft, pacer_head=head, max_new_tokens=new, pad_token_id=0,
                                **settings())
        got = out.sequences[row, width:width + alone.shape[1] - prompt.shape[1]]
        assert got.tolist() == alone[0, prompt.shape[1]:].tolist(), (lengths, row)
        assert bool((out.sequences[row, width + got.shape[0]:] == 0).all())  # padded after its end
        if expect_plain:
            plain = target.generate(prompt, max_new_tokens=new, pad_token_id=0, do_sample=False)
            assert alone.tolist() == plain.tolist(), (lengths, row)
    return out


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_every_policy_gives_each_row_its_own_output(policy_name):
    """8 rows of mixed lengths (1 to 19 tokens) over an exact float32 target, every rule of the greedy identity test."""
    target, draft = _exact_pair("llama")
    head = make_head(draft, max_draft_length=16)
    out = _assert_rows_are_alone(target, draft, [6, 1, 19, 4, 9, 2, 13, 7], 17,
                                 lambda: dict(stopping_policy=POLICIES[policy_name](), do_sample=False), head)
    stats = out.pacer_stats
    drafted = sum(s.drafted for s in stats.steps)
    # the rule that judges drafting at all, where a draft forward costs 0.6 of a flat verification: no draft of any
    # length pays 8 rows (each row's share of a forward alone outprices its token), so it drafts nothing
    assert stats.batch_size == 8 and (drafted == 0 if policy_name == "throughput-draft-nothing" else drafted > 0)
    assert sorted({s.row for s in stats.steps}) == list(range(8))
    assert [len(r.steps) for r in stats.rows()] == [sum(s.row == row for s in stats.steps) for row in range(8)]
    assert len(out.pacer_policies) == 8 and out.pacer_policy is out.pacer_policies[0]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sw6"])
def test_architectures_and_dtypes(arch, dtype):
    """Three architectures (Mistral with a sliding window of 6, shorter than most prompts), float32 and bf16, batches of
    2, 3 and 5 rows, several lengths and rules: each row its own batch-of-one and plain greedy output."""
    target, draft = _exact_pair(arch, DTYPES[dtype])
    for lengths, new in (([3, 11], 9), ([1, 8, 15], 20), ([5, 5, 2, 12, 7], 14)):
        for policy in (lambda: FixedLength(3), lambda: POLICIES["throughput-draft"](), lambda: POLICIES["svip"]()):
            _assert_rows_are_alone(target, draft, lengths, new, lambda: dict(stopping_policy=policy(), do_sample=False))


def test_rows_end_at_different_steps():
    """An end-of-sequence token ends each row where its own output has it (at different steps), the rows after it are
    padded with pad_token_id, and max_new_tokens ends the others; the padded output is what transformers returns."""
    target, draft = _exact_pair("llama", draft_kind="same")
    prompts, ids, mask = _batch([4, 9, 2, 6], seed=5)
    free = target.generate(prompts[1], max_new_tokens=20, do_sample=False)[0, prompts[1].shape[1]:]
    eos = int(free[5])
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, stopping_policy=FixedLength(4),
                          max_new_tokens=20, eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True)
    lengths = []
    for row, prompt in enumerate(prompts):
        alone = target.generate(prompt, max_new_tokens=20, eos_token_id=eos, pad_token_id=0, do_sample=False)
        new = alone[0, prompt.shape[1]:]
        lengths.append(new.shape[0])
        assert out.sequences[row, ids.shape[1]:ids.shape[1] + new.shape[0]].tolist() == new.tolist()
        assert bool((out.sequences[row, ids.shape[1] + new.shape[0]:] == 0).all())
    assert lengths[1] == 6 and max(lengths) == 20 and out.sequences.shape[1] == ids.shape[1] + 20
    assert len(set(lengths)) > 1
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0,
                            do_sample=False)
    assert plain.shape == out.sequences.shape  # transformers' own batched output has the same shape and padding


def test_free_drafts_and_a_draft_window_per_row():
    """pacer_lookup (each row its own lookup and its own estimate) and pacer_draft_window (each row's draft reads its
    own prompt's last tokens): every row its own output. The draft is the target's own weights (every token accepted),
    so that drafting pays a batch of three and the rows draft (looking tokens up where they can)."""
    target, draft = _exact_pair("qwen2", draft_kind="same")
    # repetitive prompts, so that looked-up tokens are proposed and accepted
    prompts = [torch.tensor([[5, 6, 7, 8] * k]) for k in (1, 3, 5)]
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[1]:], mask[row, width - p.shape[1]:] = p[0], 1
    for settings in (dict(pacer_lookup=True), dict(pacer_draft_window=5), dict(pacer_lookup=True, pacer_draft_window=3)):
        policy = POLICIES["throughput-draft"]
        out = target.generate(ids, attention_mask=mask, assistant_model=draft, stopping_policy=policy(),
                              max_new_tokens=24, pad_token_id=0, return_dict_in_generate=True, **settings)
        for row, p in enumerate(prompts):
            alone = target.generate(p, assistant_model=draft, stopping_policy=policy(), max_new_tokens=24, **settings)
            assert out.sequences[row, width:].tolist() == alone[0, p.shape[1]:].tolist(), (settings, row)
            assert alone.tolist() == target.generate(p, max_new_tokens=24, do_sample=False).tolist()
        if "pacer_lookup" in settings:
            assert sum(s.free for s in out.pacer_stats.steps) > 0


def test_logits_processors_and_stop_strings_per_row():
    """Processors that read a row's tokens (repetition penalty, no repeated n-grams, bad words) and ones that count its
    length (min_new_tokens, min_length, a length penalty's start, suppressed tokens at the start), and stop strings:
    each row processed as if alone, so each row is its own output."""
    target, draft = _exact_pair("llama")
    tokenizer = word_tokenizer()
    settings = [dict(repetition_penalty=1.4, no_repeat_ngram_size=2, bad_words_ids=[[7], [3, 4]]),
                dict(min_new_tokens=9, eos_token_id=11),
                dict(exponential_decay_length_penalty=(4, 1.5), eos_token_id=11, begin_suppress_tokens=[5, 6]),
                dict(stop_strings=["[9]"], tokenizer=tokenizer)]
    for extra, lengths in itertools.product(settings, ([3, 10, 1, 6], [10, 3, 6])):  # the first row padded or not
        _assert_rows_are_alone(target, draft, lengths, 16,
                               lambda: dict(stopping_policy=FixedLength(3), do_sample=False, **extra),
                               expect_plain=False)


def test_scores_and_logits_per_row():
    """output_scores / output_logits: a (batch, vocab) tensor a token, row i's its own (those of row i alone), zeros
    past a row's end."""
    target, draft = _exact_pair("llama", draft_kind="same")
    prompts, ids, mask = _batch([3, 7], seed=2)
    eos = int(target.generate(prompts[0], max_new_tokens=4, do_sample=False)[0, -1])
    settings = dict(max_new_tokens=10, eos_token_id=eos, pad_token_id=0, output_scores=True, output_logits=True,
                    return_dict_in_generate=True, stopping_policy=FixedLength(2))
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, **settings)
    assert len(out.scores) == len(out.logits) == out.sequences.shape[1] - ids.shape[1]
    for row, prompt in enumerate(prompts):
        alone = target.generate(prompt, assistant_model=draft, **settings)
        for t, (scores, logits) in enumerate(zip(out.scores, out.logits)):
            assert scores.shape == (2, VOCAB)
            if t < len(alone.scores):
                assert torch.equal(scores[row], alone.scores[t][0]) and torch.equal(logits[row], alone.logits[t][0])
            else:
                assert not bool(scores[row].any())


def test_a_packed_call_is_each_sequence_alone():
    """The packed forward itself: three sequences' prompts in one call, then two of them (in another order) with
    several tokens each: each sequence's logits bitwise those of its own forwards over a DynamicCache, over an exact
    target with a sliding window."""
    target, _ = _exact_pair("mistral-sw6", torch.bfloat16)
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (9, 1, 12)]
    steps = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (3, 1, 4)]
    with torch.no_grad():
        alone = []
        for p, s in zip(prompts, steps):
            cache = DynamicCache(config=target.config)
            alone.append((model_forward(target, p, cache, p.shape[1])[0], model_forward(target, s, cache, s.shape[1])[0]))
        cache = RowCache(3, 32)
        first = packed_forward(target, cache, list(enumerate(prompts)), [p.shape[1] for p in prompts],
                               cache_kwargs=cache_kwargs)
        assert cache.lengths == [9, 1, 12]
        second = packed_forward(target, cache, [(2, steps[2]), (0, steps[0])], [4, 1], cache_kwargs=cache_kwargs)
    for (logits, _), (expected, _) in zip(first, alone):
        assert torch.equal(logits, expected)
    assert torch.equal(second[0][0], alone[2][1]) and torch.equal(second[1][0], alone[0][1][:, -1:])
    assert cache.lengths == [12, 1, 16]
    cache.crop_row(2, 13)
    assert cache.lengths == [12, 1, 13]
    with pytest.raises(ValueError, match="cannot take 40 more tokens"):
        cache.plan([1], [40], "cpu")


def test_sampled_rows_follow_the_targets_distribution_independently():
    """Sampling a batch of three rows (two of the same prompt, one of another, left-padded): each row's first three
    tokens follow the target's distribution for its prompt (chi-square), not the draft's; the two rows of one prompt
    are independent of each other (their first tokens' joint counts against the product of the marginals)."""
    from test_sampling import NEW, RUNS, SETTINGS, V, _exact_distribution
    import test_sampling

    target, draft = make_pair("llama", "llama", "random", vocab=V)
    other = torch.tensor([[2, 3]])
    prompt = test_sampling.PROMPT
    ids = torch.cat([prompt, torch.cat([torch.zeros(1, 2, dtype=torch.long), other], dim=1), prompt])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]])
    counts = [dict(), dict(), dict()]
    pairs: dict = {}
    drafted = accepted = 0
    runs = RUNS // 2
    for seed in range(runs):
        torch.manual_seed(seed)
        out = target.generate(ids, attention_mask=mask, assistant_model=draft, stopping_policy=POLICIES["fixed4"](),
                              pad_token_id=0, return_dict_in_generate=True, **SETTINGS)
        outcomes = [tuple(out.sequences[row, 4:4 + NEW].tolist()) for row in range(3)]
        for row, outcome in enumerate(outcomes):
            counts[row][outcome] = counts[row].get(outcome, 0) + 1
        pairs[(outcomes[0][0], outcomes[2][0])] = pairs.get((outcomes[0][0], outcomes[2][0]), 0) + 1
        drafted += sum(s.drafted for s in out.pacer_stats.steps)
        accepted += sum(s.accepted for s in out.pacer_stats.steps)
    assert 0 < accepted < drafted
    test_sampling.PROMPT = other
    try:
        other_probs = _exact_distribution(target)
        other_draft = _exact_distribution(draft)
    finally:
        test_sampling.PROMPT = prompt
    prompt_probs, prompt_draft = _exact_distribution(target), _exact_distribution(draft)
    for row, (probs, wrong) in enumerate(((prompt_probs, prompt_draft), (other_probs, other_draft),
                                          (prompt_probs, prompt_draft))):
        assert _chi_square_p_value(counts[row], probs, runs) > 1e-3, row
        assert _chi_square_p_value(counts[row], wrong, runs) < 1e-6, row
    # independence of rows 0 and 2: their first tokens' joint counts fit the product of their marginals
    first = [{}, {}]
    for (a, b), n in pairs.items():
        first[0][a] = first[0].get(a, 0) + n
        first[1][b] = first[1].get(b, 0) + n
    product = {(a, b): first[0].get(a, 0) * first[1].get(b, 0) / runs ** 2 for a, b in itertools.product(range(V), repeat=2)}
    assert _chi_square_p_value(pairs, product, runs) > 1e-3


def test_what_a_batch_cannot_do_is_refused_before_any_work(monkeypatch):
    """A streamer (transformers' take one row), a step callback, a static cache, no pad_token_id, an attention
    implementation a packed call cannot mask, a target padded to a fixed row shape: clear errors, no forward run."""
    target, draft = _exact_pair("llama")
    _, ids, mask = _batch([3, 5])
    for name in ("model_forward", "rows_forward"):
        monkeypatch.setattr(loop, name, lambda *a, **k: pytest.fail("a forward ran before the checks"))
    base = dict(attention_mask=mask, assistant_model=draft, stopping_policy="fixed", max_new_tokens=4)
    cases = [(dict(streamer=TextStreamer(word_tokenizer()), pad_token_id=0), "A streamer takes one sequence"),
             (dict(pacer_step_callback=lambda *a: None, pad_token_id=0), "pacer_step_callback sees one sequence"),
             (dict(cache_implementation="static", pad_token_id=0), "not a static cache"),
             (dict(), "set pad_token_id")]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            target.generate(ids, **base, **extra)
    other = make_model("llama", seed=2)
    other.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        target.generate(ids, attention_mask=mask, assistant_model=other, stopping_policy="fixed", max_new_tokens=4,
                        pad_token_id=0)
    from modeling_pacer.gpu.fixed_rows import fixed_rows

    padded = fixed_rows(enable_pacer(make_model("llama", seed=3)), 8)  # a GPU's exact way: every call one fixed shape
    with pytest.raises(ValueError, match="fixed number of rows"):
        padded.generate(ids, **base, pad_token_id=0)


@pytest.mark.skipif(not __import__("modeling_pacer.cpu.kernels", fromlist=["available"]).available(),
                    reason="pacer's kernels are not built for this CPU")
def test_the_fused_w4a8_target_and_int4_draft():
    """The fused target (every row on pacer's kernels, the packed rows written at their slots and reading their own
    keys) and the fused int4 draft: each row of a batch of 4 is the fused target's own greedy output, with a short
    and a long fixed draft and SVIP; the packed calls ran on the kernels."""
    from modeling_pacer.cpu import kernels
    from modeling_pacer.cpu.fused_layers import fuse_target_layers
    from test_fused_layers import _noisy_draft, _w4a8_target

    target = _w4a8_target()
    fuse_target_layers(target)
    enable_pacer(target)
    draft = _noisy_draft()
    calls = []
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(kernels, "decoder_layers",
                        lambda *a, _f=kernels.decoder_layers, **k: calls.append(k.get("rows") is not None) or _f(*a, **k))
    try:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 96, (1, n), generator=g) for n in (9, 1, 30, 4)]
        width = 30
        ids = torch.zeros(4, width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - p.shape[1]:], mask[row, width - p.shape[1]:] = p[0], 1
        expected = [target.generate(p, max_new_tokens=24, do_sample=False)[0, p.shape[1]:] for p in prompts]
        for policy in (FixedLength(2), FixedLength(16), "svip"):
            calls.clear()
            out = target.generate(ids, attention_mask=mask, assistant_model=draft, stopping_policy=policy,
                                  max_new_tokens=24, pad_token_id=0)
            for row in range(4):
                assert out[row, width:].tolist() == expected[row].tolist(), (policy, row)
            assert sum(calls) >= 10  # the packed calls went through the one-call kernel
    finally:
        monkeypatch.undo()


def test_a_prefix_constraint_is_told_each_rows_index():
    """prefix_allowed_tokens_fn gets the row's index as its batch id, as in transformers' batched generate; a
    constraint that reads only the tokens keeps every row its own output."""
    target, draft = _exact_pair("llama")
    prompts, ids, mask = _batch([4, 7, 2], seed=8)
    seen = set()

    def allowed(batch_id, tokens):
        seen.add(batch_id)
        return [t for t in range(VOCAB) if (t + int(tokens[-1])) % 3]

    out = target.generate(ids, attention_mask=mask, assistant_model=draft, stopping_policy=FixedLength(3),
                          max_new_tokens=12, pad_token_id=0, prefix_allowed_tokens_fn=allowed)
    assert seen == {0, 1, 2}
    for row, prompt in enumerate(prompts):
        alone = target.generate(prompt, max_new_tokens=12, do_sample=False, prefix_allowed_tokens_fn=allowed)
        assert out[row, ids.shape[1]:].tolist() == alone[0, prompt.shape[1]:].tolist()


def test_a_row_streamer_and_a_row_callback_see_each_rows_tokens():
    """A streamer with put_row gets the batch's prompts, then each row's tokens as they come (together its row's
    output); a step callback that takes `row` is told each row's steps."""
    target, draft = _exact_pair("llama")
    prompts, ids, mask = _batch([4, 9, 2], seed=6)

    class Rows:
        def __init__(self):
            self.prompts, self.rows, self.ended = None, {}, False

        def put(self, value):
            self.prompts = value

        def put_row(self, row, value):
            self.rows.setdefault(row, []).extend(value.tolist())

        def end(self):
            self.ended = True

    streamer, steps = Rows(), {}

    def on_step(ids, proposal, target_scores, num_accepted, row):
        steps.setdefault(row, []).append(num_accepted)

    out = target.generate(ids, attention_mask=mask, assistant_model=draft, stopping_policy=FixedLength(3),
                          max_new_tokens=15, pad_token_id=0, streamer=streamer, pacer_step_callback=on_step)
    assert streamer.ended and torch.equal(streamer.prompts, ids)
    for row, prompt in enumerate(prompts):
        assert streamer.rows[row] == out[row, ids.shape[1]:].tolist()
        assert len(steps[row]) == len(streamer.rows[row]) - sum(steps[row])  # a step: its accepted tokens + one
