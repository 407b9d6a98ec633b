"""The runtime: one decode loop over one shared KV cache.

``decode`` (the loop: draft, verify, accept, commit), ``runner`` (a model run sublayer by
sublayer over a static cache), ``cuda_graphs`` (the runner on CUDA, replayed as graphs),
``batch`` (several sequences in one pass), ``prefixes`` (prompts' keys and values kept for
reuse), ``sampling`` (the acceptance rules), ``plan`` (skip plans), ``adapters`` (how each model
family's layer is wired) and ``draft_vocab`` (the ids a draft scores).
"""
