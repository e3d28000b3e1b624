"""Fail fast when the Hugging Face hub cannot be reached: one connection attempt, not retries.

Offline, timm's and transformers' pretrained paths retry each file with back-off (about 50 s
before the error, measured). :func:`offline_unless_reachable` opens one TCP connection to the
hub's endpoint (3 s at most); if that fails, the block runs in huggingface_hub's offline mode, so
weights already in the local cache still load and missing ones fail at once with the library's
"not in the local cache" error, which dpzoo turns into its one-line message.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from typing import Iterator
from urllib.parse import urlparse

__all__ = ["hub_reachable", "offline_unless_reachable"]

PROBE_TIMEOUT_S = 3.0


def hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub endpoint (``HF_ENDPOINT``) opens within ``timeout``."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout).close()
    except OSError:
        return False
    return True


@contextmanager
def offline_unless_reachable() -> Iterator[bool]:
    """Run the block in huggingface_hub's offline mode when the hub cannot be reached; yields
    whether it is online. Offline mode set by the user (``HF_HUB_OFFLINE=1``) is left as is."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or hub_reachable():
        yield not constants.HF_HUB_OFFLINE
        return
    constants.HF_HUB_OFFLINE = True
    try:
        yield False
    finally:
        constants.HF_HUB_OFFLINE = False
