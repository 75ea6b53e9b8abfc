#!/usr/bin/env bash
# On a lent GPU machine (the device tool), the last of the calls scripts/device_bundle.sh prints:
# joins the GGUF parts (the earlier calls copied theirs to /tmp/m; this call carries the last),
# installs the carried gguf wheel, writes the target as an HF folder (the carried config and
# tokenizer, fp32 weights from the GGUF), trains the drafters with scripts/train_drafters_gpu.sh
# and leaves one tar per method (config.json, model.safetensors, train_log.json) and the logs
# in $OUT (the tool brings back at most 8 files).
# Defaults fit one 600 s call: REGEN_S=100 (and as long again for the passages pass), TRAIN_S=260;
# 2 REGEN_S + TRAIN_S + ~120 s (loading, the evaluations, packing) must fit the call's limit, which
# is less than its timeout_s when the session's device time runs short (ask `status` first: the
# start and the four transfer calls take some of the 15 minutes).
# INIT (default specdecode/weights/smollm2-135m) continues each shipped drafter on the new data
# (--init --finetune, at LR_INIT); INIT= (empty) trains from scratch. Other knobs: train_drafters_gpu.sh.
# Locally (a dry run on CPU): OUT=/tmp/o bash scripts/device_train.sh, with tiny knobs.
set -euo pipefail
OUT=${OUT:?set by the device tool}
M=${DEVICE_TMP:-/tmp/m}
mkdir -p "$M" /tmp/bin
cp .dev/gguf.part.* "$M"/
cat "$M"/gguf.part.* > "$M/model.gguf"
if ! (cd "$M" && sha256sum -c --quiet "$OLDPWD/.dev/hf/gguf.sha256"); then
  echo "the GGUF parts in $M do not make the model: a part's call was missed, or the machine went cold between calls"
  exit 2
fi
# the machine's Python is python3 (no `python`), which train_drafters_gpu.sh calls
command -v python > /dev/null || ln -sf "$(command -v python3)" /tmp/bin/python
export PATH=/tmp/bin:$PATH
python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
rm -rf "$M/hf" && cp -r .dev/hf "$M/hf"
python - "$M" <<'EOF'
import sys
from pathlib import Path

from gguf import GGUFReader
from safetensors.torch import save_file
from transformers import AutoConfig

from specdecode.model.gguf_convert import gguf_architecture, gguf_state_dict

m = Path(sys.argv[1])
reader = GGUFReader(str(m / "model.gguf"))
state = gguf_state_dict(reader, gguf_architecture(reader), AutoConfig.from_pretrained(m / "hf"))
save_file({k: v.contiguous() for k, v in state.items()}, str(m / "hf" / "model.safetensors"), metadata={"format": "pt"})
print(f"target: {len(state)} tensors written to {m / 'hf'}")
EOF
INIT=${INIT-specdecode/weights/smollm2-135m} LR_INIT=${LR_INIT:-5e-4} REGEN_S=${REGEN_S:-100} TRAIN_S=${TRAIN_S:-260} \
  bash scripts/train_drafters_gpu.sh "$M/hf" "$M/out" 2>&1 | tee "$M/train.log" || true
for dir in "$M"/out/*/; do
  m=$(basename "$dir")
  if [ -f "$dir/model.safetensors" ]; then
    tar -cf "$OUT/$m.tar" --ignore-failed-read -C "$M/out" "$m/config.json" "$m/model.safetensors" "$m/train_log.json"
  fi
done
tar -czf "$OUT/logs.tgz" -C "$M" train.log out/logs
ls -la "$OUT"
