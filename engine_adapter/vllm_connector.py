"""Compatibility: `kv_connector_module_path="engine_adapter.vllm_connector"` keeps working;
the connector lives in `engine_adapter.vllm`."""

from engine_adapter.vllm.connector import KVStrataConnector, TierConnectorMetadata, TierKVConnector

__all__ = ["KVStrataConnector", "TierConnectorMetadata", "TierKVConnector"]
