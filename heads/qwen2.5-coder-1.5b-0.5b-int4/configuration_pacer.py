"""Configuration of the PACER pre-verification head.

This file travels with heads published on the Hub (``trust_remote_code``): it imports only
from ``transformers`` and ``huggingface_hub``.
"""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig


# the draft settings a head can be trained on: pacer's int4 weight layers, torch's dynamic int8, or none
DRAFT_SETTINGS = ("int4", "dynamic-int8", "none")


@strict
class PacerConfig(PreTrainedConfig):
    r"""
    Configuration of a [`PacerHead`]: the head's shape and the default PACER stopping rule.

    The stopping rule, per decode step (see the PACER paper, Algorithm 1):

    ```
    t = threshold
    loop: draft a block (`first_block_size` tokens first if set, then `block_size` tokens)
          p = head(draft hidden states)
          if mean(p over the block) < t: stop;  t = t * growth
          stop at `max_draft_length` tokens
    ```

    Args:
        draft_hidden_size (`int`): hidden size of the draft model whose last hidden states feed the head.
            Must equal `draft.config.hidden_size`.
        hidden_size (`int`): width of the head. Small on purpose: the paper keeps the head near 2% of
            decoding time, and acceptance is a much easier function than next-token prediction.
        num_attention_heads (`int`): heads of the single causal self-attention layer.
        intermediate_size (`int`): width of that layer's feed-forward block.
        max_draft_length (`int`): the hard cap on draft tokens per decode step; also the size of the
            draft-position embedding table (positions 0..max_draft_length-1 inside one draft).
        block_size (`int`): tokens drafted between two pre-verifications (b in the paper).
        threshold (`float`): the initial threshold t0 on the block's mean predicted acceptance, in [0, 1].
        growth (`float`): factor rho >= 1 applied to the threshold after each block that passes: later
            tokens need more confidence, since one rejection wastes everything drafted after it.
        first_block_size (`int`): length of the first block (0: `block_size`, the paper's rule). Not in the
            paper: the target's verification cost rises in stairs (on a CPU, 1-3 tokens cost about one
            forward, 4-6 about two), so the first block can fill the first stair, which is nearly free,
            and later blocks end at the tops of the next ones. Tuned with the other rule parameters on
            the pair's measured cost curve.
        stopping_rule (`str`): the head's default rule. `"blocks"`: the rule above (the paper's, with
            `block_size`, `threshold`, `growth`, `first_block_size`). `"throughput"`: the cost-aware rule
            (`ExpectedThroughput` with the head's estimate, read after every drafted token): keep drafting while
            a longer draft is expected to emit more tokens per second, with the cost curve measured on the
            generating machine (`modeling_pacer.host_costs`); it can also decide that one more token does not pay.
            `pacer-train` sets whichever replays faster on its held-out prompts.
        throughput_estimate (`str`): what the cost-aware rule reads: `"head"` (the head's cumulative predictions),
            `"both"` (the head's conditional predictions and the draft's token probabilities, combined by the online
            fit; needs `calibration`) or `"draft"` (the draft's own token probabilities alone: the head is not run;
            `pacer-train` sets it when that replays faster than every rule that reads the head).
        calibration (`float`, *optional*): with `stopping_rule="throughput"`, refit the per-token estimates while
            decoding to each call's accept/reject outcomes (`OnlineCalibration`, a logistic fit starting from the
            estimate as it is, with a prior worth this many outcomes); None: the estimate as it is. A head trained on
            one kind of text is off on another; the outcomes of every verification say by how much.
        sampling_stopping_rule (`str`, *optional*): the rule for sampled decoding (`do_sample=True`), when it
            differs from the greedy one (`stopping_rule`); None: the same. A sampled token's probability says less
            about its acceptance (min(1, p/q)) than the greedy token's about a match, so a head trained on the
            target's probabilities can estimate sampled acceptance better than the draft's probability does, while
            in greedy decoding the draft's probability may be the better estimate: one head then serves both.
        sampling_throughput_estimate (`str`, *optional*): `throughput_estimate` for sampled decoding; None: the same.
        draft_quantization (`str`, *optional*): the draft setting the head was trained on (`"int4"`, `"dynamic-int8"`
            or `"none"`), since a quantized draft's hidden states and probabilities differ from the plain draft's;
            `generate` refuses a draft of another setting. None: not recorded (heads saved before it existed).
        draft_nothing (`bool`): with `stopping_rule="throughput"`, let a step draft nothing when, at the acceptance
            rate seen so far in the call, no draft length is expected to beat the target alone.
        use_position_embedding (`bool`): add the learned draft-position embedding (an ablation switch).
        use_draft_features (`bool`): also read, per draft token, the draft's probability of the token it drafted and
            the entropy (nats) of the distribution it drafted from (`draft_features` in `forward`): the draft's own
            confidence is a strong acceptance signal, which the hidden states carry only implicitly. Off by default,
            as for heads trained before it existed.
        draft_prior (`bool`): add the logit of the draft's own cumulative estimate (the product of its token
            probabilities over the draft so far) to the head's output, so that the head starts from what the draft
            knows and learns a correction to it. Needs `use_draft_features`.
        dropout (`float`): dropout inside the head during training.
    """

    model_type = "pacer"

    draft_hidden_size: int = 896
    hidden_size: int = 256
    num_attention_heads: int = 4
    intermediate_size: int = 512
    max_draft_length: int = 16
    block_size: int = 3
    threshold: int | float = 0.5
    growth: int | float = 1.1
    first_block_size: int = 0
    stopping_rule: str = "blocks"
    throughput_estimate: str = "head"
    calibration: int | float | None = None
    sampling_stopping_rule: str | None = None
    sampling_throughput_estimate: str | None = None
    draft_quantization: str | None = None
    draft_nothing: bool = False
    use_position_embedding: bool = True
    use_draft_features: bool = False
    draft_prior: bool = False
    dropout: int | float = 0.0
    initializer_range: float = 0.02

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """transformers' reader of `config.json`, refusing a folder without one (transformers would go on with the
        default config, and the weights would then fail with a misleading size mismatch) and a config of another
        model (transformers only warns, and builds a head from whatever fields match)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if not config_dict:
            raise ValueError(
                f"There is no config.json in {str(pretrained_model_name_or_path)!r}: a PACER head is a folder (or Hub "
                "repo) with config.json and model.safetensors, as `head.save_pretrained(folder)` writes it; or pass "
                "`config=PacerConfig(...)` explicitly."
            )
        model_type = config_dict.get("model_type")
        if model_type != cls.model_type:
            raise ValueError(
                f"The config.json of {str(pretrained_model_name_or_path)!r} has model_type {model_type!r}, not "
                f"{cls.model_type!r}: it is not a PACER head. Point at a folder written by `PacerHead.save_pretrained`."
            )
        return config_dict, kwargs

    def __post_init__(self, **kwargs):
        self._check_ranges()
        super().__post_init__(**kwargs)

    def _check_ranges(self):
        """Every field in its range, else a `ValueError` naming it (strict's own errors are not ValueErrors)."""
        for name in ("draft_hidden_size", "hidden_size", "num_attention_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"PacerConfig.{name} must be a positive integer, got {getattr(self, name)}.")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"PacerConfig.hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})."
            )
        if self.block_size < 1:
            raise ValueError(f"PacerConfig.block_size must be >= 1, got {self.block_size}.")
        if self.max_draft_length < self.block_size:
            raise ValueError(
                f"PacerConfig.max_draft_length ({self.max_draft_length}) must be >= block_size ({self.block_size})."
            )
        if not 0 <= self.first_block_size <= self.max_draft_length:
            raise ValueError(
                f"PacerConfig.first_block_size must lie in [0, max_draft_length ({self.max_draft_length})] "
                f"(0: equal to block_size), got {self.first_block_size}."
            )
        if self.draft_prior and not self.use_draft_features:
            raise ValueError("PacerConfig.draft_prior needs use_draft_features=True (it reads the draft's probabilities).")
        if self.stopping_rule not in ("blocks", "throughput"):
            raise ValueError(f"PacerConfig.stopping_rule must be 'blocks' or 'throughput', got {self.stopping_rule!r}.")
        if self.sampling_stopping_rule not in (None, "blocks", "throughput"):
            raise ValueError(
                f"PacerConfig.sampling_stopping_rule must be None, 'blocks' or 'throughput', got {self.sampling_stopping_rule!r}."
            )
        estimates = ("head", "both", "draft")
        if self.throughput_estimate not in estimates:
            raise ValueError(
                f"PacerConfig.throughput_estimate must be 'head', 'both' or 'draft', got {self.throughput_estimate!r}."
            )
        if self.sampling_throughput_estimate not in (None, *estimates):
            raise ValueError(
                f"PacerConfig.sampling_throughput_estimate must be 'head', 'both' or 'draft' (or None: the greedy one), "
                f"got {self.sampling_throughput_estimate!r}."
            )
        if self.draft_quantization not in (None, *DRAFT_SETTINGS):
            raise ValueError(
                f"PacerConfig.draft_quantization must be None or one of {DRAFT_SETTINGS}, got {self.draft_quantization!r}."
            )
        if self.calibration is not None and not self.calibration > 0:
            raise ValueError(f"PacerConfig.calibration must be > 0 (a prior strength) or None, got {self.calibration}.")
        if "both" in (self.throughput_estimate, self.sampling_throughput_estimate) and self.calibration is None:
            raise ValueError("PacerConfig.throughput_estimate='both' combines two estimates by the online fit: set calibration.")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"PacerConfig.threshold must lie in [0, 1], got {self.threshold}.")
        if self.growth < 1.0:
            raise ValueError(f"PacerConfig.growth must be >= 1 (1 disables growth), got {self.growth}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"PacerConfig.dropout must lie in [0, 1), got {self.dropout}.")


__all__ = ["DRAFT_SETTINGS", "PacerConfig"]
