"""The CPU runtime: pacer's C++ kernels as torch operators (`kernels/`), the quantized layers that run on them
(`quantization.py`: a GGUF target's 4-bit weights, an int4 draft), row-invariant layers for exact verification
(`exact_linear.py`, `exact_attention.py`: `attn_implementation="pacer_exact"`), and decoder layers in two C++ calls
(`fused_layers.py`: a draft's steps, a W4A8 target's forwards). It knows the host through `modeling_pacer.host` and imports nothing above itself."""
