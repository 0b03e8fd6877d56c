"""`launch_multihost.sh --k8s`: the JobSet it renders, checked against JobSet's own API schema offline.

tests/data/jobset_v1alpha2_schema.json is cut from the JobSet CRD's openAPIV3Schema by
scripts/jobset_schema_excerpt.py. `schema_errors` applies it as the API server's structural
validation does for these fields: types, formats of integers, enums, required fields, and no unknown
field (kubectl apply's default strict field validation). The CRD's CEL rules are not evaluated.
The pods' side of the contract (the environment they get starting jax.distributed) is tested with
real processes in test_multihost.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from helpers import REPO

SCHEMA = json.loads((REPO / "tests" / "data" / "jobset_v1alpha2_schema.json").read_text())["schema"]
TYPES = {"string": str, "integer": int, "boolean": bool, "object": dict, "array": list}


def schema_errors(schema: dict, value, path: str = "JobSet") -> list[str]:
    """Where `value` breaks `schema` (an openAPIV3Schema node), one message per problem."""
    if "anyOf" in schema:
        if all(schema_errors(s, value, path) for s in schema["anyOf"]):
            return [f"{path}: {value!r} matches none of {[s.get('type') for s in schema['anyOf']]}"]
        return []
    kind = schema.get("type")
    if kind and not (isinstance(value, TYPES[kind]) and not (kind == "integer" and isinstance(value, bool))):
        return [f"{path}: {type(value).__name__} where the schema has {kind}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if schema.get("format") == "int32" and not -2**31 <= value < 2**31:
        errors.append(f"{path}: {value} does not fit int32")
    if isinstance(value, dict):
        errors += [f"{path}: {k} is required" for k in schema.get("required", []) if k not in value]
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for k, v in value.items():
            if props is not None and k in props:
                errors += schema_errors(props[k], v, f"{path}.{k}")
            elif isinstance(extra, dict):
                errors += schema_errors(extra, v, f"{path}.{k}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{path}: unknown field {k}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def launch_k8s(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHON=sys.executable, **({"PATH": path} if path is not None else {}))
    return subprocess.run([shutil.which("bash"), str(REPO / "launch_multihost.sh"), "--k8s", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def render(*args: str) -> dict:
    proc = launch_k8s("--dry-run", *args)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return yaml.safe_load(proc.stdout)


def pod_spec(doc: dict) -> tuple[dict, dict]:
    """(the Job spec, the pod spec) of the JobSet's one replicated Job."""
    [rjob] = doc["spec"]["replicatedJobs"]
    return rjob["template"]["spec"], rjob["template"]["spec"]["template"]["spec"]


def test_the_manifest_is_a_valid_jobset_with_n_pods_of_g_gpus():
    doc = render("--nodes", "4", "--gpus-per-node", "8", "--pvc", "team-runs", "--image", "reg.example/jaxgpt:1",
                 "--name", "llama", "--max-restarts", "3", "--", "--config", "gpt2-124m", "--mesh", "dp=4,fsdp=8")
    assert schema_errors(SCHEMA, doc) == []
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    job, pod = pod_spec(doc)
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
    [container] = pod["containers"]
    assert container["image"] == "reg.example/jaxgpt:1" and container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["command"] + container["args"] == ["python", "-m", "jaxgpt.train", "--config", "gpt2-124m",
                                                        "--mesh", "dp=4,fsdp=8", "--run-dir", "/runs/llama"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NUM_PROCESSES"]["value"] == "4" and env["JAXGPT_MAX_RESTARTS"]["value"] == "3"
    assert (env["JOBSET_COORDINATOR"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.annotations['jobset.sigs.k8s.io/coordinator']")
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"]["value"]  # the launcher's GPU flags
    assert doc["spec"]["coordinator"] == {"replicatedJob": "workers", "jobIndex": 0, "podIndex": 0}
    assert doc["spec"]["failurePolicy"]["maxRestarts"] == 3
    [runs] = [v for v in pod["volumes"] if v["name"] == "runs"]
    assert runs["persistentVolumeClaim"]["claimName"] == "team-runs"
    assert {"name": "runs", "mountPath": "/runs"} in container["volumeMounts"]
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] == 0  # a pod failure restarts the whole JobSet
    rules = {r["action"]: r["onExitCodes"]["values"] for r in job["podFailurePolicy"]["rules"]}
    assert rules == {"FailJob": [2, 3, 77], "Ignore": [75]}


def test_a_given_run_dir_is_kept_and_the_defaults_validate():
    doc = render("--nodes", "1", "--pvc", "runs", "--", "--run-dir", "/runs/mine")
    assert schema_errors(SCHEMA, doc) == []
    [container] = pod_spec(doc)[1]["containers"]
    assert container["args"] == ["--run-dir", "/runs/mine"] and container["image"] == "jaxgpt:latest"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_the_schema_check_finds_what_the_api_server_would_refuse():
    doc = render("--nodes", "2", "--pvc", "runs")
    job, pod = pod_spec(doc)
    job["parallelism"] = "2"                      # a string for an integer
    job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] = [2**40]  # beyond int32
    pod["containers"][0]["gpus"] = 8              # no such field
    del doc["spec"]["coordinator"]["replicatedJob"]  # required
    doc["spec"]["failurePolicy"]["rules"][0]["action"] = "Retry"  # not in the enum
    errors = schema_errors(SCHEMA, doc)
    assert len(errors) == 5, errors
    for says in ("parallelism: str where the schema has integer", "does not fit int32", "unknown field gpus",
                 "coordinator: replicatedJob is required", "'Retry' is not one of"):
        assert any(says in e for e in errors), (says, errors)


@pytest.mark.parametrize("args, says", [
    (["--nodes", "2", "--dry-run"], "the following arguments are required: --pvc"),
    (["--nodes", "0", "--pvc", "runs", "--dry-run"], "--nodes needs a count from 1 to 4096"),
    (["--nodes", "2", "--pvc", "runs", "--name", "Big_Run", "--dry-run"], "--name 'Big_Run' must be lower-case"),
    (["--nodes", "2", "--pvc", "runs", "--per-gpu", "--dry-run"], "--per-gpu is not for --k8s"),
    (["--nodes", "2", "--pvc", "runs"], "--k8s needs kubectl"),  # PATH without kubectl
])
def test_k8s_arguments_are_checked_in_one_line(tmp_path, args, says):
    proc = launch_k8s(*args, path=str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and says in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and not proc.stdout


def test_k8s_options_need_k8s():
    proc = subprocess.run(["bash", "launch_multihost.sh", "--local", "2", "--nodes", "2", "--"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "are options of --k8s" in proc.stderr and proc.stderr.count("\n") == 1
