"""The `kvstrata` command (`cli.main:main`): demos, the router service, `inspect`, and the
dispatch of `kvstrata bench` and `kvstrata offload` to the benchmark modules, imported by
name only when they run."""
