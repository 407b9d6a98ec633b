"""Training draft heads: ``heads`` (``selfspec train-heads``: the model's own answers, on this
machine), ``fit`` (the training arithmetic and the held-out measure, on any device) and ``gpu``
(the same self-distillation at GPU scale with transformers' own model).
"""
