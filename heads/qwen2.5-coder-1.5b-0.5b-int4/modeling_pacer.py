"""The PACER pre-verification head: draft hidden states (and optionally the draft's token probability and
entropy) in, one acceptance logit per draft token out.

This file travels with heads published on the Hub (``trust_remote_code``): it imports only
``torch``, ``transformers`` and its sibling ``configuration_pacer``.
"""

import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_pacer import PacerConfig


@dataclass
class PacerHeadOutput(ModelOutput):
    """
    Args:
        loss (`torch.FloatTensor` of shape `()`, *optional*): binary cross-entropy against `labels`.
        logits (`torch.FloatTensor` of shape `(batch, draft_len)`): acceptance logits; `sigmoid` gives
            the predicted probability that the target accepts the token and every draft token before it.
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None


def acceptance_loss(logits: torch.Tensor, labels: torch.Tensor, positive_weight: float = 1.0) -> torch.Tensor:
    """Binary cross-entropy of acceptance `logits` against `labels` (1 accepted, 0 rejected, or a soft
    acceptance probability), ignoring entries < 0 (padding); `positive_weight` weighs accepted tokens
    (BCE's `pos_weight`), for pairs whose labels are very unbalanced."""
    keep = labels >= 0
    pos_weight = torch.tensor(positive_weight, device=logits.device) if positive_weight != 1.0 else None
    return nn.functional.binary_cross_entropy_with_logits(
        logits[keep].float(), labels[keep].to(torch.float32), pos_weight=pos_weight
    )


class PacerPreTrainedModel(PreTrainedModel):
    config_class = PacerConfig
    base_model_prefix = "pacer"
    main_input_name = "hidden_states"
    _no_split_modules = []

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' `from_pretrained`, made strict, since a head loaded wrong still runs and silently drafts badly:

        - weights from `model.safetensors` only (`use_safetensors=True`): a pickle `pytorch_model.bin` is never
          unpickled (that can run code), a folder holding only one is refused;
        - every tensor of the head present in the file with its shape, and nothing else: a missing tensor (which
          transformers would initialise at random), an unexpected one or one of another shape is a `ValueError`
          naming it;
        - `config.json` present and of model_type "pacer" (checked by `PacerConfig.get_config_dict`).

        `output_loading_info=True` still returns `(model, loading_info)`.
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError("PACER heads load from safetensors only: leave `use_safetensors` unset (or True).")
        folder = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        if os.path.isdir(folder) and not any(
            os.path.isfile(os.path.join(folder, name)) for name in ("model.safetensors", "model.safetensors.index.json")
        ):
            others = sorted(name for name in os.listdir(folder) if name.endswith((".bin", ".pt", ".pth", ".ckpt")))
            raise ValueError(
                f"There is no model.safetensors in {folder!r}"
                + (f" (only {', '.join(others)})" if others else "")
                + ": PACER heads load from safetensors only (a pickle checkpoint can run code when it is read). "
                "Save the head with `head.save_pretrained(folder)`, which writes model.safetensors."
            )
        return_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path,
            *model_args,
            **{**kwargs, "use_safetensors": True, "output_loading_info": True, "ignore_mismatched_sizes": True},
        )
        problems = []
        if info.get("missing_keys"):
            problems.append(f"missing from the file: {', '.join(sorted(info['missing_keys']))}")
        if info.get("unexpected_keys"):
            problems.append(f"unexpected in the file: {', '.join(sorted(info['unexpected_keys']))}")
        if info.get("mismatched_keys"):
            shapes = (f"{key} ({tuple(saved)} in the file, {tuple(built)} in config.json's head)"
                      for key, saved, built in sorted(info["mismatched_keys"]))
            problems.append(f"of another shape: {', '.join(shapes)}")
        if info.get("error_msgs"):
            problems.append(f"errors: {'; '.join(info['error_msgs'])}")
        if problems:
            raise ValueError(
                f"The weights in {str(pretrained_model_name_or_path)!r} do not match a {cls.__name__} built from its "
                f"config.json; tensors {'; '.join(problems)}. Load a folder written by `PacerHead.save_pretrained`."
            )
        return (model, info) if return_info else model

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


class PacerHead(PacerPreTrainedModel):
    r"""
    The pre-verification head M_B of PACER.

    `draft hidden state -> Linear -> (+ Linear of the draft features) -> (+ draft-position embedding)
    -> one causal transformer layer -> LayerNorm -> Linear -> one logit`. The layer attends causally
    *inside one draft*: token i of a draft sees tokens 0..i of the same draft, never the prompt (the
    draft's hidden states already summarise it) and never another draft packed in the same training row.

    With `config.use_draft_features`, each token's `(token probability, entropy)` enters through its own
    `Linear(2, hidden_size)`, as given: the mapping lives in the head, so training and decoding cannot
    disagree on it.
    """

    def __init__(self, config: PacerConfig):
        super().__init__(config)
        self.input_proj = nn.Linear(config.draft_hidden_size, config.hidden_size)
        self.feature_proj = nn.Linear(2, config.hidden_size) if config.use_draft_features else None
        self.position_embedding = (
            nn.Embedding(config.max_draft_length, config.hidden_size) if config.use_position_embedding else None
        )
        self.layer = nn.TransformerEncoderLayer(
            d_model=config.hidden_size,
            nhead=config.num_attention_heads,
            dim_feedforward=config.intermediate_size,
            dropout=config.dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.norm = nn.LayerNorm(config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(
        self,
        hidden_states: torch.Tensor,
        draft_positions: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        draft_features: torch.Tensor | None = None,
        **kwargs,
    ) -> PacerHeadOutput:
        r"""
        Args:
            hidden_states (`torch.Tensor` of shape `(batch, draft_len, draft_hidden_size)`): the draft's
                last hidden state at the position that produced each draft token.
            draft_positions (`torch.LongTensor` of shape `(batch, draft_len)`, *optional*): each token's
                index inside its own draft (0 for the first drafted token). Defaults to `0..draft_len-1`.
            attention_mask (`torch.Tensor` of shape `(batch, draft_len, draft_len)`, *optional*): `True`
                where token i may attend to token j. Defaults to causal. Packed training rows pass a
                block-diagonal causal mask here.
            labels (`torch.Tensor` of shape `(batch, draft_len)`, *optional*): 1 accepted, 0 rejected, or a
                soft acceptance probability; entries < 0 are ignored.
            draft_features (`torch.Tensor` of shape `(batch, draft_len, 2)`, *optional*): per draft token, the
                draft's probability of the token it drafted and the entropy (nats) of the distribution it drafted
                from. Required when `config.use_draft_features`, ignored otherwise (so that one collator serves
                both kinds of head).
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.config.draft_hidden_size:
            raise ValueError(
                f"PacerHead expects hidden_states of shape (batch, draft_len, {self.config.draft_hidden_size}), "
                f"got {tuple(hidden_states.shape)}: the head was built for a draft with hidden size "
                f"{self.config.draft_hidden_size}."
            )
        batch, length, _ = hidden_states.shape
        device = hidden_states.device
        x = self.input_proj(hidden_states.to(self.input_proj.weight.dtype))
        if self.feature_proj is not None:
            if draft_features is None:
                raise ValueError(
                    "This PacerHead was built with use_draft_features=True and needs `draft_features`: pass "
                    f"draft_features of shape (batch, draft_len, 2) = ({batch}, {length}, 2), each draft token's "
                    "(draft probability of the token, entropy in nats of the distribution it was drafted from)."
                )
            if tuple(draft_features.shape) != (batch, length, 2):
                raise ValueError(
                    f"PacerHead expects draft_features of shape (batch, draft_len, 2) = ({batch}, {length}, 2), "
                    f"matching hidden_states {tuple(hidden_states.shape)}; got {tuple(draft_features.shape)}."
                )
            x = x + self.feature_proj(draft_features.to(self.feature_proj.weight.dtype))

        if self.position_embedding is not None:
            if draft_positions is None:
                # checked on the shape: reading a tensor's value would wait for a GPU at every call
                if length > self.config.max_draft_length:
                    raise ValueError(
                        f"a draft of {length} tokens is beyond the head's max_draft_length ({self.config.max_draft_length})."
                    )
                draft_positions = torch.arange(length, device=device).expand(batch, length)
            elif draft_positions.max() >= self.config.max_draft_length:
                raise ValueError(
                    f"draft position {int(draft_positions.max())} is beyond the head's max_draft_length "
                    f"({self.config.max_draft_length})."
                )
            x = x + self.position_embedding(draft_positions)

        if attention_mask is None:
            allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            blocked = ~allowed  # torch's convention: True = may NOT attend
        else:
            # the diagonal is always allowed, so padding rows never see an all-masked softmax (NaN)
            allowed = attention_mask.bool() | torch.eye(length, dtype=torch.bool, device=device)
            blocked = (~allowed).repeat_interleave(self.config.num_attention_heads, dim=0)
        x = self.layer(x, src_mask=blocked)
        logits = self.classifier(self.norm(x)).squeeze(-1)
        if self.config.draft_prior:
            # the draft's own estimate of P(tokens 0..i of this draft all accepted), the product of its token
            # probabilities over the draft so far (the same causal, per-draft mask as the attention), as a logit:
            # the head learns a correction to it
            log_p = torch.log(draft_features[..., 0].float().clamp(1e-6, 1.0))
            cumulative = (allowed.float() @ log_p.unsqueeze(-1)).squeeze(-1).clamp(max=-1e-6)
            logits = logits.float() + cumulative - torch.log(-torch.expm1(cumulative))

        loss = acceptance_loss(logits, labels) if labels is not None else None
        return PacerHeadOutput(loss=loss, logits=logits)

    @torch.no_grad()
    def acceptance_probabilities(
        self,
        hidden_states: torch.Tensor,
        draft_positions: torch.LongTensor | None = None,
        draft_features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`(batch, draft_len, draft_hidden_size) -> (batch, draft_len)` predicted P(accept), for decoding
        (`draft_features` `(batch, draft_len, 2)` as in `forward`)."""
        logits = self(hidden_states, draft_positions=draft_positions, draft_features=draft_features).logits
        return torch.sigmoid(logits.float())


PacerConfig.register_for_auto_class()
PacerHead.register_for_auto_class("AutoModel")

__all__ = ["PacerConfig", "PacerHead", "PacerHeadOutput", "PacerPreTrainedModel", "acceptance_loss"]
