"""`pacer-bench`: PACER against every other way to run the same pair, on real prompts.

Installed as `modeling_pacer.benchmarks` (the folder name alone is too generic to install top-level).
"""
