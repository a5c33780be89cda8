"""The stopping rules themselves, fed hand-made head predictions (no models)."""

import pytest
import torch

from modeling_pacer import ExpectedThroughput, Pacer
from modeling_pacer.custom_generate.policies import DraftView


def _stop_length(policy, acceptance: torch.Tensor) -> int:
    """Draft length at which `policy` stops when the head predicts `acceptance` `(max,)` for a draft."""
    policy.reset()
    policy.begin_step()
    for k in range(1, policy.max_draft_length + 1):
        view = DraftView(torch.ones(k), torch.zeros(k), lambda k=k: acceptance[:k])
        if policy.stop_reason(view) is not None:
            return k
    return policy.max_draft_length


def test_pacer_rule_block_mean_and_growth():
    # cumulative predictions 0.9, 0.8, 0.7, ... : block means with b=2 are 0.85, 0.65, 0.45, ...
    acceptance = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    assert _stop_length(Pacer(block_size=2, threshold=0.6, growth=1.0, max_draft_length=8), acceptance) == 6
    # growth: the threshold after the first block is 0.6 * 1.2 = 0.72 > 0.65
    assert _stop_length(Pacer(block_size=2, threshold=0.6, growth=1.2, max_draft_length=8), acceptance) == 4
    # a head that predicts rejection everywhere stops after the first block
    low = torch.full((8,), 0.01)
    assert _stop_length(Pacer(block_size=1, threshold=0.5, growth=1.0, max_draft_length=8), low) == 1
    assert _stop_length(Pacer(block_size=3, threshold=0.5, growth=1.0, max_draft_length=8), low) == 3


def test_pacer_first_block():
    acceptance = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    low = torch.full((8,), 0.01)
    # blocks of 2 after a first block of 3: checks at 3, 5, 7
    assert _stop_length(Pacer(block_size=2, threshold=0.5, growth=1.0, max_draft_length=8, first_block_size=3), low) == 3
    # the first check averages the whole first block (0.9, 0.8, 0.7: 0.8 >= 0.75), the next one tokens 4-5 (0.55)
    rule = Pacer(block_size=2, threshold=0.75, growth=1.0, max_draft_length=8, first_block_size=3)
    assert _stop_length(rule, acceptance) == 5
    # stair-aligned: a first block of 2 then blocks of 3 end at 2, 5, 8
    high = torch.full((8,), 0.99)
    rule = Pacer(block_size=3, threshold=0.5, growth=1.0, max_draft_length=8, first_block_size=2)
    assert _stop_length(rule, torch.cat([high[:5], low[:3]])) == 8
    assert _stop_length(rule, torch.cat([high[:2], low[:6]])) == 5
    # first_block_size equal to block_size is the paper's rule
    for p in (acceptance, low, high):
        assert _stop_length(Pacer(2, 0.6, 1.1, 8, first_block_size=2), p) == _stop_length(Pacer(2, 0.6, 1.1, 8), p)


def test_head_default_rule_follows_its_config():
    from modeling_pacer import PacerConfig, make_policy
    from modeling_pacer.costs import CostModel

    costs = CostModel({n: 1.0 for n in range(1, 10)}, 0.1)
    blocks = PacerConfig(draft_hidden_size=8, max_draft_length=8)
    cost_aware = PacerConfig(draft_hidden_size=8, max_draft_length=8, stopping_rule="throughput")
    assert isinstance(make_policy(None, blocks, costs), Pacer)
    policy = make_policy(None, cost_aware, costs)
    assert isinstance(policy, ExpectedThroughput) and policy.needs_head and policy.max_draft_length == 8
    assert policy.estimate == "head" and policy.calibration is None and not policy.draft_nothing
    refitted = PacerConfig(draft_hidden_size=8, max_draft_length=8, stopping_rule="throughput",
                           throughput_estimate="both", calibration=16.0, draft_nothing=True)
    policy = make_policy(None, refitted, costs)
    assert (policy.estimate, policy.calibration, policy.draft_nothing) == ("both", 16.0, True)
    draft_only = PacerConfig(draft_hidden_size=8, max_draft_length=8, stopping_rule="throughput",
                             throughput_estimate="draft")
    policy = make_policy(None, draft_only, costs)
    assert (policy.estimate, policy.calibration, policy.needs_head) == ("draft", None, False)
    with pytest.raises(ValueError, match="throughput_estimate must be 'head', 'both' or 'draft'"):
        PacerConfig(draft_hidden_size=8, stopping_rule="throughput", throughput_estimate="target")
    assert isinstance(make_policy("pacer", cost_aware, costs), Pacer)  # named: the paper's rule
    with pytest.raises(ValueError, match="pacer_costs=modeling_pacer.host_costs"):
        make_policy(None, cost_aware)
    with pytest.raises(ValueError, match="stopping_rule must be 'blocks' or 'throughput'"):
        PacerConfig(draft_hidden_size=8, stopping_rule="fastest")


def test_head_default_rule_follows_the_mode():
    """`sampling_stopping_rule` / `sampling_throughput_estimate` name the sampled-decoding rule; unset, sampling
    runs the greedy rule."""
    from modeling_pacer import PacerConfig, make_policy
    from modeling_pacer.costs import CostModel
    from modeling_pacer.custom_generate.policies import head_rule

    costs = CostModel({n: 1.0 for n in range(1, 10)}, 0.1)
    both = PacerConfig(draft_hidden_size=8, max_draft_length=8, stopping_rule="throughput", throughput_estimate="draft",
                       sampling_stopping_rule="blocks")
    assert head_rule(both) == ("throughput", "draft") and head_rule(both, do_sample=True) == ("blocks", "draft")
    assert make_policy(None, both, costs).estimate == "draft"
    assert isinstance(make_policy(None, both, None, do_sample=True), Pacer)  # the block rule needs no cost curve
    head_when_sampling = PacerConfig(draft_hidden_size=8, max_draft_length=8, stopping_rule="throughput",
                                     throughput_estimate="draft", sampling_throughput_estimate="head")
    assert make_policy(None, head_when_sampling, costs, do_sample=True).estimate == "head"
    same = PacerConfig(draft_hidden_size=8, max_draft_length=8, stopping_rule="throughput", throughput_estimate="draft")
    assert head_rule(same, do_sample=True) == head_rule(same) == ("throughput", "draft")
