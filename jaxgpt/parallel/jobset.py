"""A Kubernetes JobSet for a multi-host run: `launch_multihost.sh --k8s` renders it with this module.

`python -m jaxgpt.parallel.jobset --nodes N --gpus-per-node G --pvc CLAIM [--image IMAGE]
[--name NAME] [--max-restarts R] [--env NAME=VALUE ...] -- [train args]` prints one JobSet
(jobset.x-k8s.io/v1alpha2, JobSet v0.6 or newer) as YAML; the launcher pipes it to `kubectl apply`.

What the manifest holds and why:
    - One replicated Job ("workers", 1 replica) of N pods, Indexed: pod i runs
      `python -m jaxgpt.train ARGS` with G GPUs (nvidia.com/gpu), one jaxgpt process per node.
    - spec.coordinator names pod 0, so JobSet annotates every pod with its stable DNS name
      (`NAME-workers-0-0.NAME`, through the headless service JobSet creates). The pod reads it
      through the downward API as JOBSET_COORDINATOR; the Job controller sets JOB_COMPLETION_INDEX
      (the process id); NUM_PROCESSES is N. distributed.py starts jax.distributed from these three,
      without the Kubernetes API (JAX's own k8s detection needs the `kubernetes` package and a
      service account allowed to list pods).
    - Restarts: any pod failure fails the Job (backoffLimit 0) and JobSet recreates every pod, up
      to --max-restarts times (failurePolicy.maxRestarts); the pods resume from the newest
      checkpoint (exit 76, a hang the watchdog ended, is such a failure). As the local launcher does,
      exit 2 (bad input), 3 (diverged) and 77 (too few processes for the global batch) end the JobSet
      (podFailurePolicy FailJob, then failurePolicy rule FailJobSet on reason PodFailurePolicy),
      and exit 75 (a SIGTERM: an eviction or preemption, with a checkpoint saved) only replaces
      the pod (Ignore: not counted). JobSet's restart-attempt annotation becomes
      JAXGPT_RESTART_COUNT, so the restart is in events.jsonl and report.md as locally.
    - The run dir is on the PersistentVolumeClaim CLAIM mounted at /runs (every process writes its
      checkpoint shards there, so it must be ReadWriteMany); --run-dir defaults to /runs/NAME.
      /dev/shm is a memory volume (NCCL's shared buffers; a container's default is 64 MiB). It dies
      with its pod, and JobSet recreates every pod on a restart: `checkpoint.local_dir` there keeps
      no local checkpoint across a restart (a node's hostPath volume would; docs/fault-tolerance.md).
    - Elastic restarts on fewer pods (launch_multihost.sh --min-processes) are not possible: a
      JobSet's replicatedJobs cannot change while it runs (Elastic JobSet is a proposal, JobSet
      issue #463). A lost node leaves its pod Pending until the cluster has room again.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

import yaml

from jaxgpt.cli import ArgumentParser, run_main
from jaxgpt.errors import UserError

API_VERSION = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "workers"
CONTAINER = "jaxgpt"
COORDINATOR_PORT = 55527  # JAX's own k8s default (jax._src.clusters.k8s_cluster); JAX_COORDINATOR_PORT overrides
RUNS_MOUNT = "/runs"
# The pod annotations JobSet sets (jobset.sigs.k8s.io API constants)
COORDINATOR_ANNOTATION = "jobset.sigs.k8s.io/coordinator"
RESTART_ANNOTATION = "jobset.sigs.k8s.io/restart-attempt"
NO_RESTART_CODES = [2, 3, 77]  # bad input, diverged, too few processes: they would fail again (cli.py's exit codes)
PREEMPTED_CODE = 75
# The coordinator label value `NAME-workers-0-0.NAME` must fit a label's 63 characters.
MAX_NAME = (63 - len(f"-{REPLICATED_JOB}-0-0.")) // 2
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _field(annotation: str) -> dict:
    return {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{annotation}']"}}}


def _exit_rule(action: str, codes: list[int]) -> dict:
    return {"action": action, "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": codes}}


def manifest(*, nodes: int, gpus_per_node: int, image: str, pvc: str, name: str = "jaxgpt",
             max_restarts: int = 0, train_args: Sequence[str] = (), env: Sequence[tuple[str, str]] = ()) -> dict:
    """The JobSet as a dict (see the module docstring); arguments are checked by `check`."""
    args = list(train_args)
    if not any(a == "--run-dir" or a.startswith("--run-dir=") for a in args):
        args += ["--run-dir", f"{RUNS_MOUNT}/{name}"]
    container_env = [
        {"name": "JOBSET_COORDINATOR", **_field(COORDINATOR_ANNOTATION)},
        {"name": "NUM_PROCESSES", "value": str(nodes)},
        {"name": "JAXGPT_RESTART_COUNT", **_field(RESTART_ANNOTATION)},
        {"name": "JAXGPT_MAX_RESTARTS", "value": str(max_restarts)},
        {"name": "JAXGPT_RESTART_REASON", "value": "a pod of the JobSet failed; JobSet recreated every pod"},
        *({"name": k, "value": v} for k, v in env),
    ]
    container = {
        "name": CONTAINER, "image": image,
        "command": ["python", "-m", "jaxgpt.train"], "args": args, "env": container_env,
        "ports": [{"name": "coordinator", "containerPort": COORDINATOR_PORT}],
        "resources": {"limits": {"nvidia.com/gpu": gpus_per_node}},
        "volumeMounts": [{"name": "runs", "mountPath": RUNS_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    job = {
        "parallelism": nodes, "completions": nodes, "completionMode": "Indexed", "backoffLimit": 0,
        "podFailurePolicy": {"rules": [_exit_rule("FailJob", NO_RESTART_CODES), _exit_rule("Ignore", [PREEMPTED_CODE])]},
        "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [container],
            "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": pvc}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        }},
    }
    return {
        "apiVersion": API_VERSION, "kind": "JobSet",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "jaxgpt"}},
        "spec": {
            "coordinator": {"replicatedJob": REPLICATED_JOB, "jobIndex": 0, "podIndex": 0},
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": max_restarts, "rules": [
                {"name": "badInputOrDiverged", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
        },
    }


def check(nodes: int, gpus_per_node: int, name: str, pvc: str, image: str, max_restarts: int) -> None:
    """A UserError naming the first bad argument."""
    if not 1 <= nodes <= 4096:
        raise UserError(f"--nodes needs a count from 1 to 4096, got {nodes}")
    if not 1 <= gpus_per_node <= 64:
        raise UserError(f"--gpus-per-node needs a count from 1 to 64, got {gpus_per_node}")
    if not (len(name) <= MAX_NAME and _NAME.fullmatch(name)):
        raise UserError(f"--name {name!r} must be lower-case letters, digits and '-', start with a letter and "
                        f"be at most {MAX_NAME} characters (JobSet's coordinator label holds it twice)")
    if not (len(pvc) <= 253 and re.fullmatch(r"[a-z0-9]([-.a-z0-9]*[a-z0-9])?", pvc)):
        raise UserError(f"--pvc {pvc!r} is not a PersistentVolumeClaim name (lower-case letters, digits, '-', '.')")
    if not image.strip() or any(c.isspace() for c in image):
        raise UserError(f"--image {image!r} must be an image reference without spaces")
    if max_restarts < 0:
        raise UserError(f"--max-restarts needs a count (0 or more), got {max_restarts}")


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not _ENV_NAME.fullmatch(key):
        raise UserError(f"--env {text[:40]!r} must be NAME=VALUE")
    return key, value


def main_args(argv: Sequence[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    parser = ArgumentParser(prog="python -m jaxgpt.parallel.jobset",
                            description="Print a Kubernetes JobSet that runs python -m jaxgpt.train on N pods x G GPUs.")
    parser.add_argument("--nodes", type=int, required=True, help="pods (one jaxgpt process each)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="nvidia.com/gpu per pod (default 8)")
    parser.add_argument("--pvc", required=True, help="a ReadWriteMany PersistentVolumeClaim, mounted at /runs")
    parser.add_argument("--image", default="jaxgpt:latest", help="an image with jaxgpt installed (default jaxgpt:latest)")
    parser.add_argument("--name", default="jaxgpt", help="the JobSet's name (default jaxgpt)")
    parser.add_argument("--max-restarts", type=int, default=0, help="JobSet restarts of the whole group")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every pod (repeatable)")
    args = parser.parse_args(ours)
    check(args.nodes, args.gpus_per_node, args.name, args.pvc, args.image, args.max_restarts)
    env = [_env_pair(e) for e in args.env]
    doc = manifest(nodes=args.nodes, gpus_per_node=args.gpus_per_node, image=args.image, pvc=args.pvc,
                   name=args.name, max_restarts=args.max_restarts, train_args=train_args, env=env)
    sys.stdout.write(yaml.safe_dump(doc, sort_keys=False))


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(main_args, argv)


if __name__ == "__main__":
    sys.exit(main())
