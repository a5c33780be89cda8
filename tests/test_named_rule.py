"""The cost-aware rule on the draft's probability, the default head's rule, by name and without a head:
`generate(..., stopping_policy="throughput")` measures and caches this machine's costs as the head path does, and
decides exactly as the default head does."""

import torch

import modeling_pacer.costs as costs_module
from modeling_pacer import CostModel, PacerConfig, make_policy
from modeling_pacer.resources import data_folder

from conftest import make_head, make_pair

PROMPTS = [torch.tensor([[3, 1, 4, 1, 5]]), torch.tensor([[9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]])]
COSTS = CostModel({n: 1.0 + 0.01 * n for n in range(1, 14)}, 0.02)  # a flat curve, a cheap draft: long drafts pay


def test_the_named_rule_is_the_default_heads_rule():
    config = PacerConfig.from_pretrained(data_folder("heads") / "qwen2.5-coder-1.5b-0.5b-int4-soft")
    assert repr(make_policy("throughput", None, COSTS)) == repr(make_policy(None, config, COSTS))


def test_named_rule_gives_the_default_head_paths_tokens_and_draft_lengths():
    target, draft = make_pair("llama", "llama", "noisy")
    with torch.no_grad():  # confident models (a tiny random model's distribution is near uniform): drafts of varied length
        for model in (target, draft):
            model.lm_head.weight.mul_(20)
    config = PacerConfig.from_pretrained(data_folder("heads") / "qwen2.5-coder-1.5b-0.5b-int4-soft").to_dict()
    settings = {k: config[k] for k in ("stopping_rule", "throughput_estimate", "max_draft_length", "calibration",
                                       "draft_nothing", "use_draft_features", "draft_prior")}
    head = make_head(draft, **settings)  # the default head's rule, for this tiny draft
    longest = 0
    for prompt in PROMPTS:
        for new in (5, 40):
            runs = [target.generate(prompt, assistant_model=draft, max_new_tokens=new, pacer_costs=COSTS,
                                    return_dict_in_generate=True, **kwargs)
                    for kwargs in (dict(pacer_head=head), dict(stopping_policy="throughput"))]
            assert torch.equal(runs[0].sequences, runs[1].sequences)
            lengths = [[s.drafted for s in run.pacer_stats.steps] for run in runs]
            assert lengths[0] == lengths[1]
            longest = max(longest, *lengths[0])
    assert longest > 1  # the rule chose lengths: not a run of one-token drafts


def test_named_rule_measures_the_costs_for_the_caller(monkeypatch):
    target, draft = make_pair("llama", "llama", "noisy")
    asked = []

    def host_costs(model, draft_model, head, *, max_tokens, **kwargs):
        asked.append((model, draft_model, head, max_tokens))
        return COSTS

    monkeypatch.setattr(costs_module, "host_costs", host_costs)
    out = target.generate(PROMPTS[0], assistant_model=draft, stopping_policy="throughput", max_new_tokens=12,
                          return_dict_in_generate=True)
    assert asked == [(target, draft, None, 13)]
    assert out.pacer_policy.costs is COSTS and out.pacer_policy.estimate == "draft"


def test_every_rule_round_trips_through_its_settings():
    """`to_dict` / `from_dict`: each rule, with non-default settings, comes back equal (its settings and its repr);
    the cost model is the machine's, never part of the settings."""
    import json

    from modeling_pacer import POLICIES, StoppingPolicy, policy_from_dict

    changed = {"fixed": dict(gamma=5), "heuristic": dict(initial_gamma=4, max_draft_length=9),
               "confidence": dict(threshold=0.3, adaptive=False, max_draft_length=7), "svip": dict(threshold=0.6),
               "specdec++": dict(threshold=0.5, max_draft_length=6),
               "pacer": dict(block_size=2, threshold=0.4, growth=1.2, max_draft_length=10, first_block_size=3),
               "throughput": dict(estimate="both", calibration=4.0, draft_nothing=True, probe_every=3, block_size=2)}
    assert set(changed) == set(POLICIES)
    for name, settings in changed.items():
        policy = policy_from_dict(dict(name=name, **settings), COSTS)
        saved = json.loads(json.dumps(policy.to_dict()))  # JSON-ready
        assert saved["name"] == name and "costs" not in saved
        assert all(saved[k] == v for k, v in settings.items())
        back = StoppingPolicy.from_dict(saved, COSTS)
        assert type(back) is type(policy) and back.to_dict() == saved and repr(back) == repr(policy)


def test_bad_settings_are_refused_naming_the_problem():
    import pytest

    from modeling_pacer import policy_from_dict

    for settings, message in [({"gamma": 2}, "'name'"), ({"name": "fixd"}, "Unknown stopping rule 'fixd'"),
                              ({"name": "fixed", "gama": 2}, "no setting 'gama'"),
                              ({"name": "throughput", "costs": 1}, "no setting 'costs'"),
                              ({"name": "pacer", "threshold": 2.0}, "threshold")]:
        with pytest.raises(ValueError, match=message):
            policy_from_dict(settings, COSTS)


def test_a_heads_rule_is_its_settings_and_an_old_head_still_reads(tmp_path):
    """The default head's rule as settings is the rule `generate` runs for it; a config written before the rule's later
    fields existed (no first_block_size, calibration, draft_nothing, sampling_*) reads as the block rule it was."""
    import json

    from modeling_pacer import head_policy, policy_from_dict

    config = PacerConfig.from_pretrained(data_folder("heads") / "qwen2.5-coder-1.5b-0.5b-int4-soft")
    settings = head_policy(config)
    assert settings["name"] == "throughput" and settings["estimate"] == "draft"
    assert repr(policy_from_dict(settings, COSTS)) == repr(make_policy(None, config, COSTS))
    old = json.loads((data_folder("heads") / "qwen2.5-coder-1.5b-0.5b-int4-soft" / "config.json").read_text())
    for field in ("first_block_size", "stopping_rule", "throughput_estimate", "calibration", "sampling_stopping_rule",
                  "sampling_throughput_estimate", "draft_quantization", "draft_nothing", "use_draft_features",
                  "draft_prior"):
        old.pop(field, None)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    old_config = PacerConfig.from_pretrained(tmp_path / "old")
    assert head_policy(old_config) == dict(name="pacer", block_size=old["block_size"], threshold=old["threshold"],
                                           growth=old["growth"], max_draft_length=old["max_draft_length"],
                                           first_block_size=0)


def test_rule_settings_in_generate_measure_costs_and_match_the_name(monkeypatch):
    """`stopping_policy=<settings>`: the cost-aware rule given as settings is measured for like the name, decides
    as the name does; settings that cannot work are refused before any measurement."""
    import pytest

    target, draft = make_pair("llama", "llama", "noisy")
    asked = []
    monkeypatch.setattr(costs_module, "host_costs", lambda *a, **k: asked.append(k["max_tokens"]) or COSTS)
    runs = [target.generate(PROMPTS[1], assistant_model=draft, max_new_tokens=20, stopping_policy=policy,
                            return_dict_in_generate=True)
            for policy in ("throughput", {"name": "throughput"}, {"name": "throughput", "max_draft_length": 6})]
    assert asked == [13, 13, 7]
    assert torch.equal(runs[0].sequences, runs[1].sequences) and torch.equal(runs[0].sequences, runs[2].sequences)
    assert [s.drafted for s in runs[0].pacer_stats.steps] == [s.drafted for s in runs[1].pacer_stats.steps]
    plain = target.generate(PROMPTS[1], max_new_tokens=20, do_sample=False)
    assert torch.equal(runs[0].sequences, plain)  # lossless, as every path
    for bad in ({"name": "throughput", "estimate": "head"}, {"name": "throughput", "gamma": 3}):
        with pytest.raises(ValueError):
            target.generate(PROMPTS[0], assistant_model=draft, max_new_tokens=8, stopping_policy=bad)
    assert asked == [13, 13, 7]  # nothing measured for them
