"""Speed modes: how a loaded model's weights are laid out and multiplied.

``modes`` (choosing a mode, swapping a model's modules for the kernel's), ``quantized`` (modes
``gguf`` and ``gguf-q8``: the GGUF file's integers as kernel panels) and ``fused`` (whole decoder
sublayers as one native call). The kernel itself is ``selfspec.kernels``.
"""
