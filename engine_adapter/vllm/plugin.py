"""vLLM plugin: registers the connector by name, so that
`--kv-transfer-config '{"kv_connector": "KVStrataConnector", "kv_role": "kv_both"}'` needs no
module path.

kvstrata's package metadata names `register` in vLLM's `vllm.general_plugins` entry-point
group (pyproject.toml); vLLM calls it in each of its processes (front end, engine core,
workers) before it builds a connector. The class is imported only when vLLM first asks for it.
"""

from __future__ import annotations

import contextlib

NAME = "KVStrataConnector"
MODULE = "engine_adapter.vllm.connector"
CLASS = "TierKVConnector"


def register() -> None:
    """Register `KVStrataConnector` with vLLM's `KVConnectorFactory` (once per process; a
    second call changes nothing)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # ValueError is the factory's "already registered": vLLM loaded the plugin twice here.
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(NAME, MODULE, CLASS)
