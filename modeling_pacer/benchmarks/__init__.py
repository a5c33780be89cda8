"""`pacer-bench`: PACER against every other way to run the same pair, on real prompts (results: the
repository's top-level `benchmarks/results/`)."""
