"""Derive the JSON schemas kept here from the Kubeflow CRDs (run by hand when they change).

    python derive.py PYTORCHJOBS_CRD.yaml SOURCE pytorchjob.schema.json
    python derive.py TRAINJOBS_CRD.yaml SOURCE trainjob.schema.json

A CRD's openAPIV3Schema is a JSON schema with Kubernetes extensions. The API server prunes
(or, with strict validation, rejects) fields a structural schema does not list; here every
object that lists its properties and allows no other keys gets `additionalProperties:
false`, so a misspelled field fails offline as it would on the cluster. Descriptions are
dropped to keep the files small; SOURCE (repository, path, commit) is recorded in them.
"""

from __future__ import annotations

import json
import sys

import yaml


def close(node):
    if isinstance(node, dict):
        node.pop("description", None)
        for value in node.values():
            close(value)
        if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for value in node:
            close(value)
    return node


def main(crd_path: str, source: str, out_path: str) -> None:
    crd = yaml.safe_load(open(crd_path))
    version = crd["spec"]["versions"][0]
    schema = close(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: left to the API server
    schema = {"$comment": f"derived by derive.py from {source} ({crd['spec']['names']['kind']} "
                          f"{crd['spec']['group']}/{version['name']})", **schema}
    with open(out_path, "w") as out:
        json.dump(schema, out, separators=(",", ":"), sort_keys=True)
        out.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
