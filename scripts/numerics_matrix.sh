#!/usr/bin/env bash
# Run the numerics-sensitive tests under each CPU class this machine can emulate:
#   ./scripts/numerics_matrix.sh [SETTING ...] [-- PYTEST_ARGS ...]
# SETTING: native, avx512 (on an AMX machine: oneDNN without AMX), avx2, default (no vector
# ISA in ATen, SSE4.2 in MKL and oneDNN); all that apply when none is named. Each setting lowers
# the kernels' dispatch (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA), so
# float results differ in their last bits as on another CPU. A setting is run only after a probe
# shows that its variables change a sum's, a matmul's or a bf16 matmul's bits here (or that it
# is this machine's own class). Each setting compiles into caches of its own (torch inductor's,
# vLLM's): a kernel compiled under one setting and loaded under another is a mix no CPU runs
# (seen: vLLM's compiled vocab mask, built natively and loaded under avx2, indexed out of range).
# vLLM's own precompiled kernels are not lowered by these variables.
# docs/tests.md: "The numerics on every CPU class".
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python

declare -A ENVS=(
  [native]=""
  [avx512]="ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"
  [avx2]="ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"
  [default]="ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41"
)
# update/, weight_sync/, the ZeRO and LoRA pairs, the shared-prompt and one-pass layouts, the
# exact syncs and resumes, TP resharding, vLLM against the trainer
TESTS=(tests/unit/update tests/unit/weight_sync tests/unit/rl/algo/test_batch.py
       tests/integration/test_zero3.py tests/integration/test_lora.py
       tests/integration/test_shared_prompts.py tests/integration/test_one_pass.py
       tests/integration/test_weight_sync.py tests/integration/test_fast_step.py
       tests/integration/test_rollout.py tests/integration/test_tensor_parallel.py
       tests/integration/test_disaggregated_run.py tests/integration/test_resume.py)

settings=() extra=()
while [ $# -gt 0 ]; do
  case "$1" in --) shift; extra=("$@"); break ;; *) settings+=("$1"); shift ;; esac
done
if [ ${#settings[@]} -eq 0 ]; then
  settings=(native)
  grep -qw amx_bf16 /proc/cpuinfo && settings+=(avx512)
  settings+=(avx2 default)
fi

probe() {  # the dispatch ATen reports, then a digest of each kernel family's bits
  env $1 "$py" - <<'EOF'
import hashlib

import torch

def bits(t):
    return hashlib.sha1(t.float().contiguous().numpy().tobytes()).hexdigest()[:12]

torch.manual_seed(0)
a, b, x = torch.randn(257, 513), torch.randn(513, 129), torch.randn(64, 4097)
print(torch.backends.cpu.get_cpu_capability(), "aten:" + bits(x.log_softmax(-1)),
      "mkl:" + bits(a @ b), "onednn:" + bits(a.bfloat16() @ b.bfloat16()))
EOF
}

native=$(probe "")
echo "numerics: native dispatch here: $native"
status=0 summary=()
for s in "${settings[@]}"; do
  [ -n "${ENVS[$s]+x}" ] || { echo "numerics: unknown setting '$s'; known: ${!ENVS[*]}" >&2; exit 2; }
  if [ "$s" != native ]; then
    got=$(probe "${ENVS[$s]}")
    changed=$(comm -13 <(tr ' ' '\n' <<<"$native" | sort) <(tr ' ' '\n' <<<"$got" | sort) | tr '\n' ' ')
    if [ -z "$changed" ]; then
      echo "numerics: $s changes no kernel's bits here ($got): this machine computes so natively; skipped"
      summary+=("$s: skipped (native here)")
      continue
    fi
    echo "numerics: $s takes effect: ${changed}"
  fi
  echo "numerics: === $s: ${ENVS[$s]:-(no variables)} ==="
  start=$(date +%s) caches=$(mktemp -d)
  env ${ENVS[$s]} TORCHINDUCTOR_CACHE_DIR="$caches/inductor" VLLM_CACHE_ROOT="$caches/vllm" \
    "$py" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "${extra[@]}"
  rc=$?
  rm -rf "$caches"
  summary+=("$s: $([ $rc = 0 ] && echo passed || echo "FAILED (exit $rc)") in $(( $(date +%s) - start )) s")
  [ $rc = 0 ] || status=1
done
printf 'numerics: %s\n' "${summary[@]}"
exit $status
