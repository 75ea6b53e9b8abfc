#!/usr/bin/env bash
# What a session with a lent CUDA GPU should run first (one short script, a few minutes):
#   1. the compiled step's tests on CUDA, with CUDA graphs (mode reduce-overhead): logits equal
#      to eager on every pass shape, speculative greedy equal to plain greedy;
#   2. the compiled blocks' speed (default, then reduce-overhead) against the eager torch
#      blocks, pass by pass. If reduce-overhead passes and pays, `auto` can mean it on CUDA
#      (model/compiled.py, parse_compile).
# usage (from the repository root): scripts/gpu_checks.sh [MODEL]   (at most 240 + 2 x 150 s: one device command)
#   MODEL: a .gguf file, HF folder or alias (default: the default model's PyPI package, which a
#   bare GPU machine may lack). The 98 MB .gguf is over the device tool's 64 MiB a call: the
#   fourteenth session sent it in two halves (two calls back to back, the machine kept warm),
#   joined them there, wrote model.safetensors with specdecode.model.gguf_convert.gguf_state_dict
#   beside the local conversion cache's config and tokenizer files, and named that folder.
#   Run on an H200 then: both CUDA tests pass; reduce-overhead cost 1.7x eager per pass.
set -uo pipefail
MODEL=${1:-}
# a lent machine's Python may be python3 only (scripts/device_train.sh)
mkdir -p /tmp/bin && { command -v python > /dev/null || ln -sf "$(command -v python3)" /tmp/bin/python; }
export PATH=/tmp/bin:$PATH
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
timeout 240 python -m pytest tests/model/test_compiled.py -q -rs -p no:cacheprovider
for mode in default reduce-overhead; do
  timeout 150 python benchmarks/bench_block.py --device cuda --modes none --rounds 9 --compiled $mode ${MODEL:+--model "$MODEL"}
done
