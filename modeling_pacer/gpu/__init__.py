"""The GPU runtime: exact verification by fixed-shape calls (`fixed_rows.py`: every target call the same number of
rows, so a device's kernels take one path whatever the draft's length) and captured steps (`captured.py`: a model's
decoding calls compiled whole over a static cache, CUDA graphs on a GPU). Beside the CPU runtime
(`modeling_pacer.cpu`); `modeling_pacer.exact.make_exact` chooses between the exact ways by measurement on the model's
device."""
