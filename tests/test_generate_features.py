"""Everything `generate` honours keeps working under PACER decoding: lengths, EOS, stop strings,
custom stopping criteria, prefix-dependent logits processors, streamers, scores, statistics, and the
three ways in: `enable_pacer`, a `custom_generate` callable, a `custom_generate` folder."""

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import modeling_pacer
from modeling_pacer import DecodeStep, FixedLength, Pacer, pacer_decoding

from conftest import make_head, make_model, make_pair, word_tokenizer

PROMPT = torch.tensor([[5, 17, 42, 8, 91, 33]])


def _pacer_out(target, draft, ids, policy=None, head=None, **kwargs):
    head = head if head is not None else make_head(draft, max_draft_length=16)
    policy = policy if policy is not None else Pacer(block_size=3, threshold=0.3, growth=1.1, max_draft_length=12)
    return target.generate(ids, assistant_model=draft, pacer_head=head, stopping_policy=policy,
                           return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("new", [1, 2, 5, 13, 50])
def test_max_new_tokens_exact(new):
    target, draft = make_pair("llama", "llama", "same")  # full acceptance: drafts overshoot unless capped
    out = _pacer_out(target, draft, PROMPT, policy=FixedLength(7), max_new_tokens=new)
    assert out.sequences.shape[1] == PROMPT.shape[1] + new
    assert out.pacer_stats.generated_tokens == new


def test_max_length_honoured():
    target, draft = make_pair("llama", "llama", "noisy")
    out = _pacer_out(target, draft, PROMPT, max_length=20)
    assert out.sequences.tolist() == target.generate(PROMPT, max_length=20).tolist()
    assert out.sequences.shape[1] == 20


def _first_occurrences(tokens: torch.Tensor) -> list[int]:
    """Positions whose token does not appear earlier: declared EOS, such a token ends generation there."""
    seen, positions = set(), []
    for i, t in enumerate(tokens.tolist()):
        if t not in seen:
            positions.append(i)
        seen.add(t)
    return positions


@pytest.mark.parametrize("gamma", [3, 8])
@pytest.mark.parametrize("which", [1, 2, 4])
def test_eos_inside_accepted_draft_ends_generation(gamma, which):
    target, draft = make_pair("llama", "llama", "same")
    free = target.generate(PROMPT, max_new_tokens=30)[0, PROMPT.shape[1]:]
    # a draft that always agrees: token 0 comes from the prefill, then each step drafts gamma tokens and the
    # target adds one, so the tokens at multiples of gamma + 1 are the target's own, never drafted
    eos_index = [i for i in _first_occurrences(free) if i % (gamma + 1)][which]
    eos = int(free[eos_index])
    expected = target.generate(PROMPT, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    out = _pacer_out(target, draft, PROMPT, policy=FixedLength(gamma), max_new_tokens=30, eos_token_id=eos,
                     pad_token_id=0)
    assert out.sequences.tolist() == expected.tolist()
    assert int(out.sequences[0, -1]) == eos and out.sequences.shape[1] == PROMPT.shape[1] + eos_index + 1
    # the draft proposed EOS, stopped there, and the target accepted it inside the draft
    assert out.pacer_stats.steps[-1].stop_reason == "eos"


def test_eos_with_min_new_tokens_and_repetition_penalty():
    """Processors that read the prefix (min_new_tokens masks EOS by length, repetition penalty by
    content) see, at every draft position, exactly the prefix plain decoding would."""
    target, draft = make_pair("qwen2", "qwen2", "noisy")
    free = target.generate(PROMPT, max_new_tokens=30)[0, PROMPT.shape[1]:]
    eos = int(free[3])
    settings = dict(max_new_tokens=30, eos_token_id=eos, pad_token_id=0, min_new_tokens=8, repetition_penalty=1.3,
                    no_repeat_ngram_size=3)
    expected = target.generate(PROMPT, **settings)
    out = _pacer_out(target, draft, PROMPT, **settings)
    assert out.sequences.tolist() == expected.tolist()


def test_stop_strings():
    target, draft = make_pair("llama", "llama", "same")
    tokenizer = word_tokenizer()
    free = target.generate(PROMPT, max_new_tokens=30)[0, PROMPT.shape[1]:]
    stop = tokenizer.convert_ids_to_tokens(int(free[_first_occurrences(free)[3]]))
    expected = target.generate(PROMPT, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer)
    assert expected.shape[1] < PROMPT.shape[1] + 30  # the stop string really stopped the target
    out = _pacer_out(target, draft, PROMPT, policy=FixedLength(5), max_new_tokens=30, stop_strings=[stop],
                     tokenizer=tokenizer)
    assert out.sequences.tolist() == expected.tolist()


def test_stop_strings_without_tokenizer_is_a_clear_error():
    target, draft = make_pair("llama", "llama", "same")
    with pytest.raises(ValueError, match="tokenizer"):
        _pacer_out(target, draft, PROMPT, max_new_tokens=5, stop_strings=["x"])


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria():
    target, draft = make_pair("llama", "llama", "noisy")
    free = target.generate(PROMPT, max_new_tokens=30)[0, PROMPT.shape[1]:]
    criteria = StoppingCriteriaList([StopAfterToken(int(free[9]))])
    expected = target.generate(PROMPT, max_new_tokens=30, stopping_criteria=criteria)
    out = _pacer_out(target, draft, PROMPT, max_new_tokens=30, stopping_criteria=criteria)
    assert out.sequences.tolist() == expected.tolist()


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ended += 1


def test_streamer_receives_exactly_the_output_tokens():
    target, draft = make_pair("llama", "llama", "noisy")
    streamer = RecordingStreamer()
    out = _pacer_out(target, draft, PROMPT, max_new_tokens=25, streamer=streamer)
    assert streamer.puts[0] == PROMPT[0].tolist()  # the prompt first, as transformers does
    streamed = [t for chunk in streamer.puts[1:] for t in chunk]
    assert streamed == out.sequences[0, PROMPT.shape[1]:].tolist()
    assert streamer.ended == 1
    assert len(streamer.puts) - 1 == len(out.pacer_stats.steps)  # one chunk per decode step


def test_scores_and_logits_match_plain_generate():
    target, draft = make_pair("llama", "llama", "noisy")
    settings = dict(max_new_tokens=12, output_scores=True, output_logits=True, return_dict_in_generate=True,
                    repetition_penalty=1.2)
    expected = target.generate(PROMPT, **settings)
    out = target.generate(PROMPT, assistant_model=draft, stopping_policy=FixedLength(3), **settings)
    assert len(out.scores) == len(expected.scores) == len(out.logits) == 12
    for ours, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(out.logits, expected.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "confidence", "svip", "specdec++", "pacer"])
def test_stats_are_consistent(policy):
    target, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, max_draft_length=16)
    out = target.generate(PROMPT, assistant_model=draft, pacer_head=head, stopping_policy=policy,
                          max_new_tokens=40, return_dict_in_generate=True)
    stats = out.pacer_stats
    generated = out.sequences.shape[1] - PROMPT.shape[1]
    assert stats.generated_tokens == generated == 40
    for step in stats.steps[:-1]:
        assert step.emitted == step.accepted + 1  # accepted drafts + the target's correction/bonus
        assert 0 <= step.accepted <= step.drafted
    assert stats.steps[-1].emitted <= stats.steps[-1].accepted + 1
    assert stats.steps[0] == DecodeStep(drafted=0, accepted=0, emitted=1, stop_reason="prefill")
    assert stats.target_forwards == len(stats.steps)  # one target forward per step: the prefill, then verifications
    # every draft token is one draft forward, minus none: drafts are produced one forward at a time
    assert stats.draft_forwards == sum(s.drafted for s in stats.steps)
    uses_head = policy in ("specdec++", "pacer")
    assert (stats.head_forwards > 0) == uses_head and (stats.head_time > 0) == uses_head
    assert stats.draft_time > 0 and stats.target_time > 0
    assert stats.total_time >= stats.draft_time + stats.target_time + stats.head_time
    assert sum(stats.draft_length_histogram().values()) == len(stats.steps)
    assert stats.to_dict()["generated_tokens"] == 40


def test_without_pacer_arguments_generate_is_untouched():
    target, draft = make_pair("llama", "llama", "noisy")
    plain = make_model("llama", seed=1)
    assert target.generate(PROMPT, max_new_tokens=10).tolist() == plain.generate(PROMPT, max_new_tokens=10).tolist()
    # transformers' own assisted generation still runs through the bound generate
    assisted = target.generate(PROMPT, assistant_model=draft, max_new_tokens=10)
    assert assisted.tolist() == plain.generate(PROMPT, max_new_tokens=10).tolist()


@pytest.mark.parametrize("way", ["enable_pacer", "callable", "folder"])
@pytest.mark.parametrize("call", ["positional", "inputs", "input_ids"])
def test_every_way_in_accepts_positional_and_keyword_inputs(way, call, tmp_path):
    _, draft = make_pair("llama", "llama", "noisy")
    expected = make_model("llama", seed=1).generate(PROMPT, max_new_tokens=12).tolist()
    target = make_model("llama", seed=1)
    pacer = dict(stopping_policy=FixedLength(3), max_new_tokens=12)
    if way == "enable_pacer":
        modeling_pacer.enable_pacer(target)
        pacer.update(assistant_model=draft)
    elif way == "callable":
        pacer.update(custom_generate=pacer_decoding, draft_model=draft)
    else:
        pacer.update(custom_generate=str(_custom_generate_folder(tmp_path)), trust_remote_code=True, assistant_model=draft)
    if call == "positional":
        out = target.generate(PROMPT, **pacer)
    else:
        out = target.generate(**{call: PROMPT}, **pacer)
    assert out.tolist() == expected


def test_custom_generate_callable():
    target = make_model("llama", seed=1)  # no enable_pacer: the plain transformers route
    _, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, max_draft_length=16)
    out = target.generate(PROMPT, custom_generate=pacer_decoding, draft_model=draft, pacer_head=head,
                          max_new_tokens=20, return_dict_in_generate=True)
    assert out.sequences.tolist() == target.generate(PROMPT, max_new_tokens=20).tolist()
    assert out.pacer_stats.head_forwards > 0


def _custom_generate_folder(tmp_path: Path) -> Path:
    """The `custom_generate/` folder as it would be pushed to the Hub: its files, nothing else."""
    source = Path(modeling_pacer.__file__).parent / "custom_generate"
    repo = tmp_path / "pacer-generate"
    (repo / "custom_generate").mkdir(parents=True)
    for module in source.glob("*.py"):  # every module of the folder: one forgotten is a failed import on the Hub
        if module.name != "__init__.py":
            shutil.copy(module, repo / "custom_generate" / module.name)
    return repo


def test_custom_generate_folder_with_trust_remote_code(tmp_path):
    repo = _custom_generate_folder(tmp_path)
    target = make_model("llama", seed=1)
    _, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, max_draft_length=16)
    out = target.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True, assistant_model=draft,
                          pacer_head=head, max_new_tokens=20, return_dict_in_generate=True)
    assert out.sequences.tolist() == target.generate(PROMPT, max_new_tokens=20).tolist()
    assert out.pacer_stats.head_forwards > 0
    # a policy instance from the installed package is accepted by the remote-code copy of the loop
    out = target.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True, assistant_model=draft,
                          stopping_policy=FixedLength(2), max_new_tokens=20, return_dict_in_generate=True)
    assert out.sequences.tolist() == target.generate(PROMPT, max_new_tokens=20).tolist()
    assert set(out.pacer_stats.draft_length_histogram()) <= {0, 1, 2}


def test_target_repo_shipping_custom_generate_binds_it_on_load(tmp_path):
    """transformers binds a repo's `custom_generate/generate.py` as `model.generate` when loading with
    trust_remote_code: a target published with our folder needs no setup line at all."""
    repo = _custom_generate_folder(tmp_path)
    make_model("llama", seed=1).save_pretrained(repo)
    target = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).eval()
    _, draft = make_pair("llama", "llama", "noisy")
    expected = make_model("llama", seed=1).generate(PROMPT, max_new_tokens=15).tolist()
    # transformers binds it as functools.partial(generate, model=target): positional and keyword inputs both work
    assert target.generate(inputs=PROMPT, assistant_model=draft, stopping_policy="fixed", max_new_tokens=15).tolist() == expected
    assert target.generate(PROMPT, assistant_model=draft, stopping_policy="fixed", max_new_tokens=15).tolist() == expected
    head = make_head(draft, max_draft_length=16)
    assert target.generate(PROMPT, assistant_model=draft, pacer_head=head, max_new_tokens=15).tolist() == expected
    # and plain generation through such a target, without PACER's arguments
    assert target.generate(PROMPT, max_new_tokens=15).tolist() == expected
    assert target.generate(input_ids=PROMPT, max_new_tokens=15).tolist() == expected


def test_custom_generate_imports_nothing_of_pacer_outside_itself():
    """The Hub folder's promise: its files import torch, transformers, the standard library and each other only."""
    import ast

    folder = Path(modeling_pacer.__file__).parent / "custom_generate"
    siblings = {p.stem for p in folder.glob("*.py")}
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and (node.module or "").split(".")[0] in siblings | {""}, (path.name, node.module)
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                assert not name.startswith("modeling_pacer"), (path.name, name)
                assert name.split(".")[0] in {"torch", "transformers", *__import__("sys").stdlib_module_names}, (path.name, name)


def test_the_hub_folder_alone_measures_costs_for_a_cost_aware_rule(tmp_path):
    """The remote-code copy of the loop has no pacer installed to cache curves: a head whose rule is cost-aware still
    runs, its costs measured by the loop itself (once per process and models)."""
    repo = _custom_generate_folder(tmp_path)
    target = make_model("llama", seed=1)
    _, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, stopping_rule="throughput", throughput_estimate="draft", max_draft_length=6)
    out = target.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True, assistant_model=draft,
                          pacer_head=head, max_new_tokens=12, return_dict_in_generate=True)
    assert out.sequences.tolist() == target.generate(PROMPT, max_new_tokens=12).tolist()
    assert out.pacer_stats.policy.startswith("ExpectedThroughput(estimate='draft'")
