"""What an inference engine imports to use drafter: the clients (sync and asyncio), the pre-speculated source for
engines that verify trees, and the DraftSource protocol.

Importing this package imports neither torch nor gRPC; the clients load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine_client.draft_source import EMPTY_TREE, DraftSource, DraftTree, NoDrafts

__all__ = ["DrafterClient", "AsyncDrafterClient", "ClientStats", "ClientSecurity", "DrafterRequestError",
           "DrafterUnavailable", "DraftSource", "NoDrafts", "DraftTree", "EMPTY_TREE", "PreSpeculatedSource"]

_LAZY = {"DrafterClient": "engine_client.client", "AsyncDrafterClient": "engine_client.async_client",
         "ClientStats": "engine_client.client_common", "DrafterRequestError": "engine_client.client_common",
         "DrafterUnavailable": "engine_client.client_common", "ClientSecurity": "engine_client.security",
         "PreSpeculatedSource": "engine_client.prespeculated_source"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine_client' has no attribute {name!r}")
