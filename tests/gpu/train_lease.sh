#!/usr/bin/env bash
# The last call of a lease that trains draft heads on a lent GPU (tests/gpu/train_heads.py), after
# the 1.5B's .gguf travelled in pieces to /tmp/p (how: search/qwen2.5-coder-1.5b/cuda-h200-real/
# README.md). Carried beside the repo: .gpu/tok (tokenizer files from the model cache) and .whl
# (the gguf wheel). Assembles and checks the .gguf, trains heads starting from the shipped ones
# (measured on the same held-out answers first), and leaves in $OUT what comes back: the log, the
# heads and the answers in pieces of 15 MiB (the tool returns files of up to 16 MiB).
# Env: GEN (seconds of answering), EPOCHS, LR, LIMIT (seconds for the training run), ANSWERS
# (earlier runs' answers, e.g. search/.../answers.safetensors.xz, trained on too), VARIANTS (e.g.
# "2-soft 1": heads trained one after the other on the same rows), SPT (question lists per topic),
# INIT (heads to start from; default the shipped ones, of two layers: one-layer variants need
# one-layer heads, e.g. stop 41's from git, or none: INIT= trains from zeros).
set -u
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
# a rerun on the same warm machine finds the pieces assembled already
(cd /tmp/p && { ! ls part?? > /dev/null 2>&1 || { cat part?? > model.gguf && rm part??; }; } &&
  sha256sum model.gguf) | tee "$OUT/sha.txt"
grep -q $SHA "$OUT/sha.txt" || { echo "the assembled .gguf is not the 1.5B's"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
H=selfspec/plans/qwen2.5-coder-1.5b/heads.safetensors
rm -f /tmp/o/heads*.safetensors  # a rerun sends back only its own heads
START=${INIT-$H}
timeout "${LIMIT:-300}" python3 tests/gpu/train_heads.py /tmp/p model.gguf .gpu/tok /tmp/o \
  --questions 20000 --samples-per-topic "${SPT:-16}" --batch 2048 --heads 4 --seed "${SEED:-1}" \
  --generate-seconds "${GEN:-150}" --epochs "${EPOCHS:-8}" --lr "${LR:-5e-4}" --compare $H ${START:+--init $START} \
  --variants ${VARIANTS:-2-soft} ${ANSWERS:+--answers $ANSWERS} 2>&1 | tee "$OUT/train.log"
for f in /tmp/o/heads*.safetensors /tmp/o/answers.safetensors; do
  [[ -f $f ]] && split -b 15m -d -a 1 "$f" "$OUT/$(basename "$f")."
done
ls -la "$OUT"
