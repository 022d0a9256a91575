"""The connector's settings: `kvstore.settings.Settings`, the one typed object for every
`kv_connector_extra_config` key and `KVSTRATA_*` variable (docs/configuration.md)."""

from __future__ import annotations

from kvstore.settings import ENV_PREFIX, Settings, parse_bool, parse_bytes

ConnectorSettings = Settings

__all__ = ["ENV_PREFIX", "ConnectorSettings", "Settings", "parse_bool", "parse_bytes"]
