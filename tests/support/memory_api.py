"""An API server in memory for the money path's simulation, with the rules the books depend on: objects by kind,
namespace and name, one resourceVersion counter, compare-and-swap on every replace (the object's and the status's),
a status written whole, 409 AlreadyExists on a taken name, etcd's size limit on what it stores (UTF-8 JSON) and the
API server's int64 bound on integers. Every write passes a fault hook first and after: a seeded schedule answers
409 or 500 there, or kills the operator (`Crash`) before or after the write lands.

It implements the calls `tally_operator.kube.Kube` offers that the books make (get, list, create, replace,
replace_status); objects go in and out through JSON, as they do over the wire."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tally_operator.kube import KubeError

ETCD_LIMIT = 1_572_864  # etcd's default --max-request-bytes (1.5 MiB)
CRDS = Path(__file__).resolve().parents[2] / "crds"
INT64 = 2**63 - 1

Obj = dict[str, Any]
Fault = Callable[[str, str, Obj], None]  # (when: "before" | "after", what: "create" | "replace" | "status", obj)


class Crash(BaseException):
    """The operator process dies here (a BaseException: no `except Exception` in the operator catches it)."""


class MemoryApi:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], str] = {}  # (kind, namespace, name) -> the stored JSON
        self.version = 0
        self.fault: Fault | None = None
        self.writes: list[tuple[str, str, str]] = []  # (what, kind, name) of every write that landed

    # -- reads -------------------------------------------------------------------------------------------------

    def get(self, api_version: str, kind: str, name: str, namespace: str | None) -> Obj | None:
        raw = self.objects.get((kind, namespace or "", name))
        return json.loads(raw) if raw is not None else None

    def list(self, api_version: str, kind: str, namespace: str | None, selector: str) -> list[Obj]:
        wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
        out = []
        for (k, ns, _), raw in sorted(self.objects.items()):
            obj = json.loads(raw)
            labels = obj["metadata"].get("labels") or {}
            if k == kind and (namespace is None or ns == namespace) and \
                    all(labels.get(key) == value for key, value in wanted.items()):
                out.append(obj)
        return out

    # -- writes ------------------------------------------------------------------------------------------------

    def create(self, obj: Obj) -> Obj:
        key = self._key(obj)
        self._hook("before", "create", obj)
        if key in self.objects:
            raise KubeError(409, f"{obj['kind']} {key[2]!r} already exists")
        uid = obj["metadata"].get("uid") or f"uid-{self.version + 1}"
        stored = {**obj, "metadata": {**obj["metadata"], "uid": uid}}
        self._store(key, stored)
        self._hook("after", "create", stored)
        return stored

    def replace(self, obj: Obj) -> Obj:
        key = self._key(obj)
        self._hook("before", "replace", obj)
        current = self._current(key, obj["metadata"].get("resourceVersion"))
        stored = {**obj, "metadata": {**obj["metadata"], "uid": current["metadata"]["uid"]}}
        if "status" in current:
            stored["status"] = current["status"]  # the main resource's write never changes the status
        self._store(key, stored)
        self._hook("after", "replace", stored)
        return stored

    def replace_status(self, api_version: str, kind: str, name: str, namespace: str | None, status: Obj,
                       resource_version: str) -> Obj:
        key = (kind, namespace or "", name)
        probe = {"kind": kind, "metadata": {"name": name, "namespace": namespace}, "status": status}
        self._hook("before", "status", probe)
        current = self._current(key, resource_version)
        stored = {**current, "status": json.loads(json.dumps(status))}
        self._store(key, stored)
        self._hook("after", "status", stored)
        return stored

    def touch(self, kind: str, namespace: str, name: str) -> None:
        """Another writer changed the object (a label, an annotation): its resourceVersion moves on."""
        key = (kind, namespace, name)
        self._store(key, json.loads(self.objects[key]))

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, namespace, name), None)

    # -- the rules ---------------------------------------------------------------------------------------------

    def _key(self, obj: Obj) -> tuple[str, str, str]:
        meta = obj["metadata"]
        return obj["kind"], meta.get("namespace") or "", meta["name"]

    def _current(self, key: tuple[str, str, str], resource_version: object) -> Obj:
        raw = self.objects.get(key)
        if raw is None:
            raise KubeError(404, f"{key[0]} {key[2]!r} not found")
        current = json.loads(raw)
        if str(resource_version) != current["metadata"]["resourceVersion"]:
            raise KubeError(409, f"the object has been modified (at {current['metadata']['resourceVersion']}, "
                                 f"not {resource_version})")
        return current

    def _store(self, key: tuple[str, str, str], obj: Obj) -> None:
        check_integers(obj)
        schema = schemas().get(key[0])
        if schema is not None:  # what the CRD does not declare is dropped, as the API server prunes it
            obj = {**obj, **{k: pruned(v, schema["properties"][k]) for k, v in obj.items()
                             if k in schema.get("properties", {}) and k != "metadata"}}
        self.version += 1
        stored = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        raw = json.dumps(stored, ensure_ascii=False, separators=(",", ":"))
        if len(raw.encode(errors="surrogatepass")) > ETCD_LIMIT:
            raise KubeError(500, "etcdserver: request is too large")
        self.objects[key] = raw
        self.writes.append((key[0], key[2], str(self.version)))

    def _hook(self, when: str, what: str, obj: Obj) -> None:
        if self.fault is not None:
            self.fault(when, what, obj)


def check_integers(value: object) -> None:
    """The API server refuses a number past int64 (a float that large is refused in an integer field too)."""
    if isinstance(value, dict):
        for item in value.values():
            check_integers(item)
    elif isinstance(value, list):
        for item in value:
            check_integers(item)
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64:
        raise KubeError(422, f"{value} does not fit an int64")


@functools.cache
def schemas() -> dict[str, dict[str, Any]]:
    """Each of the project's CRDs' structural schema, by kind (its served version's openAPIV3Schema)."""
    out = {}
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        out[crd["spec"]["names"]["kind"]] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return out


def pruned(value: Any, schema: dict[str, Any]) -> Any:
    """`value` as the API server keeps it under a structural schema: fields it does not declare are dropped (unless
    the schema preserves unknown fields); the `gone` of a status reading the CRD lacked was lost this way."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return value
    if isinstance(value, dict):
        if "properties" in schema:
            return {k: pruned(v, schema["properties"][k]) for k, v in value.items() if k in schema["properties"]}
        extra = schema.get("additionalProperties")
        return {k: pruned(v, extra) for k, v in value.items()} if isinstance(extra, dict) else value
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [pruned(v, schema["items"]) for v in value]
    return value
