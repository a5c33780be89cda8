"""Model cards for what pacer publishes on the Hub, rendered with huggingface_hub's
`ModelCard.from_template` (Jinja) from the templates in the project's `hub_cards/` folder (data,
installed beside the package: see `resources.py`)."""

from huggingface_hub import ModelCard, ModelCardData

from .resources import data_folder


def format_speedup(row: dict) -> str:
    """A summary row's speedup, with its 95% interval where it has one: `1.56x (1.46-1.65)`."""
    interval = row.get("speedup_ci")
    return f"{row['speedup']:.2f}x" + ("" if interval is None else f" ({interval[0]:.2f}-{interval[1]:.2f})")


def lossless_label(row: dict, emphasis: str = "") -> str:
    """A summary row's lossless column: "yes", a mismatch count (wrapped in `emphasis`, e.g. Markdown bold), or
    why outputs were not compared (another function's own numerics; sampled draws)."""
    if row.get("own_numerics"):
        return "own numerics (n/a)"
    if row.get("sampled"):
        return "sampled (in distribution: tests)"
    return "yes" if row["mismatches"] == 0 else f"{emphasis}MISMATCH {row['mismatches']}/{row['prompts']}{emphasis}"


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
    return ModelCard.from_template(data, template_path=str(data_folder("hub_cards") / "pacer_head.md"), **fields)


def render_adapter_card(*, base_model: str | None, license: str = "apache-2.0", **fields) -> ModelCard:
    """The card of an aligned-draft LoRA adapter (`draft_adapter.md`), from `pacer-align`'s fields."""
    data = ModelCardData(
        library_name="peft",
        license=license,
        base_model=base_model,
        tags=["pacer", "speculative-decoding", "draft-model", "lora", "trl", "sft", "distillation"],
        pipeline_tag="text-generation",
    )
    return ModelCard.from_template(data, template_path=str(data_folder("hub_cards") / "draft_adapter.md"),
                                   base_model=base_model, **fields)
