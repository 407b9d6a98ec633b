"""Write a randomly initialised stand-in of a model: its config and tokenizer, random bfloat16
weights.

A GPU machine that reaches no package index cannot fetch the bundled models. What a forward pass
costs depends on the shapes alone, so `selfspec profile` and the timing columns of `selfspec
bench` are measured on stand-ins; acceptance rates are not (random weights draft nothing like
the real model), and nothing about output quality is.

    python tests/gpu/standin.py CONFIG_DIR TOKENIZER_DIR OUT_DIR
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

config_dir, tokenizer_dir, out_dir = (Path(a) for a in sys.argv[1:4])
config = AutoConfig.from_pretrained(config_dir)
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(out_dir)
for source in [*tokenizer_dir.iterdir(), config_dir / "generation_config.json"]:
    shutil.copy(source, out_dir / source.name)
print(f"{out_dir}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M random parameters")
