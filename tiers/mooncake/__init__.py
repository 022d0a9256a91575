"""The Mooncake Store tier: blocks pooled across hosts in a Mooncake Store (`kind` "mooncake")."""
