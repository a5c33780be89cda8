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
