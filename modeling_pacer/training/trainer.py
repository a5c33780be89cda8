"""`PacerTrainer`: a `Trainer` whose loss is binary cross-entropy on draft-token acceptance, and whose
evaluation reports how well the head predicts it (AUC, accuracy, calibration)."""

import torch
from transformers import EvalPrediction, Trainer

from .data import PackedDraftCollator
from .training_args import PacerTrainingArguments


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve = P(score of a random positive > score of a random negative), ties
    counting half (the Mann-Whitney U statistic over average ranks)."""
    labels = labels.bool()
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    scores = scores.double()
    order = torch.argsort(scores)
    unique, inverse = torch.unique(scores[order], return_inverse=True)  # tied scores share one rank
    positions = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    rank_sums = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, positions)
    counts = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(positions))
    ranks = torch.empty_like(scores)
    ranks[order] = (rank_sums / counts)[inverse]
    u = ranks[labels].sum() - positives * (positives + 1) / 2
    return float(u / (positives * negatives))


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> float:
    """Mean |predicted - observed acceptance| over equal-width probability bins, weighted by bin size."""
    index = torch.clamp((probs * bins).long(), max=bins - 1)
    error = 0.0
    for b in range(bins):
        in_bin = index == b
        if in_bin.any():
            error += float(in_bin.float().mean() * (probs[in_bin].mean() - labels[in_bin].float().mean()).abs())
    return error


def acceptance_metrics(eval_prediction: EvalPrediction) -> dict[str, float]:
    """`compute_metrics` for the Trainer: padding (label -100) is ignored; soft labels are rounded."""
    logits = torch.as_tensor(eval_prediction.predictions).flatten().float()
    labels = torch.as_tensor(eval_prediction.label_ids).flatten().float()
    keep = labels >= 0
    probs, hard = torch.sigmoid(logits[keep]), labels[keep] >= 0.5
    return dict(
        auc=roc_auc(probs, hard),
        accuracy=float(((probs >= 0.5) == hard).float().mean()),
        ece=expected_calibration_error(probs, hard),
        brier=float(((probs - labels[keep]) ** 2).mean()),
        positive_rate=float(hard.float().mean()),
    )


def _first_tokens(traces, scores_of):
    """`(scores, labels)` over every draft start of greedy `traces` (the last position leaves no budget for
    a draft): `scores_of(trace)` `(N, max_draft)`, column 0; label: the first draft token was accepted."""
    scores = torch.cat([scores_of(t)[: t.length - 1, 0].float() for t in traces])
    labels = torch.cat([t.match[: t.length - 1] >= 1 for t in traces])
    return scores, labels


def first_token_auc(head, traces) -> float:
    """AUC of the head's prediction for the first token of a draft, over every draft start of greedy
    `traces`. The pooled AUC over all draft positions is flattered by position alone (late tokens are
    rarely accepted); this one measures the decision that matters most: is drafting worth starting."""
    from ..replay import head_acceptance

    return roc_auc(*_first_tokens(traces, lambda t: head_acceptance(head, t)))


def first_token_predictors(head, traces) -> dict[str, dict[str, float]]:
    """The head against what the draft knows without one, on the first token of every draft of `traces`:
    AUC (ranking) and, for the two that are probabilities, ECE (calibration as P(accept))."""
    from ..replay import head_acceptance

    out = {}
    for name, scores_of, probability in [
        ("head", lambda t: head_acceptance(head, t), True),
        ("draft probability", lambda t: t.token_probs, True),
        ("draft entropy (lower ranks higher)", lambda t: -t.entropies, False),
    ]:
        scores, labels = _first_tokens(traces, scores_of)
        out[name] = dict(auc=roc_auc(scores, labels),
                         ece=expected_calibration_error(scores, labels) if probability else float("nan"))
    return out


class PacerTrainer(Trainer):
    """Trains a `PacerHead` on packed drafts. Pass datasets from `training.data.to_dataset`."""

    def __init__(self, model=None, args: PacerTrainingArguments | None = None, data_collator=None,
                 compute_metrics=None, **kwargs):
        if args is None:
            args = PacerTrainingArguments(output_dir="pacer-head")
        if data_collator is None:
            with_features = getattr(getattr(model, "config", None), "use_draft_features", False)
            data_collator = PackedDraftCollator(
                max_tokens_per_row=args.max_tokens_per_row,
                label_column="soft_labels" if args.soft_labels else "labels",
                feature_column="features" if with_features else None,
            )
        super().__init__(model=model, args=args, data_collator=data_collator,
                         compute_metrics=compute_metrics or acceptance_metrics, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The head's own loss (`acceptance_loss`, as `PacerHead.forward` computes it), here with the
        arguments' `positive_weight`, which the head's forward does not take."""
        from ..modeling_pacer import acceptance_loss

        labels = inputs.pop("labels")
        outputs = model(**inputs)
        outputs.loss = acceptance_loss(outputs.logits, labels, getattr(self.args, "positive_weight", 1.0))
        return (outputs.loss, outputs) if return_outputs else outputs.loss
