#!/usr/bin/env bash
# Start jaxgpt on several processes: one per host (default) or one per GPU, all with the same arguments.
#
#   ./launch_multihost.sh --local N [--devices-per-process K] -- [train args]
#       N processes on this machine, CPU devices (K each, default 4), gloo collectives. For testing
#       and for trying multi-host layouts without a cluster.
#   ./launch_multihost.sh [--per-gpu] -- [train args]
#       By hand, on every host: set COORDINATOR_ADDRESS=host0:port, NUM_PROCESSES and PROCESS_ID
#       (0 on host0) first. With --per-gpu, run it once per GPU with PROCESS_ID counting GPUs and
#       LOCAL_DEVICE_IDS=<gpu index> (NUM_PROCESSES = hosts x GPUs).
#   ./launch_multihost.sh --slurm [--per-gpu] -- [train args]
#       Inside an sbatch allocation: srun starts one task per node (or per GPU with --per-gpu);
#       JAX reads the SLURM variables. See scripts/slurm_example.sbatch.
#
# On GPU it sets the XLA and NCCL flags below unless they are already in the environment; set
# JAXGPT_NO_GPU_FLAGS=1 to start from a clean XLA_FLAGS instead.
set -euo pipefail

mode=manual nlocal=0 per_gpu=0 devices_per_process=4
while [[ $# -gt 0 ]]; do
  case "$1" in
    --local) mode=local; nlocal="$2"; shift 2 ;;
    --devices-per-process) devices_per_process="$2"; shift 2 ;;
    --slurm) mode=slurm; shift ;;
    --per-gpu) per_gpu=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "error: unknown option '$1' (see --help); put train arguments after --" >&2; exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python}"

gpu_flags() {
  # The latency-hiding scheduler overlaps collectives with compute; combining small collectives
  # into large ones amortises their launch cost; pipelining FSDP's all-gathers / reduce-scatters
  # across the layer loop hides them behind the previous layer (JAX GPU performance guide, MaxText).
  [[ "${JAXGPT_NO_GPU_FLAGS:-0}" == 1 ]] && return
  local flags=(
    --xla_gpu_enable_latency_hiding_scheduler=true
    --xla_gpu_enable_triton_gemm=false
    --xla_gpu_all_reduce_combine_threshold_bytes=134217728
    --xla_gpu_all_gather_combine_threshold_bytes=134217728
    --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
    --xla_gpu_enable_pipelined_all_gather=true
    --xla_gpu_enable_pipelined_reduce_scatter=true
    --xla_gpu_enable_pipelined_all_reduce=true
    --xla_gpu_enable_while_loop_double_buffering=true
  )
  local f
  for f in "${flags[@]}"; do
    [[ " ${XLA_FLAGS:-} " == *" ${f%%=*}="* ]] || XLA_FLAGS="${XLA_FLAGS:-} $f"
  done
  export XLA_FLAGS
  export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-1}"          # NVLink SHARP on H100/H200 systems
  export NCCL_IB_QPS_PER_CONNECTION="${NCCL_IB_QPS_PER_CONNECTION:-4}"
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
}

case "$mode" in
  local)
    [[ "$nlocal" =~ ^[1-9][0-9]*$ ]] || { echo "error: --local needs a process count" >&2; exit 2; }
    port="${JAXGPT_PORT:-$(( 20000 + RANDOM % 20000 ))}"
    pids=()
    trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
    for ((i = 0; i < nlocal; i++)); do
      COORDINATOR_ADDRESS="127.0.0.1:$port" NUM_PROCESSES="$nlocal" PROCESS_ID="$i" JAX_PLATFORMS=cpu \
        XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices_per_process" \
        "$PYTHON" -m jaxgpt.train "$@" &
      pids+=($!)
    done
    # Wait for all; the first non-zero exit becomes ours (the others are stopped by the heartbeat).
    rc=0
    for i in "${!pids[@]}"; do
      s=0; wait "${pids[$i]}" || s=$?
      if [[ $s -ne 0 ]]; then
        echo "launch_multihost: process $i exited with code $s" >&2
        [[ $rc -ne 0 ]] || rc=$s
      fi
    done
    exit "$rc"
    ;;
  slurm)
    gpu_flags
    if [[ $per_gpu == 1 ]]; then
      exec srun --ntasks-per-node="${SLURM_GPUS_ON_NODE:-8}" --gpus-per-task=1 "$PYTHON" -m jaxgpt.train "$@"
    fi
    exec srun --ntasks-per-node=1 "$PYTHON" -m jaxgpt.train "$@"
    ;;
  manual)
    for v in COORDINATOR_ADDRESS NUM_PROCESSES PROCESS_ID; do
      [[ -n "${!v:-}" ]] || { echo "error: set $v (or use --local N / --slurm); see --help" >&2; exit 2; }
    done
    gpu_flags
    exec "$PYTHON" -m jaxgpt.train "$@"
    ;;
esac
