"""Bad input gets a clear ValueError naming the problem, never a wrong answer or a crash inside torch."""

import pytest
import torch

from modeling_pacer import SVIP, Confidence, FixedLength, Heuristic, Pacer, PacerConfig, SpecDecPP, make_policy

from conftest import make_head, make_model, make_pair

PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama", "llama", "noisy")


def test_head_for_another_draft(pair):
    target, draft = pair
    wrong = make_head(make_model("llama", seed=5, hidden=64))
    with pytest.raises(ValueError, match="hidden size is 32"):
        target.generate(PROMPT, assistant_model=draft, pacer_head=wrong, max_new_tokens=5)
    # also when its rule would not read it (a default that reads the draft alone, or a rule named by the caller)
    wrong_draft_rule = make_head(make_model("llama", seed=5, hidden=64), stopping_rule="throughput",
                                 throughput_estimate="draft")
    for head, policy in ((wrong_draft_rule, None), (wrong, "fixed")):
        with pytest.raises(ValueError, match="hidden size is 32"):
            target.generate(PROMPT, assistant_model=draft, pacer_head=head, stopping_policy=policy, max_new_tokens=5)


def test_head_for_another_draft_quantization(pair):
    """A head trained on the int4 draft, given the plain one (or the reverse): refused, naming the flag that loads the
    draft it was trained on, whatever the rule reads; a head that records no setting (older heads) is taken."""
    from modeling_pacer.cpu.quantization import quantize_linears

    target, draft = pair
    for trained_on, flag in (("int4", "--quantize-draft int4"), ("dynamic-int8", "--quantize-draft int8")):
        head = make_head(draft, draft_quantization=trained_on)
        for policy in (None, "fixed"):
            with pytest.raises(ValueError, match=f"trained on the '{trained_on}' draft, but the draft given is 'none'.*{flag}"):
                target.generate(PROMPT, assistant_model=draft, pacer_head=head, stopping_policy=policy, max_new_tokens=5)
    int4_draft = quantize_linears(make_model("llama", seed=1, hidden=64).to(torch.bfloat16), "int4")
    from modeling_pacer.custom_generate.generate import draft_setting

    assert draft_setting(int4_draft) == "int4" and draft_setting(draft) == "none"
    target.generate(PROMPT, assistant_model=draft, pacer_head=make_head(draft, draft_quantization="none"), max_new_tokens=5)
    target.generate(PROMPT, assistant_model=draft, pacer_head=make_head(draft), max_new_tokens=5)


def test_draft_with_another_vocabulary(pair):
    target, _ = pair
    draft = make_model("llama", seed=2, vocab=50)
    with pytest.raises(ValueError, match=r"vocabulary \(50 tokens\) differs from the target's \(97\)"):
        target.generate(PROMPT, assistant_model=draft, stopping_policy="fixed", max_new_tokens=5)


@pytest.mark.parametrize("mask, message", [([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], "row 1 of attention_mask is padded on the right"),
                                           ([[1, 1, 1, 1, 1], [0, 1, 0, 1, 1]], "row 1 of attention_mask has a hole"),
                                           ([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], "row 0 of attention_mask has no token"),
                                           ([[1, 1, 1, 1, 1], [2, 1, 1, 1, 1]], "padding \\(0\\) and tokens \\(1\\)")])
def test_a_batch_that_is_not_left_padded(pair, mask, message):
    """A batch is decoded row by row as if alone only from a left-padded batch (padding_side='left'): a right-padded
    row, a hole, an empty row or a mask of other values is refused before any work."""
    target, draft = pair
    with pytest.raises(ValueError, match=message):
        target.generate(PROMPT.repeat(2, 1), attention_mask=torch.tensor(mask), assistant_model=draft,
                        stopping_policy="fixed", max_new_tokens=5, pad_token_id=0)


def test_no_draft(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="needs a draft model"):
        target.generate(PROMPT, pacer_head=make_head(draft), max_new_tokens=5)


def test_head_policy_without_head(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="needs a head"):
        target.generate(PROMPT, assistant_model=draft, stopping_policy=SpecDecPP(), max_new_tokens=5)
    with pytest.raises(ValueError, match="needs a head"):
        target.generate(PROMPT, assistant_model=draft, stopping_policy="pacer", max_new_tokens=5)


def test_unknown_policy_name(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="Unknown stopping_policy 'eagle'"):
        target.generate(PROMPT, assistant_model=draft, stopping_policy="eagle", max_new_tokens=5)


def test_policy_longer_than_the_head_allows(pair):
    target, draft = pair
    head = make_head(draft, max_draft_length=8)
    with pytest.raises(ValueError, match=r"max_draft_length \(12\) exceeds the head's max_draft_length \(8\)"):
        target.generate(PROMPT, assistant_model=draft, pacer_head=head, stopping_policy=Pacer(max_draft_length=12),
                        max_new_tokens=5)


def test_a_left_padded_row_is_decoded_without_its_padding(pair):
    """A single row with left padding: decoded as its tokens alone (the padding kept in front of the output)."""
    target, draft = pair
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    out = target.generate(PROMPT, attention_mask=mask, assistant_model=draft, stopping_policy="fixed", max_new_tokens=5)
    alone = target.generate(PROMPT[:, 1:], max_new_tokens=5, do_sample=False)
    assert out[:, :1].tolist() == PROMPT[:, :1].tolist() and out[:, 1:].tolist() == alone.tolist()


def test_beam_search(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="beam search"):
        target.generate(PROMPT, num_beams=2, assistant_model=draft, stopping_policy="fixed", max_new_tokens=5)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("threshold", 1.5, "threshold must lie in"),
        ("threshold", -0.1, "threshold must lie in"),
        ("growth", 0.9, "growth must be >= 1"),
        ("block_size", 0, "block_size must be >= 1"),
        ("max_draft_length", 2, r"max_draft_length \(2\) must be >= block_size \(3\)"),
        ("first_block_size", 17, r"first_block_size must lie in \[0, max_draft_length \(16\)\]"),
        ("sampling_stopping_rule", "fast", "sampling_stopping_rule must be None, 'blocks' or 'throughput'"),
        ("sampling_throughput_estimate", "both", "combines two estimates by the online fit: set calibration"),
        ("draft_quantization", "int3", "draft_quantization must be None or one of"),
    ],
)
def test_config_out_of_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        PacerConfig(**{field: value})


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Pacer(threshold=2.0), "PACER threshold"),
        (lambda: Pacer(growth=0.5), "PACER growth"),
        (lambda: Pacer(block_size=0), "block_size"),
        (lambda: Pacer(max_draft_length=4, first_block_size=5), "first_block_size"),
        (lambda: SpecDecPP(threshold=-1.0), "SpecDec\\+\\+ threshold"),
        (lambda: Confidence(threshold=1.2), "Confidence threshold"),
        (lambda: SVIP(threshold=-0.2), "SVIP threshold"),
        (lambda: Heuristic(initial_gamma=0), "initial_gamma"),
        (lambda: FixedLength(-1), "max_draft_length"),
    ],
)
def test_policy_out_of_range(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_make_policy_names():
    assert isinstance(make_policy("fixed"), FixedLength)
    assert isinstance(make_policy("svip"), SVIP)
    assert isinstance(make_policy(None, PacerConfig(block_size=2)), Pacer)
