"""`get_serving()` exists from 0.5.19 on (generation D here); older fakes do not have it."""

from typing import Any

from sglang._fake import current, published_serving


def __getattr__(name: str) -> Any:
    if name == "get_serving" and current().generation == "D":
        return published_serving
    raise AttributeError(name)
