"""Model-card templates for what pacer publishes on the Hub, rendered with huggingface_hub's
`ModelCard.from_template` (Jinja). Installed as `modeling_pacer.hub_cards`."""

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

TEMPLATES = Path(__file__).parent


def render_head_card(*, base_model: str | None, license: str = "apache-2.0", **fields) -> ModelCard:
    """The card of a trained head (`pacer_head.md`). `fields` fill the template; every figure in them
    must come from a command, which the card states (`command`)."""
    data = ModelCardData(
        library_name="transformers",
        license=license,
        base_model=base_model,
        tags=["pacer", "speculative-decoding", "pre-verification-head", "custom_code"],
        pipeline_tag=None,
    )
    return ModelCard.from_template(data, template_path=str(TEMPLATES / "pacer_head.md"), **fields)
