"""Cut tests/data/jobset_v1alpha2_schema.json from JobSet's CRD: the schema of the fields we render.

    python scripts/jobset_schema_excerpt.py PATH/TO/jobset.x-k8s.io_jobsets.yaml [COMMIT]

The CRD (kubernetes-sigs/jobset, config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml) is
800 kB, mostly Kubernetes' own PodSpec. The excerpt keeps the v1alpha2 openAPIV3Schema nodes on the
paths that `jaxgpt.parallel.jobset.manifest` renders (with every option set), each with its type,
format, enum, required list and int-or-string marker, and drops the descriptions and every other
field. A rendered field the CRD does not have stops this script, so the excerpt cannot vouch for a
field the API server would reject; tests/test_jobset.py validates manifests against the excerpt,
and a field added to the manifest later fails there until the excerpt is cut again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from jaxgpt.parallel.jobset import manifest

KEEP = ("type", "format", "enum", "required", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields")
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "jobset_v1alpha2_schema.json"


def prune(schema: dict, value, path: str) -> dict:
    """The parts of `schema` that `value` (a rendered manifest's node) uses."""
    out = {k: schema[k] for k in KEEP if k in schema}
    if "anyOf" in schema:
        out["anyOf"] = [{k: s[k] for k in KEEP if k in s} for s in schema["anyOf"]]
    if isinstance(value, dict) and "properties" in schema:
        missing = sorted(set(value) - set(schema["properties"]))
        if missing:
            sys.exit(f"error: {path} has {missing}, which JobSet's CRD does not")
        out["properties"] = {k: prune(schema["properties"][k], v, f"{path}.{k}") for k, v in sorted(value.items())}
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        extra = schema["additionalProperties"]
        out["additionalProperties"] = {k: extra[k] for k in KEEP if k in extra}
        if "anyOf" in extra:
            out["additionalProperties"]["anyOf"] = [{k: s[k] for k in KEEP if k in s} for s in extra["anyOf"]]
    elif isinstance(value, list) and "items" in schema:
        merged: dict = {}
        for i, item in enumerate(value):  # the union of the fields the items use
            for k, v in prune(schema["items"], item, f"{path}[{i}]").items():
                if k == "properties":
                    merged.setdefault("properties", {}).update(v)
                else:
                    merged[k] = v
        out["items"] = merged
    return out


def main() -> None:
    crd = yaml.safe_load(Path(sys.argv[1]).read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    full = manifest(nodes=2, gpus_per_node=8, image="jaxgpt:latest", pvc="runs", name="jaxgpt", max_restarts=1,
                    train_args=["--config", "gpt2-124m"], env=[("XLA_FLAGS", "--x=1")])
    excerpt = {
        "source": "kubernetes-sigs/jobset config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"
                  + (f" at {sys.argv[2]}" if len(sys.argv) > 2 else ""),
        "cut_by": "scripts/jobset_schema_excerpt.py (descriptions and unrendered fields dropped)",
        "schema": prune(version["schema"]["openAPIV3Schema"], full, "JobSet"),
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(excerpt, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
