"""Training PACER heads: data from simulated speculative decoding, a packing collator, a `Trainer`.

Installed as `modeling_pacer.training` (the folder name alone is too generic to install top-level).
"""
