"""The fixed row shape (`modeling_pacer.gpu.fixed_rows`), the GPU's candidate for exact verification, checked on the CPU:
its padding, chunking and cache bookkeeping (in float64, where the padded calls' logits must match the plain model's
to 1e-9: a wrong position, a padding row seen by a real one, or a cache left uncropped shows far above that), its
refusals, and PACER through it token for token against the target alone (both exact by make_exact, so the test
depends on no kernel choice)."""

import pytest
import torch
from transformers import DynamicCache

from modeling_pacer import make_exact
from modeling_pacer.custom_generate.generate import model_forward
from modeling_pacer.gpu.fixed_rows import fixed_rows, fixed_rows_of, row_agreement

from conftest import make_head, make_model, make_pair

PROMPTS = [torch.tensor([[3, 1, 4, 1, 5]]), torch.tensor([[9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]]), torch.tensor([[7]])]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_padded_calls_compute_what_the_model_does(arch):
    plain = make_model(arch, seed=1).to(torch.float64)
    padded = fixed_rows(make_model(arch, seed=1).to(torch.float64), rows=4)
    assert fixed_rows_of(padded) == 4 and fixed_rows_of(plain) is None
    ids = (torch.arange(23) * 31 % 97)[None]
    caches = [DynamicCache(config=plain.config), DynamicCache(config=padded.config)]
    # a prompt longer than two chunks and not a multiple of the rows, then steps, a block, a block of exactly `rows`
    for start, end in ((0, 10), (10, 11), (11, 14), (14, 18), (18, 23)):
        want, _ = model_forward(plain, ids[:, start:end], caches[0], end - start, hidden=True)
        got, _ = model_forward(padded, ids[:, start:end], caches[1], end - start, hidden=True)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-9)
        assert caches[1].get_seq_length() == end  # the padding's keys and values left the cache
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(a.keys, b.keys, rtol=0, atol=1e-12) and torch.allclose(a.values, b.values, rtol=0, atol=1e-12)


def test_logits_to_keep_and_hidden_states_over_chunks():
    model = fixed_rows(make_model("llama", seed=1).to(torch.float64), rows=3)
    plain = make_model("llama", seed=1).to(torch.float64)
    ids = (torch.arange(8) * 5 % 97)[None]
    for keep in (0, 1, 2, 4, 8):
        out = model(input_ids=ids, cache=DynamicCache(config=model.config), logits_to_keep=keep, output_hidden_states=True)
        want = plain(input_ids=ids, logits_to_keep=keep, output_hidden_states=True)
        assert out.logits.shape == want.logits.shape
        assert torch.allclose(out.logits, want.logits, rtol=0, atol=1e-9)
        assert len(out.hidden_states) == len(want.hidden_states)
        assert all(torch.allclose(a, b, rtol=0, atol=1e-9) for a, b in zip(out.hidden_states, want.hidden_states))


def test_refuses_what_it_cannot_pad_exactly():
    model = fixed_rows(make_model("llama", seed=1), rows=4)
    ids = torch.tensor([[1, 2, 3]])
    for kwargs, what in ((dict(input_ids=ids.repeat(2, 1)), "shape"), (dict(inputs_embeds=torch.zeros(1, 3, 32)), "inputs_embeds"),
                         (dict(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1]])), "padding"),
                         (dict(input_ids=ids, position_ids=torch.arange(4)[None]), "position_ids")):
        with pytest.raises(ValueError, match=f"fixed_rows: .*{what}"):
            model(**kwargs)
    with pytest.raises(ValueError, match="rows must be an integer >= 1"):
        fixed_rows(make_model("llama", seed=1), rows=0)
    windowed = make_model("qwen2", seed=1)
    windowed.config.use_sliding_window, windowed.config.sliding_window = True, 4
    windowed.config.layer_types = ["sliding_attention"] * windowed.config.num_hidden_layers
    with pytest.raises(ValueError, match="sliding-window"):
        fixed_rows(windowed)


def test_row_agreement_reports_each_size_and_the_prefill():
    model = make_exact(make_model("llama", seed=1).to(torch.bfloat16), rows=(1, 8))
    report = row_agreement(model, torch.tensor([[5, 6, 7, 8, 9, 10]]), sizes=range(1, 5))
    assert set(report) == {1, 2, 3, 4, "prefill"}
    assert all(value == 0.0 for value in report.values())  # exact by construction (pacer_exact, one row range)


@pytest.mark.parametrize("policy", ["fixed", "svip", "pacer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pacer_through_fixed_rows_is_the_target_alone(policy, dtype):
    target, draft = make_pair("llama", "llama", "noisy")
    target = fixed_rows(make_exact(target.to(dtype), rows=(1, 8)), rows=5)
    draft = draft.to(dtype)
    head = make_head(draft).to(dtype)
    for prompt in PROMPTS:
        for new in (1, 7, 30):
            want = target.generate(prompt, max_new_tokens=new, do_sample=False)
            got = target.generate(prompt, assistant_model=draft, pacer_head=head, stopping_policy=policy,
                                  max_new_tokens=new, do_sample=False)
            assert torch.equal(got, want), (policy, dtype, prompt.tolist(), new)


def _noisy(model):
    """A candidate that is never exact: every call's logits get fresh noise."""
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits + 1e-3 * torch.randn_like(out.logits)
        return out

    model.forward = forward


def test_choose_exact_keeps_the_first_exact_way_and_undoes_the_others():
    from modeling_pacer.exact import choose_exact, exact_candidates

    model = make_model("llama", seed=1).to(torch.bfloat16)
    attention = model.config._attn_implementation
    candidates = {"noisy": _noisy, "rows-alone": exact_candidates(4)["rows-alone"]}
    choose_exact(model, rows=4, candidates=candidates)
    assert model._pacer_exact == "rows-alone" and "forward" not in vars(model)  # the noisy wrapper is gone
    target, draft = make_pair("llama", "llama", "noisy")
    target = choose_exact(target.to(torch.bfloat16), rows=4, candidates=candidates)
    out = target.generate(PROMPTS[1], assistant_model=draft.to(torch.bfloat16), stopping_policy="fixed",
                          max_new_tokens=8, return_dict_in_generate=True)
    assert out.pacer_stats.target_exact == "rows-alone"
    with pytest.warns(UserWarning, match="no way to exact verification was found"):
        choose_exact(model := make_model("llama", seed=1), rows=4, candidates={"noisy": _noisy})
    assert model._pacer_exact is None and "forward" not in vars(model)
    assert model.config._attn_implementation == attention


def test_make_exact_on_the_cpu_says_which_way():
    model = make_exact(make_model("llama", seed=1))
    assert model._pacer_exact == "rows-alone"
