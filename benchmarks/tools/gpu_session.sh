#!/usr/bin/env bash
# The GPU evidence of this project, in parts that each fit one device call (< 10 minutes).
# Run from the repository root on the GPU machine with .gpu (and .peers for the peers) carried:
#   bash benchmarks/tools/gpu_session.sh suites|suite-1|suite-2|suite-3|suite-ids|fwd|fwd-long|fwd-bwd|fwd-bwd-1|fwd-bwd-2|fwd-bwd-3|segmented|tuned|tuned-fwd|profile|variants|train|lm-step|lm-row|lm-scan|lm-gemm-slices|lm-check|lm-tests|lm-memory|decode|decode-callback|decode-matrix|decode-sampling|command-buffers|lm-loss|conv-ncu|conv-segments|decode-weight-first [OUT]
# Every step has its own time cap, so a slow step cannot eat the others; results land in OUT
# (default $OUT, else ./gpu_out), logs and JSON for benchmarks/results/.
set -u
part=${1:?usage: gpu_session.sh suites|suite-1|suite-2|suite-3|suite-ids|fwd|fwd-long|fwd-bwd|fwd-bwd-1|fwd-bwd-2|fwd-bwd-3|segmented|tuned|tuned-fwd|profile|variants|train|lm-step|lm-row|lm-scan|lm-gemm-slices|lm-check|lm-tests|lm-memory|decode|decode-callback|decode-matrix|decode-sampling|command-buffers|lm-loss|conv-ncu|conv-segments|decode-weight-first [OUT]}
out=${2:-${OUT:-gpu_out}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
# causal_conv1d for the peer, built in the background by the parts that run it (lm-step, lm-row, decode-matrix) into
# /tmp/ccsite; its build needs the machine's CUDA toolkit, which gpu-env.sh hides. A marker says how it ended. (A
# build left running by an earlier call is not counted on: calls sent back to back were seen to land on a fresh
# machine.)
if [ "$part" = lm-step ] || [ "$part" = lm-row ] || [ "$part" = decode-matrix ]; then
  rm -f /tmp/ccsite.done /tmp/ccsite.failed
  ( cd .peers && CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=16 NVCC_THREADS=2 timeout 480 python3 -m pip install \
      --no-build-isolation --no-deps --no-index ./cc --target /tmp/ccsite > /tmp/causal_conv1d_build.log 2>&1 \
    && touch /tmp/ccsite.done || touch /tmp/ccsite.failed ) &
fi
wait_peer() {  # until the build has ended, either way (its log lands in $out)
  while [ ! -e /tmp/ccsite.done ] && [ ! -e /tmp/ccsite.failed ]; do sleep 5; done
  cp /tmp/causal_conv1d_build.log "$out/"
  [ -e /tmp/ccsite.done ] || echo "   causal_conv1d's build failed: see causal_conv1d_build.log"
}
source .gpu/gpu-env.sh >/dev/null || exit 1
# The device copy of the tree has no .git: pass the commit, JAX_MAMBA2_GIT_SHA=$(git rev-parse --short HEAD).
export JAX_MAMBA2_GIT_SHA=${JAX_MAMBA2_GIT_SHA:-unknown}
peers=(); [ -d .peers ] && peers=(--mamba-ssm .peers --jla .peers)

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a cap, logging to $out/NAME.log
  local name=$1 cap=$2; shift 2
  echo "== $name (cap ${cap}s)"
  timeout "$cap" "$@" > "$out/$name.log" 2>&1
  echo "   exit $? ; $(grep -E '(passed|failed|error)' "$out/$name.log" | tail -1)"
}

sharded() {  # sharded NAME SECONDS SHARDS FILES... [-k EXPR]: the GPU tests of FILES, split over SHARDS
  # processes sharing the GPU (serially the suites take ~30 minutes)
  local name=$1 cap=$2 shards=$3; shift 3
  # The sweeps over every config ("every_") take minutes each: listed first, they start at once, one per shard.
  python -m pytest -m gpu --collect-only -q -p no:cacheprovider "$@" | grep '::' \
    | awk '/every_/ {print; next} {rest[n++] = $0} END {for (i = 0; i < n; i++) print rest[i]}' > "$out/$name.ids"
  echo "== $name: $(wc -l < "$out/$name.ids") tests in $shards shards (cap ${cap}s)"
  for i in $(seq 0 $((shards - 1))); do
    awk -v n="$shards" -v i="$i" 'NR % n == i' "$out/$name.ids" > "$out/$name.$i.ids"
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$cap" xargs -r -d "\n" -a "$out/$name.$i.ids" \
      python -m pytest -m gpu -q -rf -p no:cacheprovider > "$out/$name.$i.log" 2>&1 &
  done
  wait
  grep -hE '^(FAILED|ERROR)|(passed|failed|error|skipped)' "$out/$name".*.log
}

case $part in
  suites)  # every GPU test (kernels, op, LM) on the visible GPU in parallel shards; default kernel configs
    export JAX_MAMBA2_AUTOTUNE=0
    sharded gpu_suites "${CAP:-480}" "${SHARDS:-12}" tests/kernels/test_stages_gpu.py \
      tests/kernels/test_backward_gpu.py tests/bridge/test_cutile_gpu.py tests/flax_layers/test_lm_gpu.py
    ;;
  suite-1|suite-2|suite-3|suite-ids)  # every GPU test of tests/ in PARTS parts (default 2; 3 where a half does not
    # fit a call), part N taking every PARTS-th id (the long sweeps first), or (suite-ids) the ids listed in the file
    # $IDS, under pytest-xdist's workers sharing the GPU (WORKERS, default 8; each frees what it no longer uses, the
    # platform allocator, so that 80 GB hold them all); JUnit XML that benchmarks/tools/suite_record.py turns into
    # the suite's record (each half 5-9 minutes on an H100)
    export JAX_MAMBA2_AUTOTUNE=0 XLA_PYTHON_CLIENT_ALLOCATOR=platform
    half=${part#suite-}
    nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu_name.txt"
    if [ "$half" = ids ]; then
      cp "${IDS:?set IDS to a file of test ids}" "$out/suite_$half.ids"
    else
      python -m pytest -m gpu --collect-only -q -p no:cacheprovider tests | grep '::' \
        | awk '/every_/ {print; next} {rest[n++] = $0} END {for (i = 0; i < n; i++) print rest[i]}' \
        | awk -v h="$half" -v n="${PARTS:-2}" 'NR % n == h % n' > "$out/suite_$half.ids"
    fi
    echo "== suite half $half: $(wc -l < "$out/suite_$half.ids") tests (cap ${CAP:-540}s)"
    rm -f "$out/suite_$half.xml"  # pytest writes it only when it ends: none left from an earlier run
    echo "workers=${WORKERS:-8} allocator=platform cap_s=${CAP:-540} parts=${PARTS:-2}" > "$out/suite_$half.settings"
    # At the cap pytest is interrupted (SIGINT), so that it still writes the XML of the tests that ended; pytest
    # is timeout's own child (the ids as arguments, no xargs between), so the XML is there when timeout returns.
    mapfile -t ids < "$out/suite_$half.ids"
    timeout --signal=INT --kill-after=30 "${CAP:-540}" python -m pytest -m gpu -q -rfs -p no:cacheprovider "${ids[@]}" \
      -n "${WORKERS:-8}" --dist load --junitxml="$out/suite_$half.xml" > "$out/suite_$half.log" 2>&1
    echo $? > "$out/suite_$half.rc"
    echo "   exit $(cat "$out/suite_$half.rc") ; $(grep -E '(passed|failed|error)' "$out/suite_$half.log" | tail -1)"
    ;;
  fwd)  # the forward grid with every peer, default configs (tuning every shape does not fit one call)
    step ssd_fwd 540 python benchmarks/ssd.py --tuning off "${peers[@]}" --out "$out"
    ;;
  fwd-long)  # the grid's one-sequence 131072-token shape alone: its xla reference and peers take minutes
    step ssd_fwd_long 540 python benchmarks/ssd.py --tuning off --shapes 1,131072,32,64,128,1 "${peers[@]}" \
      --out "$out"
    ;;
  fwd-bwd-1|fwd-bwd-2|fwd-bwd-3)  # forward + backward on the six-shape grid, 2 shapes per call, one step each:
    # a shape takes 4-5 minutes (first calls: cutile ~50 s, xla ~40 s, mamba_ssm's Triton autotune ~100 s)
    case $part in
      fwd-bwd-1) shapes=(4,8192,32,64,128,1 2,32768,32,64,128,1) ;;
      fwd-bwd-2) shapes=(4,8192,32,64,64,1 4,8192,32,64,256,1) ;;
      fwd-bwd-3) shapes=(4,8192,80,64,128,1 4,16384,8,64,128,1) ;;
    esac
    for shape in "${shapes[@]}"; do
      step "ssd_fwd_bwd_$shape" 275 python benchmarks/ssd.py --direction fwd_bwd --tuning off --shapes "$shape" \
        --impls cutile xla mamba_ssm jla "${peers[@]}" --out "$out/$shape"
    done
    ;;
  fwd-bwd)  # fwd-bwd-1 and fwd-bwd-2 at once on a 2-GPU machine, one per GPU (results in OUT/1 and OUT/2)
    CUDA_VISIBLE_DEVICES=0 bash "$0" fwd-bwd-1 "$out/1" & CUDA_VISIBLE_DEVICES=1 bash "$0" fwd-bwd-2 "$out/2" &
    wait
    ;;
  segmented)  # the segmented forward layout: GPU stage tests and per-launch times of the three layouts
    export JAX_MAMBA2_AUTOTUNE=0
    step kernels_segmented_gpu 200 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/kernels/test_stages_gpu.py \
      -k "segmented"
    step stages_segmented 200 python benchmarks/tools/stages.py --layouts staged fused segmented \
      --shapes 4,16384,8,64,128,1 2,32768,32,64,128,1 1,131072,32,64,128,1 --out "$out"
    ;;
  tuned)  # autotuned forward + backward at the main shape, every stage's launch time, the bridge overhead
    export JAX_MAMBA2_CACHE_DIR=${JAX_MAMBA2_CACHE_DIR:-$out/tuning} JAX_MAMBA2_AUTOTUNE=1
    step ssd_tuned 300 python benchmarks/ssd.py --direction fwd_bwd --shapes 4,8192,32,64,128,1 \
      --impls cutile --out "$out"
    step stages 120 python benchmarks/tools/stages.py --shapes 4,8192,32,64,128,1 --configs tuned --deterministic \
      --out "$out"
    step bridge_overhead 60 python benchmarks/bridge_overhead.py --out "$out"
    ;;
  tuned-fwd)  # the autotuned forward (every layout and config measured) at the shapes in $SHAPES, cutile alone
    export JAX_MAMBA2_CACHE_DIR=${JAX_MAMBA2_CACHE_DIR:-$out/tuning} JAX_MAMBA2_AUTOTUNE=1
    for shape in ${SHAPES:?set SHAPES to B,L,H,P,N,G ...}; do
      step "ssd_fwd_tuned_$shape" 280 python benchmarks/ssd.py --shapes "$shape" --impls cutile --out "$out/$shape"
    done
    ;;
  profile)  # per-kernel GPU time of one jitted training step (JAX profiler trace) at the shapes in $SHAPES
    export JAX_MAMBA2_AUTOTUNE=0
    for shape in ${SHAPES:-4,8192,32,64,128,1}; do
      step "trace_$shape" 150 python benchmarks/tools/kernel_profile.py run --shape "$shape" --trace "/tmp/trace_$shape"
      step "profile_$shape" 30 python benchmarks/tools/kernel_profile.py summarize \
        "$(ls /tmp/trace_"$shape"/plugins/profile/*/perfetto_trace.json.gz | head -1)" --out "$out/profile_$shape.json"
    done
    ;;
  variants)  # the alternatives to the backward defaults (their GPU tests, then per-launch times at $SHAPES,
    # default the first three fwd-bwd shapes): bwd_dc per head with one key block, and summing heads at occupancy 1;
    # the reverse state pass at occupancy 4 and 5 (the default takes 5 only where that saves a wave)
    export JAX_MAMBA2_AUTOTUNE=0
    sharded kernels_variants_gpu 200 6 tests/kernels/test_backward_gpu.py -k "one_key or summing"
    dc=chunk_scan_bwd_dc
    step stages_variants 330 python benchmarks/tools/stages.py --repeats 10 --out "$out" \
      --shapes ${SHAPES:-4,8192,32,64,128,1 2,32768,32,64,128,1 4,8192,32,64,64,1} \
      --bwd-variant dc_per_head_one_key_block:$dc.BLOCK_K=64,$dc.SUM_HEADS=0,$dc.OCCUPANCY=2 \
        dc_summing_occupancy1:$dc.BLOCK_K=64,$dc.SUM_HEADS=1,$dc.OCCUPANCY=1 \
        state_occupancy4:chunk_state_bwd.OCCUPANCY=4 state_occupancy5:chunk_state_bwd.OCCUPANCY=5
    ;;
  train)  # the training check: the same 200 steps with the cuTile and the xla backends
    for backend in cutile xla; do
      step "train_$backend" 200 python examples/train_lm.py --steps 200 --d-model 256 --layers 4 \
        --d-state 64 --headdim 64 --chunk-size 64 --seq-len 512 --batch 16 --dtype bfloat16 \
        --backend "$backend" --out "$out/$backend"
    done
    step train_curves 30 python benchmarks/train_curves.py "$out/cutile/train_lm/metrics.json" \
      "$out/xla/train_lm/metrics.json" --png "$out/train_curves_h200.png"
    rm -rf "$out"/*/train_lm/checkpoints "$out"/*/train_lm/model   # large, and not evidence
    step jit_model 60 python examples/jit_model.py --out "$out"
    ;;
  lm-step)  # the LM training step at d1024-l24-8x2048 against mamba_ssm's fused path in one call (~9 minutes):
    # causal_conv1d built in the background (above) from .peers/cc (as tools/prepare_peers.py lays it out: sm_90
    # alone, float32 and bfloat16 alone),
    # meanwhile ours profiled without the non-finite confinement and with the layer scan, then the
    # peer and ours unrolled (the README's row) once the build is done
    export JAX_MAMBA2_AUTOTUNE=0
    step lm_step_unchecked 170 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile --unroll-layers \
      --no-check-finite --worker-timeout 160 --out "$out"
    step lm_step_scan 110 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile --no-profile \
      --worker-timeout 100 --out "$out"
    wait_peer
    step lm_step_peer 170 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls mamba_ssm --mamba-ssm .peers \
      --causal-conv1d /tmp/ccsite --worker-timeout 160 --out "$out"
    step lm_step_unrolled 110 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile --unroll-layers \
      --no-profile --worker-timeout 100 --out "$out"
    ;;
  lm-row)  # lm-step's README row alone, where a call has less than lm-step's ~9 minutes: ours unrolled while
    # causal_conv1d builds, then the peer's fused path
    export JAX_MAMBA2_AUTOTUNE=0
    step lm_step_unrolled 150 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile --unroll-layers \
      --no-profile --worker-timeout 140 --out "$out"
    wait_peer
    step lm_step_peer 170 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls mamba_ssm --mamba-ssm .peers \
      --causal-conv1d /tmp/ccsite --worker-timeout 160 --out "$out"
    ;;
  lm-scan)  # the default layer scan at d1024-l24-8x2048, what its stacking costs: as it is (each residual written
    # into its unfilled stack where the layer computes it, later uses reading it from there), against the same loop
    # stacking the residuals after each layer (where XLA clones or copies a kernel's output that is also a
    # residual), both profiled with their compiled steps in OUT/hlo, then the model's loop saving only in_proj's
    # output (remat="matmuls")
    export JAX_MAMBA2_AUTOTUNE=0
    step lm_scan 150 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile --worker-timeout 140 \
      --hlo-dir "$out/hlo" --out "$out"
    step lm_scan_unfilled 150 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile \
      --layer-loop unfilled --worker-timeout 140 --hlo-dir "$out/hlo" --out "$out"
    step lm_scan_remat 110 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile --remat matmuls \
      --no-profile --worker-timeout 100 --out "$out"
    ;;
  lm-memory)  # the peak memory of the d1536-l48-8x2048 step against mamba_ssm's 41.8 GiB: unrolled as it is (the norm
    # keeping no z copy, the weights converted again in the backward, the chunk states recomputed) and with the
    # chunk states saved, then the
    # gated norm's GPU tests (its backward reading z from in_proj's output) (about 8 minutes)
    export JAX_MAMBA2_AUTOTUNE=0
    step lm_memory_unrolled 190 python benchmarks/lm_train.py --configs d1536-l48-8x2048 --impls cutile --unroll-layers \
      --no-profile --worker-timeout 180 --out "$out"
    step lm_memory_saved 190 python benchmarks/lm_train.py --configs d1536-l48-8x2048 --impls cutile \
      --unroll-layers --chunk-states saved --no-profile --worker-timeout 180 --out "$out"
    step norm_gpu_tests 90 python -m pytest -m gpu -q -rf -n 4 -p no:cacheprovider tests/kernels/test_rms_norm_gpu.py
    ;;
  lm-tests)  # the GPU tests of the model around the kernels: the LM (its layer loop's compiled step included), its
    # loss's softmax kernels, the norms, the conv, the decode ops and the fused decode step (about 6 minutes on a
    # fresh machine, in 6 parallel processes: 8 ran two of the decode tests out of an H100's 80 GB)
    export JAX_MAMBA2_AUTOTUNE=0
    step lm_gpu_tests 540 python -m pytest -m gpu -q -rf -n 6 -p no:cacheprovider -o faulthandler_timeout=500 \
      tests/flax_layers/test_lm_gpu.py tests/kernels/test_cross_entropy_gpu.py tests/kernels/test_rms_norm_gpu.py \
      tests/test_conv1d_gpu.py tests/test_decode_ops_gpu.py tests/flax_layers/test_decode_gpu.py
    ;;
  decode)  # the decode ops: their GPU tests, every plan and config timed outside JAX, the LM's token step at batches
    # 1-256 against mamba_ssm's with a profile (about 9 minutes)
    export JAX_MAMBA2_AUTOTUNE=0
    step decode_gpu_tests 150 python -m pytest -m gpu -q -rf -n 6 -p no:cacheprovider tests/test_decode_ops_gpu.py \
      tests/flax_layers/test_decode_gpu.py
    step decode_launches 220 python benchmarks/tools/decode_launches.py --out "$out"
    lm_peer=(); [ -d .peers ] && lm_peer=(--mamba-ssm .peers)
    step lm_decode 190 python benchmarks/lm_decode.py --configs d1024-l24 --impls cutile mamba_ssm \
      --param-dtypes bfloat16 --batches 1 8 64 256 --prompt-lengths --profile "${lm_peer[@]}" --worker-timeout 180 \
      --out "$out"
    ;;
  decode-callback)  # the token step as one merged callback replaying a CUDA graph of programmatic dependent
    # launches (the callback backend, decode.token_step): the GPU tests of the merged step's tokens, then generate
    # (bf16) on the FFI executor against it for the configs in $DECODE_CONFIGS (default mamba2-1.3b d1024-l24) at
    # the batches in $DECODE_BATCHES (default 1 8 64), profiled (each token step's GPU busy and idle time; about
    # 9 minutes). The executors' probe runs on its own: python benchmarks/tools/callback_graph.py --out "$OUT"
    export JAX_MAMBA2_AUTOTUNE=0
    read -r -a configs <<< "${DECODE_CONFIGS:-mamba2-1.3b d1024-l24}"
    read -r -a batches <<< "${DECODE_BATCHES:-1 8 64}"
    shape=(--configs "${configs[@]}" --batches "${batches[@]}")
    step decode_callback_gpu_tests 120 python -m pytest -m gpu -q -rf -p no:cacheprovider \
      tests/flax_layers/test_decode_gpu.py -k "callback_backend or greedy_tokens_are"
    step lm_decode_callback 450 python benchmarks/lm_decode.py --impls cutile_callback cutile "${shape[@]}" \
      --param-dtypes bfloat16 --prompt-lengths --profile --worker-timeout 150 --out "$out"
    ;;
  decode-matrix)  # the LM decode benchmark at the batches in $DECODE_BATCHES (default 1 8 64 256) with prefills of
    # the prompts in $DECODE_PROMPTS (default 512 2048; empty for none) for the configs in $DECODE_CONFIGS (default
    # d1024-l24 mamba2-370m; mamba2-780m mamba2-1.3b in a second call), parameters in $PARAM_DTYPE (default
    # bfloat16): the LM decode GPU tests, ours, then mamba_ssm's step with causal_conv1d's update kernel once its
    # build is done (about 9 minutes)
    export JAX_MAMBA2_AUTOTUNE=0
    read -r -a configs <<< "${DECODE_CONFIGS:-d1024-l24 mamba2-370m}"
    read -r -a batches <<< "${DECODE_BATCHES:-1 8 64 256}"
    read -r -a prompts <<< "${DECODE_PROMPTS-512 2048}"
    shape=(--configs "${configs[@]}" --param-dtypes "${PARAM_DTYPE:-bfloat16}" --batches "${batches[@]}"
           --prompt-lengths "${prompts[@]}" --worker-timeout 120 --out "$out")
    step decode_gpu_tests 100 python -m pytest -m gpu -q -rf -n 4 -p no:cacheprovider tests/flax_layers/test_decode_gpu.py
    step lm_decode_ours 200 python benchmarks/lm_decode.py --impls cutile "${shape[@]}"
    wait_peer
    step lm_decode_peer 200 python benchmarks/lm_decode.py --impls mamba_ssm --mamba-ssm .peers \
      --causal-conv1d /tmp/ccsite "${shape[@]}"
    ;;
  decode-sampling)  # what generate's sampling controls add per token (d1024-l24, bf16, batches 1 and 64): greedy,
    # top-k, top-p (a sort of the vocabulary per token) and the repetition penalty (about 5 minutes)
    export JAX_MAMBA2_AUTOTUNE=0
    step lm_decode_sampling 400 python benchmarks/lm_decode.py --configs d1024-l24 --impls cutile \
      --param-dtypes bfloat16 --batches 1 64 --prompt-lengths --sampling greedy top-k top-p penalty \
      --worker-timeout 95 --out "$out"
    ;;
  command-buffers)  # the package's launches in XLA's command buffers (CUDA graphs): the GPU tests of the capture and
    # of the LM's decode (four launches per layer), then the decode step (d1024-l24, bf16, batches 1 and 64) with
    # command buffers as XLA defaults them and with our launches from the host, and the unrolled training step as
    # XLA defaults them and off (about 8 minutes)
    export JAX_MAMBA2_AUTOTUNE=0
    step command_buffer_tests 170 python -m pytest -m gpu -q -rf -n 4 -p no:cacheprovider \
      tests/bridge/test_cutile_gpu.py::test_the_kernels_give_the_same_values_whatever_xla_records_into_command_buffers \
      tests/flax_layers/test_decode_gpu.py
    step lm_decode_command_buffers 150 python benchmarks/lm_decode.py --configs d1024-l24 --impls cutile \
      --param-dtypes bfloat16 --batches 1 64 --prompt-lengths --command-buffers default host_custom_calls --worker-timeout 90 \
      --out "$out"
    for buffers in default off; do
      step "lm_step_command_buffers_$buffers" 110 python benchmarks/lm_train.py --configs d1024-l24-8x2048 \
        --impls cutile --unroll-layers --no-profile --command-buffers "$buffers" --worker-timeout 100 --out "$out"
    done
    ;;
  lm-gemm-slices)  # the default layer scan, compiled with the model's options (no Triton GEMM fusions: cuBLAS calls
    # that XLA's dynamic-slice fusion slices the loop's stacks for in place), against XLA's defaults, alternating, the
    # first pair profiled with the compiled steps in OUT/hlo (about 4 minutes); the records in OUT/ab/*/ (one per
    # run), each compiled step's custom calls inside dynamic-slice fusions in OUT/hlo_summary.txt
    export JAX_MAMBA2_AUTOTUNE=0
    for round in 1 2; do
      profile=(--hlo-dir "$out/hlo"); [ $round = 1 ] || profile=(--no-profile)
      step lm_scan_model_options_$round 150 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile \
        "${profile[@]}" --worker-timeout 140 --out "$out/ab/model_options_$round"
      step lm_scan_xla_defaults_$round 150 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile \
        --xla-option xla_gpu_enable_triton_gemm=true "${profile[@]}" --worker-timeout 140 \
        --out "$out/ab/xla_defaults_$round"
    done
    for hlo in "$out"/hlo/*.hlo.txt.gz; do  # per compiled step: the custom calls inside dynamic-slice fusions
      echo "== $(basename "$hlo")"
      zcat "$hlo" | awk '/^%dynamic-slice-fusion/ {fused = 1; next} /^[^ ]/ {fused = 0}
        fused && /custom_call_target=/ {match($0, /custom_call_target="[^"]*"/); target = substr($0, RSTART, RLENGTH)
          match($0, /op_name="[^"]*"/); print target, substr($0, RSTART + 9, RLENGTH - 10)}' | sort | uniq -c
    done > "$out/hlo_summary.txt"
    ;;
  lm-check)  # the layer scan as the model compiles it, profiled with its compiled step in OUT/hlo, and under
    # remat="matmuls"; the LM's GPU tests; the training example on the cuTile kernels (about 5 minutes)
    export JAX_MAMBA2_AUTOTUNE=0
    step lm_check_scan 120 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile --hlo-dir "$out/hlo" \
      --worker-timeout 110 --out "$out/scan"
    step lm_check_matmuls 100 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile --remat matmuls \
      --no-profile --worker-timeout 90 --out "$out/matmuls"
    XLA_PYTHON_CLIENT_PREALLOCATE=false step lm_check_tests 150 python -m pytest -m gpu -q -rf -n 4 -p no:cacheprovider \
      tests/flax_layers/test_lm_gpu.py
    repo=$PWD
    ( rm -rf /tmp/lm_example && mkdir -p /tmp/lm_example && cd /tmp/lm_example \
      && step lm_check_example 120 python "$repo/examples/train_lm.py" --steps 30 --dtype bfloat16 --layers 4 \
        --d-model 256 --seq-len 512 --eval-every 15 --sample-tokens 40 --backend cutile --out /tmp/lm_example/out )
    ;;
  lm-loss)  # the loss's softmax on the cuTile kernels (one read of a chunk's logits forward, one read and one write
    # backward) against XLA's fusions (a convert and two reductions per chunk at 1.3-2.3x their floors), then the
    # kernels on bf16 logits (half the bytes; the peer's logits under autocast), the unrolled step without the
    # non-finite confinement, each profiled (about 8 minutes)
    export JAX_MAMBA2_AUTOTUNE=0
    for loss in cutile xla; do
      step "lm_loss_$loss" 170 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile --unroll-layers \
        --no-check-finite --loss-backend "$loss" --worker-timeout 160 --out "$out"
    done
    step lm_loss_cutile_bf16_logits 170 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile \
      --unroll-layers --no-check-finite --loss-backend cutile --logits-dtype bfloat16 --worker-timeout 160 --out "$out"
    ;;
  conv-ncu)  # Nsight Compute's full set of the conv kernels (forward and backward, the LM's layout at d_model 1024),
    # to see what bounds them at 3-4x their bandwidth floor: details and the SASS with its stall samples per
    # instruction as CSV (the .ncu-rep stays on the machine)
    XLA_PYTHON_CLIENT_PREALLOCATE=false step conv_ncu 300 ncu --target-processes all \
      --kernel-name regex:'causal_conv1d_(fwd|bwd)_kernel' --launch-skip 4 --launch-count 2 --set full \
      -o /tmp/conv_ncu -f python benchmarks/conv1d.py --impls cutile --layouts mixer_whole --shapes 8,2048,2304 \
      --direction fwd_bwd --budget-seconds 0.2 --out /tmp/conv_ncu_out
    step conv_ncu_csv 60 ncu --import /tmp/conv_ncu.ncu-rep --page details --csv
    gzip -c "$out/conv_ncu_csv.log" > "$out/conv_ncu_h200.csv.gz"
    step conv_ncu_sass 60 ncu --import /tmp/conv_ncu.ncu-rep --page source --csv --print-source sass
    gzip -c "$out/conv_ncu_sass.log" > "$out/conv_ncu_sass_h200.csv.gz"
    ;;
  conv-segments)  # the conv forward walking segments (ConvFwdConfig.SEGMENT_TILES: each step's rows gathered while
    # the step before computes and stores, the halo carried; the default) against one tile per block: the conv GPU
    # tests, the forward in the LM's layout at several tiles, then the unrolled LM step with the one-tile forward
    # (16x512x3) and two segmented ones, the backward at its default (caps summing to 9.5 minutes)
    export JAX_MAMBA2_AUTOTUNE=0
    step conv_gpu_tests 120 python -m pytest -m gpu -q -rf -n 6 -p no:cacheprovider tests/test_conv1d_gpu.py
    step conv_segments 150 python benchmarks/conv1d.py --impls cutile --layouts mixer_whole --shapes 8,2048,2304 \
      --direction fwd --fwd-configs 16x512x3 8x8x512x4 8x32x512x4 8x16x256x4 16x8x256x4 16x8x512x3 --out "$out"
    for fwd in 16x512x3 8x16x512x4 8x16x256x4; do
      step "lm_step_conv_$fwd" 100 python benchmarks/lm_train.py --configs d1024-l24-8x2048 --impls cutile \
        --unroll-layers --no-check-finite --no-profile --conv-configs "$fwd,8x32x128x4" --worker-timeout 90 \
        --out "$out"
    done
    ;;
  decode-weight-first)  # in_proj with float32 weights at 64 rows, every tile: 64-row blocks with the weight as the
    # first operand (WEIGHT_FIRST, the default: wgmma) and 32-row blocks (mma.sync), at the widths of d1024,
    # mamba2-780m and mamba2-1.3b (about 6 minutes)
    export JAX_MAMBA2_AUTOTUNE=0
    step decode_gpu_tests 120 python -m pytest -m gpu -q -rf -n 4 -p no:cacheprovider tests/test_decode_ops_gpu.py \
      -k "weight_first or f32 or split_k"
    for d_model in 1024 1536 2048; do
      step "decode_in_proj_f32_d$d_model" 100 python benchmarks/tools/decode_launches.py --rows 64 --cases in_proj \
        --param-dtypes float32 --d-model "$d_model" --out "$out/d$d_model"
    done
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac

# The device tool brings back at most 8 files from $OUT: pack everything into one archive there.
if [ "$out" = "${OUT:-}" ]; then
  tar czf "/tmp/gpu_session_$part.tgz" -C "$out" . && rm -rf "${out:?}"/* && mv "/tmp/gpu_session_$part.tgz" "$out/"
fi
