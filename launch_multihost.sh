#!/usr/bin/env bash
# Start jaxgpt on several processes: one per host (default) or one per GPU, all with the same arguments.
#
#   ./launch_multihost.sh --local N [--devices-per-process K] [--max-restarts R] [--min-processes M] -- [train args]
#       N processes (1-64) on this machine, CPU devices (K each, default 4), gloo collectives. For testing
#       and for trying multi-host layouts without a cluster. The coordinator's port is a free one, or
#       JAXGPT_PORT; another local job on the same port is refused.
#   ./launch_multihost.sh [--per-gpu] [--max-restarts R] -- [train args]
#       By hand, on every host: set COORDINATOR_ADDRESS=host0:port, NUM_PROCESSES and PROCESS_ID
#       (0 on host0) first. With --per-gpu, run it once per GPU with PROCESS_ID counting GPUs and
#       LOCAL_DEVICE_IDS=<gpu index> (NUM_PROCESSES = hosts x GPUs).
#   ./launch_multihost.sh --slurm [--per-gpu] [--max-restarts R] [--min-processes M] -- [train args]
#       Inside an sbatch allocation: srun starts one task per node (or per GPU with --per-gpu);
#       JAX reads the SLURM variables. See scripts/slurm_example.sbatch.
#   ./launch_multihost.sh --k8s --nodes N --gpus-per-node G --pvc CLAIM [--image IMAGE] [--name NAME]
#                         [--max-restarts R] [--dry-run] -- [train args]
#       Kubernetes: a JobSet of N pods x G GPUs (jaxgpt/parallel/jobset.py), applied with kubectl, or
#       printed with --dry-run. The run dir is on the PersistentVolumeClaim CLAIM (ReadWriteMany),
#       mounted at /runs; JobSet restarts the whole group up to R times (below).
#
# --max-restarts R (default 0), as torchrun's: when a process fails, the others stop within the
# heartbeat timeout (JAXGPT_HEARTBEAT_TIMEOUT, default 60 s; any still running 30 s after that are
# killed), then the whole group is started again, up to R times, and resumes from its newest
# checkpoint. --local restarts its N processes; by hand, each host's launcher restarts its own
# process and they meet again at COORDINATOR_ADDRESS; --slurm runs srun again; under --k8s JobSet
# recreates every pod (failurePolicy.maxRestarts), and exit 75 (a pod evicted with a checkpoint
# saved) replaces that pod without counting as a restart. No restart after
# exit 0, 2 (bad input: it would fail again), 3 (the loss diverged: it would again, from the same
# checkpoint), 75 (stopped on request), 77 (too few processes for the global batch) or when the
# launcher itself gets SIGINT/SIGTERM (passed on: the processes save at the step they agree on and
# exit 75, as the launcher then does). Each restart is recorded in RUN_DIR/events.jsonl (`restart`)
# and in the run report. Exit 76 is a hang the processes' watchdog detected (train.hang_timeout):
# --local kills what is left of the group 5 s after the first such exit, not after the heartbeat.
#
# --min-processes M (--local, --slurm), elastic restarts as torchrun's --nnodes MIN:MAX: --max-restarts
# then counts each host's failures (a hang is blamed on the process the others waited for), and a
# host that fails more than R times, or is gone, is left out: the group restarts on the hosts that
# remain, at least M (else the launcher stops, checkpoints intact), and train shrinks the dp axis and
# raises train.grad_accum so the global batch and data order stay (JAXGPT_ELASTIC_PROCESSES, the full
# count; jaxgpt/resilience/elastic.py). A host that comes back joins at the next restart. --local
# simulates hosts: a file $JAXGPT_LAUNCH_DIR/down/I marks host I gone (scripts/chaos.py). --slurm
# leaves out the allocation's nodes sinfo reports down, drained or not responding (submit with
# --no-kill so that the allocation outlives a node). See docs/fault-tolerance.md.
#
# On GPU it sets the XLA and NCCL flags below unless they are already in the environment; set
# JAXGPT_NO_GPU_FLAGS=1 to start from a clean XLA_FLAGS instead. --k8s gives the pods these flags.
set -euo pipefail

fail() { echo "error: $*" >&2; exit 2; }
value() { [[ $# -ge 2 && "$2" != --* ]] || fail "$1 needs a value (see --help)"; }
set_mode() { [[ $mode == manual || $mode == "$1" ]] || fail "--local, --slurm and --k8s are ways to launch; give one"; mode=$1; }
mode=manual nlocal=0 per_gpu=0 devices_per_process=4 max_restarts=0 min_processes=0 dry_run=0 k8s_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --local) value "$@"; set_mode local; nlocal="$2"; shift 2 ;;
    --devices-per-process) value "$@"; devices_per_process="$2"; shift 2 ;;
    --slurm) set_mode slurm; shift ;;
    --max-restarts) value "$@"; max_restarts="$2"; shift 2 ;;
    --min-processes) value "$@"; min_processes="$2"; shift 2 ;;
    --per-gpu) per_gpu=1; shift ;;
    --k8s) set_mode k8s; shift ;;
    --nodes|--gpus-per-node|--image|--pvc|--name) value "$@"; k8s_args+=("$1" "$2"); shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,48p' "$0"; exit 0 ;;
    *) echo "error: unknown option '$1' (see --help); put train arguments after --" >&2; exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python}"
[[ "$max_restarts" =~ ^[0-9]{1,6}$ ]] || fail "--max-restarts needs a count (0 or more)"
[[ "$min_processes" =~ ^[0-9]{1,4}$ ]] || fail "--min-processes needs a process count (1 or more)"
[[ $min_processes == 0 || $mode == local || $mode == slurm ]] ||
  fail "--min-processes is for --local and --slurm: by hand each host's launcher restarts only its own process, and a JobSet cannot change its pod count (docs/fault-tolerance.md)"
[[ "$devices_per_process" =~ ^[1-9][0-9]{0,3}$ ]] && (( devices_per_process <= 2048 )) ||
  fail "--devices-per-process needs a count from 1 to 2048, got '$devices_per_process'"
[[ $per_gpu == 0 || $mode != local ]] || fail "--per-gpu is for GPU hosts (--slurm or by hand); --local runs CPU processes"
[[ $per_gpu == 0 || $mode != k8s ]] || fail "--per-gpu is not for --k8s: each pod runs one process with all its GPUs"
[[ ${#k8s_args[@]} == 0 && $dry_run == 0 || $mode == k8s ]] ||
  fail "--nodes, --gpus-per-node, --image, --pvc, --name and --dry-run are options of --k8s"
heartbeat="${JAXGPT_HEARTBEAT_TIMEOUT:-60}"
hang_grace=5  # seconds the rest of a group gets to exit on its own after the first hang exit (76)
# --local: where the processes tell the launcher whom a hang waited for, and where simulated hosts
# are marked gone (down/I); a directory of our own unless JAXGPT_LAUNCH_DIR names one.
launch_dir=""
if [[ $mode == local && -n "${JAXGPT_LAUNCH_DIR:-}" ]]; then
  mkdir -p "$JAXGPT_LAUNCH_DIR/down" 2>/dev/null || fail "cannot create JAXGPT_LAUNCH_DIR=$JAXGPT_LAUNCH_DIR"
  launch_dir="$JAXGPT_LAUNCH_DIR"
elif [[ $mode == local ]]; then
  launch_dir=$(mktemp -d "${TMPDIR:-/tmp}/jaxgpt-launch.XXXXXX") || fail "cannot create a directory in ${TMPDIR:-/tmp}"
  trap 'rm -rf "$launch_dir"' EXIT
fi

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

claim_port() {  # claim_port PORT (0: any free one): sets `port` and holds its lock, if it is free and no other job holds that
  local p rc=0
  # SO_REUSEADDR: a port whose last job's connections linger in TIME_WAIT is free (the coordinator
  # binds it so); a listener still makes it EADDRINUSE (exit 1 here); any other failure is said (exit 2)
  p=$("$PYTHON" -c '
import errno, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError as e:
    if e.errno == errno.EADDRINUSE:
        sys.exit(1)
    print(f"error: cannot use port {sys.argv[1]} on 127.0.0.1 for the coordinator: {e.strerror}", file=sys.stderr)
    sys.exit(2)
print(s.getsockname()[1])' "$1") || rc=$?
  (( rc == 0 )) || { (( rc == 1 )) && return 1; exit 2; }
  # held by this shell (and inherited by the processes) until the job ends; no lock where /tmp cannot take one
  if command -v flock >/dev/null && { exec {port_lock}>>"${TMPDIR:-/tmp}/jaxgpt-port-$p.lock"; } 2>/dev/null; then
    flock -n "$port_lock" || { exec {port_lock}>&-; return 1; }
  fi
  port=$p
}

describe() {  # an exit status in words
  local s=$1
  if (( s > 128 )); then echo "code $s (killed by SIG$(kill -l $((s - 128)) 2>/dev/null || echo $((s - 128))))"
  else echo "code $s"; fi
}

# One attempt of the whole group on the active hosts; sets `status` (the first failure's exit code,
# or 0), `reason` and `blame` (the host to count the failure against).
attempt_local() {
  local port="$1" i p s done_pid watchdog="" first=""
  shift
  pids=()
  rm -f "$launch_dir"/hang.* 2>/dev/null || true
  local elastic_env=()
  (( min_processes == 0 )) || elastic_env=(JAXGPT_ELASTIC_PROCESSES="$nlocal")
  for ((i = 0; i < ${#active[@]}; i++)); do
    env COORDINATOR_ADDRESS="127.0.0.1:$port" NUM_PROCESSES="${#active[@]}" PROCESS_ID="$i" JAX_PLATFORMS=cpu \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices_per_process" \
      JAXGPT_LAUNCH_DIR="$launch_dir" "${elastic_env[@]+"${elastic_env[@]}"}" \
      "$PYTHON" -m jaxgpt.train "$@" &
    pids+=($!)
    echo "launch_multihost: process $i is pid $!$( [[ ${active[$i]} == "$i" ]] || echo " (host ${active[$i]})")" >&2
  done
  local remaining=("${pids[@]}")
  status=0 reason="" blame=""
  while ((${#remaining[@]})); do
    s=0; done_pid=""
    wait -n -p done_pid "${remaining[@]}" || s=$?
    if [[ -z "${done_pid:-}" ]]; then  # bash 5.2 unsets it when a trapped signal interrupts the wait
      (( s == 127 )) || continue
      # "no such job": bash reaped a process it no longer lists (two exiting at once); find it
      for p in "${remaining[@]}"; do kill -0 "$p" 2>/dev/null || { done_pid=$p; break; }; done
      [[ -n "$done_pid" ]] || { sleep 0.1; continue; }
      s=0; wait "$done_pid" 2>/dev/null || s=$?  # its status, from bash's list of finished processes
    fi
    for i in "${!pids[@]}"; do [[ "${pids[$i]}" == "$done_pid" ]] && break; done
    local left=()
    for p in "${remaining[@]}"; do [[ "$p" == "$done_pid" ]] || left+=("$p"); done
    remaining=("${left[@]+"${left[@]}"}")
    (( s == 0 )) && continue
    echo "launch_multihost: process $i exited with $(describe "$s")" >&2
    if (( status == 0 )); then
      # The first failure is the cause; the others stop within the heartbeat timeout, or are killed
      # (after a hang, sooner: the process the others wait for may be stopped and never exit).
      status=$s reason="process $i exited with $(describe "$s")" first=$i
      if ((${#remaining[@]})); then
        local grace=$((heartbeat + 30))
        (( s != 76 )) || grace=$hang_grace
        # Its sleep must hold no output pipe and die with it: `... | tee log` would wait for it.
        ( exec >/dev/null 2>&1; sleep "$grace" & sleeper=$!; trap 'kill $sleeper; exit 0' TERM
          wait $sleeper; kill -KILL "${remaining[@]}" ) &
        watchdog=$!
      fi
    fi
  done
  [[ -z "$watchdog" ]] || kill "$watchdog" 2>/dev/null || true
  [[ -n "$first" ]] || return 0
  blame=${active[$first]}
  if (( status == 76 )); then  # the processes' watchdog named the one they waited for (jaxgpt/resilience/watchdog.py)
    local f suspect verdict=""
    for f in "$launch_dir"/hang.*; do
      [[ -f "$f" ]] || continue
      suspect=$(head -n 1 "$f"); verdict=$(sed -n 2p "$f")
      if [[ "$suspect" =~ ^[0-9]+$ ]] && (( suspect < ${#active[@]} )); then blame=${active[$suspect]}; break; fi
    done
    [[ -z "$verdict" ]] || reason="$reason: hang: $verdict"
  fi
}

# The hosts to start on: not left out for failing, not gone (--local: down/I; --slurm: sinfo).
choose_active() {
  local h
  active=()
  for ((h = 0; h < nlocal; h++)); do
    (( ${failed_out[$h]:-0} == 0 )) || continue
    [[ -e "$launch_dir/down/$h" ]] && continue
    active+=("$h")
  done
}

# Runs attempt_$mode until it succeeds, fails in a way a restart cannot fix, or restarts run out
# (with --min-processes: until fewer than M hosts are left, each host allowed R failures).
stopping=0 status=0 reason="" child="" blame="" active=() failures=() failed_out=() unblamed=0
run_with_restarts() {
  local restart=0 was
  while :; do
    export JAXGPT_RESTART_COUNT=$restart JAXGPT_MAX_RESTARTS=$max_restarts JAXGPT_RESTART_REASON="$reason"
    "attempt_$mode" "$@"
    case "$status" in 0|2|3|75|77) return ;; esac
    (( stopping == 0 )) || return 0  # the launcher exits with `status`
    if (( min_processes == 0 )); then
      (( restart < max_restarts )) || return 0
      restart=$((restart + 1))
      echo "launch_multihost: $reason; restarting the group (restart $restart of $max_restarts)" >&2
      continue
    fi
    was=("${active[@]}")
    if [[ -n "$blame" ]]; then
      failures[$blame]=$(( ${failures[$blame]:-0} + 1 ))
      if (( failures[blame] > max_restarts )); then
        failed_out[$blame]=1
        echo "launch_multihost: host $blame failed more than --max-restarts $max_restarts times: leaving it out" >&2
      fi
    fi
    "choose_active_$mode"
    if (( ${#active[@]} < min_processes )); then
      echo "launch_multihost: $reason; ${#active[@]} processes left, fewer than --min-processes $min_processes: stopping (the run dir keeps its checkpoints; the same command resumes once hosts are back)" >&2
      return 0
    fi
    if [[ -z "$blame" && "${active[*]}" == "${was[*]}" ]]; then  # --slurm: no host to blame, none gone
      unblamed=$((unblamed + 1))
      if (( unblamed > max_restarts )); then
        echo "launch_multihost: $reason; more than --max-restarts $max_restarts failures on the same hosts: stopping" >&2
        return 0
      fi
    fi
    restart=$((restart + 1))
    echo "launch_multihost: $reason; restarting the group on ${#active[@]} of $nlocal processes (hosts ${active[*]}; restart $restart)$( [[ "${active[*]}" == "${was[*]}" ]] || echo "; was ${#was[@]}")" >&2
  done
}

# Runs "$@" in the background so that a SIGTERM/SIGINT to the launcher reaches it at once (bash
# defers traps while a foreground child runs); sets `status`.
run_child() {
  local s
  "$@" &
  child=$!
  while :; do
    s=0; wait "$child" || s=$?
    (( s > 128 )) && kill -0 "$child" 2>/dev/null && continue  # a trapped signal interrupted the wait
    break
  done
  status=$s child=""
}
forward() { stopping=1; [[ -z "$child" ]] || kill -"$1" "$child" 2>/dev/null || true; }

attempt_slurm() {
  local per_node=1 elastic=()
  [[ $per_gpu == 0 ]] || per_node="${SLURM_GPUS_ON_NODE:-8}"
  if (( min_processes )); then  # the allocation's nodes that are up, at least M (run_with_restarts checks)
    elastic=(--nodes="${#active[@]}" --nodelist="$(IFS=,; echo "${active[*]}")")
    export JAXGPT_ELASTIC_PROCESSES=$((nlocal * per_node))
  fi
  if [[ $per_gpu == 1 ]]; then
    run_child srun "${elastic[@]+"${elastic[@]}"}" --ntasks-per-node="$per_node" --gpus-per-task=1 "$PYTHON" -m jaxgpt.train "$@"
  else
    run_child srun "${elastic[@]+"${elastic[@]}"}" --ntasks-per-node=1 "$PYTHON" -m jaxgpt.train "$@"
  fi
  reason="srun exited with $(describe "$status")" blame=""
}

attempt_manual() {
  run_child "$PYTHON" -m jaxgpt.train "$@"
  reason="process ${PROCESS_ID} exited with $(describe "$status")"
}

choose_active_local() { choose_active; }

# The allocation's nodes that sinfo does not report down, drained, failing or not responding (`*`).
choose_active_slurm() {
  local node state
  active=()
  for node in "${slurm_nodes[@]}"; do
    state=$(sinfo -h -N -n "$node" -o %t 2>/dev/null | head -n 1)
    case "$state" in ""|*'*'|down*|drain*|drng*|fail*|maint*|unk*|boot*|futr*|npc*|pow*) continue ;; esac
    active+=("$node")
  done
}

case "$mode" in
  k8s)
    # The pods get the flags a GPU host gets here, and only those (not this machine's XLA_FLAGS).
    (( dry_run )) || command -v kubectl >/dev/null ||
      fail "--k8s needs kubectl to apply the JobSet (or --dry-run to print it): install kubectl and point it at the cluster"
    unset XLA_FLAGS NCCL_NVLS_ENABLE NCCL_IB_QPS_PER_CONNECTION XLA_PYTHON_CLIENT_MEM_FRACTION
    gpu_flags
    pod_env=()
    for v in XLA_FLAGS NCCL_NVLS_ENABLE NCCL_IB_QPS_PER_CONNECTION XLA_PYTHON_CLIENT_MEM_FRACTION; do
      [[ -z "${!v:-}" ]] || pod_env+=(--env "$v=${!v# }")
    done
    manifest=$("$PYTHON" -m jaxgpt.parallel.jobset "${k8s_args[@]}" --max-restarts "$max_restarts" \
      "${pod_env[@]+"${pod_env[@]}"}" -- "$@") || exit $?
    if (( dry_run )); then printf '%s\n' "$manifest"; exit 0; fi
    printf '%s\n' "$manifest" | kubectl apply -f -
    ;;
  local)
    [[ "$nlocal" =~ ^[1-9][0-9]{0,2}$ ]] && (( nlocal <= 64 )) ||
      fail "--local needs a process count from 1 to 64 (processes on this machine), got '$nlocal'"
    # One port for every attempt: restarted processes meet where the first ones did, as by hand.
    # A port free now (the kernel's pick, or JAXGPT_PORT), and locked: two jobs on one port would
    # join each other's group (the coordinator's gRPC server listens with SO_REUSEPORT), and two
    # launchers starting together could be handed the same free port before either listens on it.
    if [[ -n "${JAXGPT_PORT:-}" ]]; then
      [[ "$JAXGPT_PORT" =~ ^[1-9][0-9]{0,4}$ ]] && (( JAXGPT_PORT <= 65535 )) ||
        fail "JAXGPT_PORT must be a port number from 1 to 65535, got '$JAXGPT_PORT'"
      claim_port "$JAXGPT_PORT" || fail "port $JAXGPT_PORT (JAXGPT_PORT) is in use on this machine, by another job or program; choose another, or unset JAXGPT_PORT to let the launcher pick a free one"
    else
      port=""
      for _ in 1 2 3 4 5 6 7 8; do claim_port 0 && break; done
      [[ -n "$port" ]] || fail "found no free port on 127.0.0.1 for the coordinator; set JAXGPT_PORT"
    fi
    (( min_processes <= nlocal )) || fail "--min-processes $min_processes is more than --local $nlocal"
    if (( min_processes )); then
      choose_active
      (( ${#active[@]} >= min_processes )) ||
        fail "only ${#active[@]} of $nlocal hosts are up ($launch_dir/down/ marks the others), fewer than --min-processes $min_processes"
    else
      for ((h = 0; h < nlocal; h++)); do active+=("$h"); done
    fi
    pids=()
    trap 'stopping=1; kill "${pids[@]}" 2>/dev/null || true' INT TERM
    run_with_restarts "$port" "$@"
    exit "$status"
    ;;
  slurm)
    command -v srun >/dev/null || fail "--slurm needs srun: run this inside an sbatch or salloc allocation"
    gpu_flags
    if (( min_processes )); then
      [[ -n "${SLURM_JOB_NODELIST:-}" ]] || fail "--min-processes needs SLURM_JOB_NODELIST: run this inside an sbatch or salloc allocation"
      mapfile -t slurm_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
      nlocal=${#slurm_nodes[@]}
      (( min_processes <= nlocal )) || fail "--min-processes $min_processes is more than the allocation's $nlocal nodes"
      choose_active_slurm
      (( ${#active[@]} >= min_processes )) ||
        fail "only ${#active[@]} of the allocation's $nlocal nodes are up, fewer than --min-processes $min_processes"
    elif (( max_restarts == 0 )); then
      if [[ $per_gpu == 1 ]]; then
        exec srun --ntasks-per-node="${SLURM_GPUS_ON_NODE:-8}" --gpus-per-task=1 "$PYTHON" -m jaxgpt.train "$@"
      fi
      exec srun --ntasks-per-node=1 "$PYTHON" -m jaxgpt.train "$@"
    fi
    trap 'forward TERM' TERM; trap 'forward INT' INT
    run_with_restarts "$@"
    exit "$status"
    ;;
  manual)
    for v in COORDINATOR_ADDRESS NUM_PROCESSES PROCESS_ID; do
      [[ -n "${!v:-}" ]] || { echo "error: set $v (or use --local N / --slurm); see --help" >&2; exit 2; }
    done
    gpu_flags
    (( max_restarts > 0 )) || exec "$PYTHON" -m jaxgpt.train "$@"
    trap 'forward TERM' TERM; trap 'forward INT' INT
    run_with_restarts "$@"
    exit "$status"
    ;;
esac
