"""I/O: the only module that talks to the API server (server-side apply, get, list, delete).

Calls block (the Kubernetes client is synchronous); callers on an event loop run them in a thread.
API errors leave this module as `KubeError`, sorted by meaning, so nothing above imports the client's
exception types.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from tally_operator import constants as c

Obj = dict[str, Any]
P = ParamSpec("P")
R = TypeVar("R")
DISCOVERY_SECONDS = 30.0  # a kind not served is looked up again at most this often (Kube.has)


class KubeError(Exception):
    """The API server refused or failed a call. `transient`: worth retrying (busy, restarting, a race)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def transient(self) -> bool:
        return self.status in {0, 409, 429} or self.status >= 500

    @property
    def conflict(self) -> bool:
        """A write whose precondition (resourceVersion) no longer held: re-read and try again."""
        return self.status == 409


def _sorted_errors(call: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(call)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return call(*args, **kwargs)
        except ApiException as error:
            raise KubeError(int(error.status or 0), _message(error)) from error
    return wrapper


def _message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except ValueError:
        return str(error.reason)


class Kube:
    def __init__(self, kubeconfig: str | None = None) -> None:
        """In a pod, its ServiceAccount; elsewhere `kubeconfig`, or the default one ($KUBECONFIG)."""
        configuration = client.Configuration()
        if kubeconfig is not None:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException:
                config.load_kube_config(client_configuration=configuration)
        self.api = client.ApiClient(configuration)
        self.dynamic = DynamicClient(self.api)
        self._discovery = threading.Lock()
        self._missing: dict[tuple[str, str], float] = {}  # kinds not served -> when last looked up

    @_sorted_errors
    def has(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves this kind (a CRD installed). A kind not found is looked up again
        (which reads discovery afresh) at most every DISCOVERY_SECONDS, so a CRD installed later is seen."""
        key = (api_version, kind)
        missed = self._missing.get(key)
        if missed is not None and time.monotonic() - missed < DISCOVERY_SECONDS:
            return False
        try:
            self._resource(api_version, kind)
        except ResourceNotFoundError:
            self._missing[key] = time.monotonic()
            return False
        self._missing.pop(key, None)
        return True

    def _resource(self, api_version: str, kind: str) -> Any:
        # One lookup at a time: the client's discovery cache is rebuilt in place on a miss, and a lookup from
        # another thread meanwhile found no Pod kind at all (a pass then failed)
        with self._discovery:
            return self.dynamic.resources.get(api_version=api_version, kind=kind)

    @_sorted_errors
    def apply(self, obj: Obj) -> Obj:
        """Server-side apply under our one field manager; conflicts are forced so manual edits revert."""
        meta = obj["metadata"]
        result = self._resource(obj["apiVersion"], obj["kind"]).server_side_apply(
            body=obj, name=meta["name"], namespace=meta.get("namespace"), field_manager=c.FIELD_MANAGER,
            force_conflicts=True)
        return dict(result.to_dict())

    @_sorted_errors
    def get(self, api_version: str, kind: str, name: str, namespace: str | None) -> Obj | None:
        try:
            return dict(self._resource(api_version, kind).get(name=name, namespace=namespace).to_dict())
        except NotFoundError:
            return None

    @_sorted_errors
    def delete(self, api_version: str, kind: str, name: str, namespace: str, uid: str | None = None) -> bool:
        """Delete; given `uid`, only that very object (a namesake created since is left alone: 409)."""
        body = {"preconditions": {"uid": uid}} if uid else None
        try:
            self._resource(api_version, kind).delete(name=name, namespace=namespace, body=body)
        except NotFoundError:
            return False
        return True

    @_sorted_errors
    def replace_status(self, api_version: str, kind: str, name: str, namespace: str | None, status: Obj,
                       resource_version: str) -> Obj:
        """Write `status` whole (a key it lacks is gone afterwards: a merge patch keeps what it does not name, and
        `{}` deletes nothing), only if the object is still at `resource_version` (compare-and-swap: a 409
        `KubeError` otherwise)."""
        body = {"apiVersion": api_version, "kind": kind,
                "metadata": {"name": name, "resourceVersion": resource_version,
                             **({"namespace": namespace} if namespace is not None else {})},
                "status": status}
        result = self._resource(api_version, kind).status.replace(body=body, name=name, namespace=namespace)
        return dict(result.to_dict())

    @_sorted_errors
    def create(self, obj: Obj) -> Obj:
        """Create `obj` (a 409 `KubeError` if its name is taken)."""
        result = self._resource(obj["apiVersion"], obj["kind"]).create(body=obj,
                                                                       namespace=obj["metadata"].get("namespace"))
        return dict(result.to_dict())

    @_sorted_errors
    def replace(self, obj: Obj) -> Obj:
        """Write `obj` whole, only if it is still at its metadata.resourceVersion (a 409 `KubeError` otherwise)."""
        meta = obj["metadata"]
        result = self._resource(obj["apiVersion"], obj["kind"]).replace(body=obj, name=meta["name"],
                                                                        namespace=meta.get("namespace"))
        return dict(result.to_dict())

    @_sorted_errors
    def annotate(self, api_version: str, kind: str, name: str, namespace: str, annotations: dict[str, str]) -> None:
        self._resource(api_version, kind).patch(body={"metadata": {"annotations": annotations}}, name=name,
                                                namespace=namespace, content_type="application/merge-patch+json")

    @_sorted_errors
    def pods(self, namespace: str, selector: str) -> list[Obj]:
        return self.list("v1", "Pod", namespace, selector)

    @_sorted_errors
    def list(self, api_version: str, kind: str, namespace: str | None, selector: str) -> list[Obj]:
        result = self._resource(api_version, kind).get(namespace=namespace, label_selector=selector)
        return [dict(item) for item in result.to_dict().get("items", [])]
