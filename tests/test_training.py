"""Training data and trainer on tiny models: fast labels equal the exact simulation's, packing masks
are exact, the trainer changes the head and lowers the loss on a learnable task, and a head reading the
draft's own features predicts the same in replay as in the live loop."""

import pytest
import torch

from modeling_pacer import Pacer, PacerConfig, PacerHead
from modeling_pacer.custom_generate.generate import generate
from modeling_pacer.replay import head_acceptance, record_trace
from modeling_pacer.training.data import PackedDraftCollator, examples_from_trace, simulate_drafts, to_dataset
from modeling_pacer.training.training_args import PacerTrainingArguments
from modeling_pacer.training.trainer import PacerTrainer, acceptance_metrics, roc_auc

from conftest import VOCAB, make_head, make_pair

MAX_DRAFT = 5


@pytest.mark.parametrize("arch, prompt_length, new", [("qwen2", 4, 20), ("llama", 9, 33), ("llama", 5, 40)])
def test_fast_labels_equal_exact_simulation(arch, prompt_length, new):
    target, draft = make_pair(arch, arch, "noisy")
    ids = torch.randint(0, VOCAB, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    exact, sequences = simulate_drafts(target, draft, ids, new, MAX_DRAFT)
    output = sequences[0, prompt_length:]
    assert output.tolist() == target.generate(ids, max_new_tokens=new)[0, prompt_length:].tolist()
    fast = {e["start"]: e for e in examples_from_trace(record_trace(draft, target, ids, output, MAX_DRAFT))}
    assert len(fast) == new - 1 and len(exact) >= 2
    assert any(e["labels"].sum() > 0 for e in exact) and any(e["labels"].min() == 0 for e in exact)
    for e in exact:  # every draft the real decoding sent is among the fast mode's, labelled the same
        f = fast[e["start"]]
        assert f["labels"].tolist() == e["labels"].tolist()
        torch.testing.assert_close(f["hidden"].float(), e["hidden"].float(), atol=2e-3, rtol=1e-3)
        assert f["features"].dtype == e["features"].dtype == torch.float32
        torch.testing.assert_close(f["features"], e["features"], atol=1e-4, rtol=1e-4)


def test_sampling_simulation_records_soft_labels():
    target, draft = make_pair("llama", "llama", "noisy")
    torch.manual_seed(0)
    examples, _ = simulate_drafts(target, draft, torch.tensor([[3, 1, 4]]), 30, MAX_DRAFT, do_sample=True,
                                  temperature=1.0)
    for e in examples:
        soft = e["soft_labels"]
        assert ((soft >= 0) & (soft <= 1)).all()
        assert (soft[1:] <= soft[:-1] + 1e-6).all()  # a cumulative probability never grows
    assert any(0 < float(e["soft_labels"][0]) < 1 for e in examples)  # sampling data: truly soft


def test_collator_packs_drafts_with_exact_masks():
    features = [dict(hidden=torch.full((k, 4), float(k)), labels=[1.0] * (k - 1) + [0.0]) for k in (3, 2, 4, 1)]
    batch = PackedDraftCollator(max_tokens_per_row=6)(features)
    # rows: [3, 2] (5 tokens) and [4, 1] (5 tokens)
    assert batch["hidden_states"].shape == (2, 5, 4)
    assert batch["draft_positions"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    expected = torch.zeros(5, 5, dtype=torch.bool)
    expected[:3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    expected[3:, 3:] = torch.ones(2, 2, dtype=torch.bool).tril()
    assert torch.equal(batch["attention_mask"][0], expected)
    assert batch["labels"].tolist() == [[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]]
    # padding: a row shorter than the widest is padded with -100 and masked out
    batch = PackedDraftCollator(max_tokens_per_row=4)(features[:3])
    assert batch["labels"][1].tolist() == [1, 0, -100, -100]
    assert not batch["attention_mask"][1, :, 2:].any()


def test_collator_packs_draft_features_aligned_with_labels():
    """`feature_column` packs each draft's (token prob, entropy) rows where its hidden states and labels go,
    zeros at padding; without it the batch has no draft_features."""
    features = [dict(hidden=torch.zeros(k, 4), labels=torch.tensor([1.0] * (k - 1) + [0.0]), soft_labels=torch.zeros(k),
                     features=torch.stack([torch.full((k,), 0.1 * k), torch.arange(k) + 10.0 * k], -1), start=0)
                for k in (3, 2, 4)]
    assert "draft_features" not in PackedDraftCollator(max_tokens_per_row=6)(features)
    batch = PackedDraftCollator(max_tokens_per_row=6, feature_column="features")(features)
    # rows: [3, 2] (5 tokens) and [4] (4 tokens, one padding)
    assert batch["draft_features"].shape == (2, 5, 2) and batch["draft_features"].dtype == torch.float32
    expected = torch.zeros(2, 5, 2)
    expected[0, :3], expected[0, 3:] = features[0]["features"], features[1]["features"]
    expected[1, :4] = features[2]["features"]
    assert torch.equal(batch["draft_features"], expected)
    assert torch.equal(batch["draft_features"][batch["labels"] < 0], torch.zeros(1, 2))
    # from a dataset too, as the trainer reads it
    packed = PackedDraftCollator(max_tokens_per_row=6, feature_column="features")(list(to_dataset(features)))
    assert torch.equal(packed["draft_features"], expected)


def test_collator_rejects_a_draft_too_long():
    with pytest.raises(ValueError, match="does not fit"):
        PackedDraftCollator(max_tokens_per_row=2)([dict(hidden=torch.zeros(3, 4), labels=[1.0, 1.0, 0.0])])


def test_roc_auc_matches_pairwise_definition():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (40,), generator=g).float()  # many ties
    labels = torch.randint(0, 2, (40,), generator=g).bool()
    pos, neg = scores[labels], scores[~labels]
    pairwise = ((pos[:, None] > neg[None, :]).float() + 0.5 * (pos[:, None] == neg[None, :]).float()).mean()
    assert abs(roc_auc(scores, labels) - float(pairwise)) < 1e-9


def _toy_dataset(n: int, seed: int, hidden: int = 8):
    """Learnable: a draft token is accepted while feature 0 of its hidden state is positive."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        k = int(torch.randint(1, 6, (1,), generator=g))
        h = torch.randn(k, hidden, generator=g)
        labels = torch.cumprod((h[:, 0] > 0).float(), dim=0)
        examples.append(dict(hidden=h.half(), labels=labels, soft_labels=labels, start=i))
    return to_dataset(examples)


def test_trainer_learns_a_toy_task(tmp_path):
    torch.manual_seed(0)
    head = PacerHead(PacerConfig(draft_hidden_size=8, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                 max_draft_length=8))
    before = {k: v.clone() for k, v in head.state_dict().items()}
    args = PacerTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=64, per_device_eval_batch_size=64,
                                  num_train_epochs=8, learning_rate=3e-3, max_tokens_per_row=64, logging_steps=5,
                                  save_strategy="no", use_cpu=True, disable_tqdm=True)
    train, evaluation = _toy_dataset(400, 0), _toy_dataset(100, 1)
    trainer = PacerTrainer(model=head, args=args, train_dataset=train, eval_dataset=evaluation)
    first = trainer.evaluate()
    trainer.train()
    last = trainer.evaluate()
    assert any(not torch.equal(before[k], v) for k, v in head.state_dict().items())
    assert last["eval_loss"] < 0.6 * first["eval_loss"]
    assert last["eval_auc"] > 0.9 and last["eval_accuracy"] > 0.85
    assert 0 <= last["eval_ece"] < 0.2


def _feature_dataset(n: int, seed: int, hidden: int = 8):
    """Learnable from the draft features only: a token is accepted when its draft probability is above 0.5;
    the hidden states are noise and the labels independent of the position."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        k = int(torch.randint(1, 6, (1,), generator=g))
        features = torch.stack([torch.rand(k, generator=g), 3 * torch.rand(k, generator=g)], -1)
        labels = (features[:, 0] > 0.5).float()
        examples.append(dict(hidden=torch.randn(k, hidden, generator=g).half(), features=features, labels=labels,
                             soft_labels=labels, start=i))
    return to_dataset(examples)


def test_trainer_learns_from_draft_features(tmp_path):
    """The trainer feeds the features column to a head built with use_draft_features (and only to it): that head
    learns a task the hidden states say nothing about, a head without features stays at chance."""
    train, evaluation = _feature_dataset(300, 0), _feature_dataset(100, 1)
    auc = {}
    for use_draft_features in (True, False):
        torch.manual_seed(0)
        head = PacerHead(PacerConfig(draft_hidden_size=8, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                     max_draft_length=8, use_draft_features=use_draft_features))
        args = PacerTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=64,
                                      per_device_eval_batch_size=100, num_train_epochs=6, learning_rate=1e-2,
                                      max_tokens_per_row=64, save_strategy="no", use_cpu=True, disable_tqdm=True)
        trainer = PacerTrainer(model=head, args=args, train_dataset=train, eval_dataset=evaluation)
        assert trainer.data_collator.feature_column == ("features" if use_draft_features else None)
        trainer.train()
        auc[use_draft_features] = trainer.evaluate()["eval_auc"]
    assert auc[True] > 0.9 and abs(auc[False] - 0.5) < 0.1, auc


@pytest.mark.parametrize("use_draft_features", [False, True], ids=["hidden", "features"])
def test_live_head_predictions_equal_replayed_ones(use_draft_features):
    """What the live loop's head computes for a draft (`DraftView.acceptance`) equals `head_acceptance` on the
    trace of the same output: training data, replay and decoding feed the head the same inputs."""
    target, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, max_draft_length=MAX_DRAFT, use_draft_features=use_draft_features)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    live = []

    def record(seq, proposal, target_scores, accepted):
        if proposal.tokens.shape[1]:  # not the prefill step, which drafts nothing
            live.append((seq.shape[1] - ids.shape[1], proposal.view.acceptance()))

    policy = Pacer(block_size=1, threshold=0.2, growth=1.0, max_draft_length=MAX_DRAFT)
    sequences = generate(target, ids, assistant_model=draft, pacer_head=head, stopping_policy=policy,
                         pacer_step_callback=record, max_new_tokens=30)
    trace = record_trace(draft, target, ids, sequences[0, ids.shape[1]:], MAX_DRAFT)
    replayed = head_acceptance(head, trace)
    assert len(live) >= 5 and any(len(p) > 1 for _, p in live)
    for start, predicted in live:
        torch.testing.assert_close(predicted, replayed[start, : len(predicted)], atol=2e-3, rtol=0)
    if use_draft_features:  # the features really count in both
        zeros = torch.zeros(*trace.hidden.shape[:2], 2)
        zeros = head.acceptance_probabilities(trace.hidden.float(), draft_features=zeros)
        assert (zeros - replayed).abs().max() > 0.05


def test_training_arguments_refuse_what_cannot_train(tmp_path):
    """Checked when built, before accelerate's set-up: a learning rate or an epoch count that would leave the
    head as initialised; the evaluation batch follows the training batch unless set."""
    for bad, flag in [(dict(learning_rate=0.0), "--lr"), (dict(num_train_epochs=0), "--epochs"),
                      (dict(per_device_train_batch_size=0), "--batch-size"), (dict(max_tokens_per_row=0), "row"),
                      (dict(positive_weight=-1.0), "--positive-weight")]:
        with pytest.raises(ValueError, match=flag):
            PacerTrainingArguments(output_dir=str(tmp_path), **bad)
    assert PacerTrainingArguments(output_dir=str(tmp_path), num_train_epochs=0, max_steps=5).max_steps == 5
    args = PacerTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=32)
    assert args.per_device_eval_batch_size == 32
    assert PacerTrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=8).per_device_eval_batch_size == 8


def test_trainer_loss_is_the_heads_own(tmp_path):
    """One home for the loss: the trainer's equals PacerHead.forward's, and weighs accepted tokens as asked."""
    from modeling_pacer.modeling_pacer import acceptance_loss

    torch.manual_seed(0)
    head = PacerHead(PacerConfig(draft_hidden_size=8, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                 max_draft_length=8))
    hidden = torch.randn(2, 5, 8)
    labels = torch.tensor([[1.0, 1.0, 0.0, -100.0, -100.0], [1.0, 0.0, 0.0, 0.0, -100.0]])
    for weight in (1.0, 3.0):
        trainer = PacerTrainer(model=head, args=PacerTrainingArguments(output_dir=str(tmp_path), positive_weight=weight))
        loss = trainer.compute_loss(head, dict(hidden_states=hidden, labels=labels.clone()))
        logits = head(hidden_states=hidden).logits
        assert torch.equal(loss, acceptance_loss(logits, labels, weight))
        if weight == 1.0:
            assert torch.equal(loss, head(hidden_states=hidden, labels=labels).loss)
    assert loss > head(hidden_states=hidden, labels=labels).loss  # the accepted tokens' terms count three times


def test_acceptance_metrics_ignore_padding():
    from transformers import EvalPrediction

    logits = torch.tensor([[5.0, -5.0, 0.0]])
    labels = torch.tensor([[1.0, 0.0, -100.0]])
    metrics = acceptance_metrics(EvalPrediction(predictions=logits.numpy(), label_ids=labels.numpy()))
    assert metrics["auc"] == 1.0 and metrics["accuracy"] == 1.0 and metrics["positive_rate"] == 0.5


def test_first_token_auc_reads_only_first_positions():
    from types import SimpleNamespace

    from modeling_pacer.replay import Trace
    from modeling_pacer.training.trainer import first_token_auc

    match = torch.tensor([0, 2, 0, 1, 0])  # the last start is never drafted from
    trace = Trace("d", "p", match, hidden=torch.zeros(5, 3, 4, dtype=torch.float16))
    first = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.99])  # separates starts 0-3 perfectly; start 4 is ignored
    later = torch.rand(5, 2)  # anything at later draft positions must not matter

    def head(scores):
        def acceptance_probabilities(hidden, draft_features):
            return torch.cat([scores[:, None], later], 1)

        return SimpleNamespace(dtype=torch.float32, config=SimpleNamespace(use_draft_features=False),
                               acceptance_probabilities=acceptance_probabilities)

    assert first_token_auc(head(first), [trace]) == 1.0
    assert first_token_auc(head(1 - first), [trace]) == 0.0


def test_tuned_rule_is_never_worse_than_a_fixed_length_it_can_express():
    """The grid holds fixed lengths 1-5 (t0 = 1.0); with free head calls the tuned rule matches or beats them."""
    from modeling_pacer import PacerConfig, PacerHead
    from modeling_pacer.replay import CostModel, Trace
    from modeling_pacer.training.tuning import best_fixed_length, tune_pacer

    g = torch.Generator().manual_seed(0)
    n, max_draft = 60, 6
    match = torch.randint(0, 7, (n,), generator=g).clamp(max=max_draft)
    trace = Trace("d", "p", match, token_probs=torch.rand(n, max_draft, generator=g),
                  entropies=torch.rand(n, max_draft, generator=g),
                  hidden=torch.randn(n, max_draft, 8, generator=g).half())
    head = PacerHead(PacerConfig(draft_hidden_size=8, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                 max_draft_length=max_draft)).eval()
    with torch.no_grad():  # a head that is always nearly sure (p = 0.993): only t0 = 1.0 stops it at once
        head.classifier.weight.zero_()
        head.classifier.bias.fill_(5.0)
    costs = CostModel({k: float(k) for k in range(1, 8)}, 0.1, 0.0)  # linear: one draft token is best
    gamma, fixed = best_fixed_length([trace], costs, max_draft, longest=5)
    assert gamma == 1
    best = tune_pacer(head, [trace], costs, max_draft)[0]
    assert best.speedup >= fixed - 1e-9
    assert (best.threshold, best.block_size, best.first_block_size) == (1.0, 1, 0)


@pytest.mark.parametrize("arch, prompt_length, new", [("qwen2", 4, 20), ("llama", 7, 26)])
def test_soft_labels_from_a_trace_equal_the_acceptance_probabilities_of_its_drafts(arch, prompt_length, new):
    """The trace's target probabilities give, for the draft from every output position, prod(min(1, p/q))
    exactly as computed from scratch: the draft drafts greedily from the target's prefix, the target and the
    draft score those tokens in one forward each."""
    target, draft = make_pair(arch, arch, "noisy")
    ids = torch.randint(0, VOCAB, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    output = target.generate(ids, max_new_tokens=new, do_sample=False)[0, prompt_length:]
    trace = record_trace(draft, target, ids, output, MAX_DRAFT, with_target_probs=True)
    assert record_trace(draft, target, ids, output, MAX_DRAFT).target_probs is None
    examples = examples_from_trace(trace)
    checked_after_a_miss = 0
    for e in examples:
        i, k = e["start"], len(e["labels"])
        context = torch.cat([ids, output[None, :i]], dim=1)
        drafted = draft.generate(context, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        rows = slice(context.shape[1] - 1, context.shape[1] - 1 + k)
        tokens = drafted[0, context.shape[1]:]
        p = target(input_ids=drafted).logits[0, rows].softmax(-1).gather(-1, tokens[:, None])[:, 0]
        q = draft(input_ids=drafted).logits[0, rows].softmax(-1).gather(-1, tokens[:, None])[:, 0]
        expected = torch.cumprod((p / q).clamp(max=1.0), 0)
        torch.testing.assert_close(e["soft_labels"], expected, atol=1e-4, rtol=1e-3)
        assert e["labels"].tolist() == (torch.arange(k) < int(trace.match[i])).float().tolist()
        checked_after_a_miss += int(trace.match[i]) < k - 1
    assert checked_after_a_miss > 0  # some drafts continue past their first miss: the continuations are scored
    assert any(0 < float(e["soft_labels"][0]) < 1 for e in examples)
