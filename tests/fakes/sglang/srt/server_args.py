"""ServerArgs in the shape of the configured generation (dataclass vs msgspec Struct, field renamed, sealing)."""

from typing import Any

from sglang._fake import server_args_class


def __getattr__(name: str) -> Any:
    if name == "ServerArgs":
        return server_args_class()
    raise AttributeError(name)
