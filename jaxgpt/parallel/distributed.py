"""Several processes, one program: when and how `jax.distributed` starts, and the device order.

A multi-host run is one jaxgpt process per host (or per GPU), all running the same command. They
find each other through a coordinator (process 0's address) and then see one global list of
devices; the mesh, the shardings and the jitted step are the same as on one host, and XLA moves
data between hosts where the layout needs it.

When jaxgpt initialises `jax.distributed` (and only then):
    - COORDINATOR_ADDRESS, NUM_PROCESSES and PROCESS_ID are set (by `launch_multihost.sh` or by
      hand; LOCAL_DEVICE_IDS optionally restricts a process to some local GPUs), or
    - the job runs under SLURM with more than one task (JAX reads the SLURM variables itself), or
    - the process is a pod of the JobSet `launch_multihost.sh --k8s` renders (parallel/jobset.py):
      JOBSET_COORDINATOR (pod 0's DNS name, from JobSet's coordinator annotation), NUM_PROCESSES
      and JOB_COMPLETION_INDEX (set by Kubernetes' Job controller in every pod of an Indexed Job)
      give the coordinator `JOBSET_COORDINATOR:55527` (JAX_COORDINATOR_PORT overrides the port, as
      in JAX's own k8s support), the process count and this process's id. JAX's own Kubernetes
      detection is not used: it asks the Kubernetes API (the `kubernetes` package and a service
      account allowed to list pods) for what these variables already say, so it is switched off.
A single process with none of these never touches `jax.distributed`.

Processes on CPU (the local test mode) exchange collectives through gloo over TCP.

No persistent compilation cache on CPU with collectives (`cpu_without_compilation_cache`): in jax
0.12 an XLA:CPU executable read back from JAX_COMPILATION_CACHE_DIR does not keep the order of its
collectives. Devices of one process then wait in different collectives until XLA's 40-second
rendezvous timeout aborts the process ("Termination timeout for `all gather ...`"), and processes
of a group where one read the step from the cache (only process 0 writes it) and another compiled
it abort in gloo ("Received data size doesn't match expected size") or hang. Measured at this
module's commit on a 2-core AMD EPYC: a tiny dp=2,fsdp=4 run from a warm cache aborted 3 times in
4 on one process and failed 2 times in 2 on two; with the cache off, none did.

Failure: every process sends heartbeats to the coordinator; if one stops (it crashed or its host
died), the coordination service declares it dead after JAXGPT_HEARTBEAT_TIMEOUT seconds (default
60) and the remaining processes are terminated with an error instead of hanging in a collective.

Restarts: `launch_multihost.sh --max-restarts R` starts the whole group again after a failure and
tells the new processes so through JAXGPT_RESTART_COUNT (1, 2, ...), JAXGPT_MAX_RESTARTS and
JAXGPT_RESTART_REASON ("process 1 exited with code 137 (killed by SIGKILL)"); `restart_info`
reads them, and train.py records a `restart` event before the session's `start`.

Device order and the mesh: devices are ordered by (process, local id) before being reshaped into
(dp, fsdp, ep, tp), so tp, the fastest-varying axis, takes neighbouring devices of one process,
then ep (whose all-to-alls also run in every MoE layer), while dp and fsdp step across processes. Tensor parallelism, which talks inside every layer, thus stays
on one host's fast links (NVLink), and the slower network between hosts carries only the dp/fsdp
traffic. `mesh_layout_error` refuses a tp that would span processes unless the user insists.
"""

from __future__ import annotations

import os

import jax

from jaxgpt.errors import UserError

_ENV = ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID")
_JOBSET_ENV = ("JOBSET_COORDINATOR", "JOB_COMPLETION_INDEX")
JOBSET_PORT = 55527  # JAX's own k8s default coordinator port (jax._src.clusters.k8s_cluster)


def env_int(name: str, default: int, low: int = 0) -> int:
    """The integer in environment variable `name` (default when unset or empty); a UserError naming
    the variable for anything else or a value below `low`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text, 10)
    except ValueError:
        value = None
    if value is None or value < low:
        raise UserError(f"environment variable {name}={text[:40]!r} must be an integer >= {low}")
    return value


def wanted() -> bool:
    """Whether the environment describes a multi-process job."""
    if all(os.environ.get(k) for k in _ENV):
        return env_int("NUM_PROCESSES", 1, low=1) > 1
    if _in_jobset():
        return _jobset_kwargs()["num_processes"] > 1
    return env_int("SLURM_NTASKS", 1, low=1) > 1 and "SLURM_JOB_ID" in os.environ


def _in_jobset() -> bool:
    return all(os.environ.get(k) for k in _JOBSET_ENV) and not os.environ.get("COORDINATOR_ADDRESS")


def _jobset_kwargs() -> dict:
    """jax.distributed.initialize's arguments in a JobSet pod (see the module docstring)."""
    if not os.environ.get("NUM_PROCESSES"):
        raise UserError("JOBSET_COORDINATOR and JOB_COMPLETION_INDEX are set (a JobSet pod) but NUM_PROCESSES is not: "
                        "set it to the JobSet's pod count (launch_multihost.sh --k8s does)")
    n, rank = env_int("NUM_PROCESSES", 1, low=1), env_int("JOB_COMPLETION_INDEX", 0)
    if rank >= n:
        raise UserError(f"JOB_COMPLETION_INDEX={rank} must be below NUM_PROCESSES={n}")
    port = env_int("JAX_COORDINATOR_PORT", JOBSET_PORT, low=1)
    return dict(coordinator_address=f"{os.environ['JOBSET_COORDINATOR'].strip()}:{port}", num_processes=n,
                process_id=rank, cluster_detection_method="deactivate")


joined = False  # this process is one of several whose jax.distributed started (cli.py's peer-loss line)


def initialize() -> None:
    """Starts `jax.distributed` when the environment asks for several processes; else does nothing."""
    global joined
    if not wanted() or jax.distributed.is_initialized():
        return
    timeout = env_int("JAXGPT_HEARTBEAT_TIMEOUT", 60, low=1)
    init_timeout = env_int("JAXGPT_INIT_TIMEOUT", 300, low=1)
    kwargs = {}
    if all(os.environ.get(k) for k in _ENV):
        n, rank = env_int("NUM_PROCESSES", 1, low=1), env_int("PROCESS_ID", 0)
        if rank >= n:
            raise UserError(f"PROCESS_ID={rank} must be below NUM_PROCESSES={n}")
        kwargs = dict(coordinator_address=os.environ["COORDINATOR_ADDRESS"], num_processes=n, process_id=rank)
        if os.environ.get("LOCAL_DEVICE_IDS"):
            ids = os.environ["LOCAL_DEVICE_IDS"].split(",")
            if not all(i.strip().isdigit() for i in ids):
                raise UserError(f"LOCAL_DEVICE_IDS={os.environ['LOCAL_DEVICE_IDS'][:40]!r} must be device numbers "
                                f"separated by commas, e.g. 0,1")
            kwargs["local_device_ids"] = [int(i) for i in ids]
    elif _in_jobset():
        kwargs = _jobset_kwargs()
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=timeout, initialization_timeout=init_timeout)
    joined = True


def cpu_without_compilation_cache(devices: list[jax.Device]) -> bool:
    """Turns JAX's persistent compilation cache off for a CPU run on more than one device (module
    docstring); True if it was on. Before the first compile: JAX decides once per process."""
    if devices[0].platform != "cpu" or len(devices) < 2 or not jax.config.jax_compilation_cache_dir:
        return False
    jax.config.update("jax_enable_compilation_cache", False)
    return True


def restart_info() -> dict | None:
    """{restart, max_restarts, reason} when the launcher restarted this group, else None."""
    count = env_int("JAXGPT_RESTART_COUNT", 0)
    if count <= 0:
        return None
    return {"restart": count, "max_restarts": env_int("JAXGPT_MAX_RESTARTS", 0),
            "reason": os.environ.get("JAXGPT_RESTART_REASON", "")}


def ordered_devices() -> list[jax.Device]:
    """All devices, process by process: the order the mesh is cut from (see the module docstring)."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def data_block(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """(index, count): which block of a global batch laid out by `sharding` this process loads, out
    of how many distinct blocks. Processes whose devices hold the same rows (pp spanning hosts:
    every stage embeds its data shard's rows) load the same block; otherwise each its own."""
    rows: dict[int, tuple[int, int]] = {}
    for device, index in sharding.devices_indices_map(global_shape).items():
        start, stop, _ = index[0].indices(global_shape[0])
        lo, hi = rows.get(device.process_index, (start, stop))
        rows[device.process_index] = (min(lo, start), max(hi, stop))
    blocks = sorted(set(rows.values()))
    sizes = {hi - lo for lo, hi in blocks}
    if len(sizes) != 1 or any(b[1] != c[0] for b, c in zip(blocks, blocks[1:])):
        raise UserError(f"this mesh gives the processes uneven or overlapping rows of each batch ({rows}); "
                        f"choose axis sizes so that each process holds whole data shards")
    return blocks.index(rows[jax.process_index()]), len(blocks)


def mesh_layout_error(tp: int, allow_tp_across_hosts: bool) -> str | None:
    """Why this tp would span processes, or None if it stays within each one."""
    local = jax.local_device_count()
    if jax.process_count() == 1 or allow_tp_across_hosts or local % tp == 0:
        return None
    return (f"tp={tp} does not divide the {local} devices of each process, so tensor parallelism would "
            f"cross hosts on every layer; choose a tp that divides {local} or set mesh.allow_tp_across_hosts=true")
