#!/usr/bin/env bash
# selfspec's CUDA path on a GPU machine: the CUDA tests, then `selfspec profile` and
# `selfspec bench` on random stand-ins of the bundled Qwen models (tests/gpu/standin.py); stage
# "real": the same on the real 1.5B.
# Needs, beside the repo: .gpu/ (configs + tokenizer copied from the model cache) and, where
# the machine's transformers differs from ours, .whl/ (wheels). Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/selfspec-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SELFSPEC_NO_PROGRESS=1 SELFSPEC_CACHE=/tmp/selfspec-cache
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
STAGE=${1:-all}
if [[ $STAGE == all || $STAGE == tests ]]; then
  python3 -m pytest -q -rs -x -m "not slow" tests/test_static.py 2>&1 | tee "$OUT/pytest.log"
fi
if [[ $STAGE == all || $STAGE == measure ]]; then
  for m in 1.5b 0.5b; do
    [[ -d /tmp/standin-$m ]] || python3 tests/gpu/standin.py .gpu/qwen2.5-coder-$m .gpu/tokenizer /tmp/standin-$m
  done
  # The draft step of the committed CPU plan's skip set, with the acceptance measured for the
  # real model on the CPU (the best draft length it prints is a prediction, not a measurement).
  for speed in ${SPEEDS:-cuda-graphs cuda-compiled torch}; do
    python3 -m selfspec.cli profile --model /tmp/standin-1.5b --device cuda --speed $speed --repeats 30 \
      --skip-attention 2,7,10 --skip-mlp "" --acceptance 0.89 --json > "$OUT/profile-$speed.json" 2>>"$OUT/stderr.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], {k: d[k] for k in ('forward_ms','hf_forward_ms','draft_step_ms','best_draft_length','predicted_speedup')})" "$OUT/profile-$speed.json"
  done
  # Plain decoding's tokens/s against transformers' generate, one run per mode. Random weights
  # draft nothing a threshold lets through, so speculative rows here would only time wasted
  # draft steps (their identity to plain decoding is what tests/test_static.py checks).
  for speed in ${BENCH_SPEEDS:-cuda-graphs cuda-compiled}; do
    python3 -m selfspec.cli bench --model /tmp/standin-1.5b --device cuda --speed $speed \
      --methods hf_generate,autoregressive --prompts spec-bench --limit 1 --max-new-tokens 128 --out /tmp/bench-$speed \
      2>>"$OUT/stderr.log" | head -16
    cp /tmp/bench-$speed/bench.json "$OUT/bench-$speed.json"
  done
fi
if [[ $STAGE == real ]]; then
  # The real 1.5B: its .gguf assembled at $GGUF first (how: results/qwen2.5-coder-1.5b/heads/
  # README.md). Pass costs, then plain decoding, context drafts, context + head drafts and the
  # default drafter (context, heads and the committed plan's layer-skip drafts). HEADS: a heads
  # file to use instead of the shipped one (one just trained by python3 -m selfspec.training.gpu).
  GGUF=${GGUF:-/tmp/p/model.gguf}
  HEADS=${HEADS:-selfspec/plans/qwen2.5-coder-1.5b/heads.safetensors}
  [[ ${PROFILE:-1} == 1 ]] && python3 -m selfspec.cli profile --model "$GGUF" --device cuda \
    --repeats 20 --json > "$OUT/profile-real.json" 2>>"$OUT/stderr.log"
  python3 -m selfspec.cli bench --model "$GGUF" --device cuda --heads "$HEADS" \
    --methods hf_generate,autoregressive,ngram,heads,self_speculative --prompts spec-bench --limit 1 --max-new-tokens 128 \
    --out /tmp/bench-real 2>>"$OUT/stderr.log" | head -16
  cp /tmp/bench-real/bench.json "$OUT/bench-real.json"
fi
