"""I/O: the only module that talks to the API server (server-side apply, get, list, delete, status)."""

from __future__ import annotations

from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError

from tally_operator import constants as c

Obj = dict[str, Any]


class Kube:
    def __init__(self) -> None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.api = client.ApiClient()
        self.dynamic = DynamicClient(self.api)

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def apply(self, obj: Obj) -> Obj:
        """Server-side apply under our one field manager; conflicts are forced so manual edits revert."""
        meta = obj["metadata"]
        result = self._resource(obj["apiVersion"], obj["kind"]).server_side_apply(
            body=obj, name=meta["name"], namespace=meta.get("namespace"), field_manager=c.FIELD_MANAGER,
            force_conflicts=True)
        return dict(result.to_dict())

    def get(self, api_version: str, kind: str, name: str, namespace: str) -> Obj | None:
        try:
            return dict(self._resource(api_version, kind).get(name=name, namespace=namespace).to_dict())
        except NotFoundError:
            return None

    def delete(self, api_version: str, kind: str, name: str, namespace: str) -> bool:
        try:
            self._resource(api_version, kind).delete(name=name, namespace=namespace)
        except NotFoundError:
            return False
        return True

    def pods(self, namespace: str, selector: str) -> list[Obj]:
        result = self._resource("v1", "Pod").get(namespace=namespace, label_selector=selector)
        return [dict(item) for item in result.to_dict().get("items", [])]


def is_transient(error: ApiException) -> bool:
    """Worth retrying: the server is busy or restarting, or we raced another writer."""
    return error.status in {409, 429} or error.status >= 500 or error.status == 0
