#!/usr/bin/env bash
# Here, before a session's GPU calls: what scripts/device_train.sh needs on the device machine,
# which has no model, no `gguf` package and no network. One device call carries at most 64 MiB
# together with the working tree (~43 MB, the shipped weights included), so the 98 MB GGUF goes
# in parts of PART_MB, each carried by its own call (the machine stays warm between calls).
# usage (repository root): scripts/device_bundle.sh [PART_MB]   (default 20: 5 parts)
# Writes .dev/ (ignored through .git/info/exclude): gguf.part.*, hf/ (config, tokenizer and chat
# template of the local conversion: transformers' GGUF tokenizer converter is then not needed
# there; and the GGUF's sha256, checked after joining) and whl/ (gguf's wheel; its own needs are all on the machine), then prints the calls.
set -euo pipefail
PART_MB=${1:-20}
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.dev/' "$EXCLUDE" 2>/dev/null || echo '/.dev/' >> "$EXCLUDE"
rm -rf .dev && mkdir -p .dev/hf .dev/whl
GGUF=$(python -c "from specdecode.model.loader import default_model_path; print(default_model_path())")
HF=$(python -c "
from pathlib import Path
from specdecode.model.gguf_convert import converted_folder
print(converted_folder(Path('$GGUF'), 'smollm2-135m', progress=False))")
for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  if [ -f "$HF/$f" ]; then cp "$HF/$f" .dev/hf/; fi
done
split -b "${PART_MB}m" -d -a 2 "$GGUF" .dev/gguf.part.
sha256sum < "$GGUF" | sed 's/-$/model.gguf/' > .dev/hf/gguf.sha256  # checked after joining there
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .dev/whl "gguf==$(python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
parts=(.dev/gguf.part.*)
echo "bundle: ${#parts[@]} parts of ${PART_MB} MB, $(du -sh .dev | cut -f1) in all; the device calls, in order (keep them back to back):"
for p in "${parts[@]:0:${#parts[@]}-1}"; do
  echo "  run carry=[\"$p\"]  command: mkdir -p /tmp/m && cp $p /tmp/m/"
done
echo "  run carry=[\"${parts[-1]}\", \".dev/hf\", \".dev/whl\"] timeout_s=600  command: bash scripts/device_train.sh"
