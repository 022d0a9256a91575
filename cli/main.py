"""The `kvstrata` command: demos, the router, the offload experiment and benchmarks (Click).

Each command lives in its own module and is imported only when it runs (so `--help` and
shell completion stay fast). The benchmarks and the offload experiment are modules of the
`bench` package, named here by string: `cli` never imports `bench` until one of them runs.
Shell completion: `eval "$(_KVSTRATA_COMPLETE=bash_source kvstrata)"` (bash; `zsh_source`,
`fish_source` for the others). A user mistake ends with one
line naming the bad value and exit code 2.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from cli.args import CONTEXT, CommandFailed, check_environment, fail, invoke
from kvstore.errors import KVStoreError

BENCHMARKS = {
    "hashing": "bench.hashing",
    "tiers": "bench.tiers",
    "demotion": "bench.demotion",
    "transfer": "bench.transfer",
    "trace": "bench.trace",
    "micro": "bench.micro",
    "scale": "bench.scale",
    "scale-disk": "bench.scale_disk",
    "procs": "bench.scale_procs",
    "remote": "bench.remote",
    "mooncake": "bench.mooncake_tier",
    "shared-tiers": "bench.shared_tiers",
    "router": "bench.router",
    "vllm": "bench.vllm_longdoc",  # run with .venv-vllm's Python (see docs/vllm.md)
    "workload": "bench.workload",
    "load-policy": "bench.load_policy",
    "codec-fidelity": "bench.codec_fidelity",
    "codecs": "bench.codec_speed",
    "codec-link": "bench.codec_link",
    "codec-vllm": "bench.codec_vllm",  # run with .venv-vllm's Python
    "vllm-overhead": "bench.vllm_overhead",  # run with .venv-vllm's Python
    "peer": "bench.peer",
    "soak": "bench.soak",
    "hints": "bench.hints",
    "prefetch": "bench.prefetch",
}
COMMANDS = {
    "demo": "cli.demo",
    "demo-store": "cli.demo_store",
    "demo-remote": "cli.demo_remote",
    "demo-fleet": "cli.demo_fleet",
    "router": "cli.router_cmd",
    "offload": "bench.offload",
    "inspect": "cli.inspect",
}
_COMMAND_SUMMARIES = {
    "demo": "The main demo: a document's KV from pool, CPU, disk and after a restart.",
    "demo-store": "One long context through the CPU and disk tiers and back, bit-exact.",
    "demo-remote": "Two processes share a document's KV through a Valkey/Redis remote tier.",
    "demo-fleet": "Engine processes behind the router against round-robin placement.",
    "router": "The KV-aware routing service (POST /lookup).",
    "offload": "Long-document QA: time to first token per tier against recompute.",
    "inspect": "What a disk tier holds, per namespace (read-only).",
    "bench": "Benchmarks; each compares against a baseline measured in the same run.",
}
_BENCH_SUMMARIES = {
    "hashing": "Block hashing against vLLM's chain.",
    "tiers": "Tier bandwidth against memcpy and raw file I/O.",
    "demotion": "Pool demotion policy: copy on evict vs write-through.",
    "transfer": "Pool <-> CPU transfers against plain copies.",
    "trace": "Mooncake traces through the tiers: hit ratios.",
    "micro": "hashing + lookup cost + tiers + transfer.",
    "scale": "Lookup/store cost and index bytes from 10^3 to 10^6 blocks.",
    "scale-disk": "The disk tier from 10^5 to 10^7 blocks: per-block costs, open time, index bytes.",
    "procs": "1-8 processes on one disk tier or redis-server against raw file I/O and redis-py.",
    "remote": "The remote tier against a raw client on the same server.",
    "mooncake": "The Mooncake tier against Mooncake's raw client on the same master (own master).",
    "shared-tiers": "Shared tiers (a shared directory, a server) against raw clients of the same bytes.",
    "router": "Router index memory and lookup latency at 10^6 blocks x 8 instances.",
    "vllm": "Long-document QA through vLLM with and without the connector.",
    "workload": "The field's synthetic workloads through the reference runner.",
    "load-policy": "Load or recompute: TTFT under load_policy auto/always/never, slow disk.",
    "codec-fidelity": "Codecs: the first token after a lossy hit against the exact hit (reference runner).",
    "codec-vllm": "Codecs in real vLLM: the first token after a kvstrata hit against vLLM's own hit.",
    "codecs": "Codecs: bytes per block, encode/decode speed, disk and remote GB/s decoded, against raw.",
    "codec-link": "The remote tier behind a rate-capped link: int8 against raw blocks, and the load policy.",
    "vllm-overhead": "The connector in real vLLM: throughput with no reuse, TTFT with reuse.",
    "peer": "The disk and remote tiers against LMCache's local disk and resp:// on the same bytes.",
    "soak": "Many clients on every tier while faults land at random; every hit checked bit-exact.",
    "hints": "Sessions under a flood: retain hints against LRU and Belady on the same replay.",
    "prefetch": "A request's retrieve after a prefetch against straight from the disk tier.",
}


_RESOLVED = "kvstrata.resolved"  # ctx.meta key: the command a group resolved


class LazyGroup(click.Group):
    """A group whose commands are `command` objects of modules imported on first use."""

    def __init__(self, *args: Any, modules: dict[str, str], summaries: dict[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.modules, self.summaries = modules, summaries

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*self.modules, *super().list_commands(ctx)]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.modules:
            command: click.Command = importlib.import_module(self.modules[name]).command
            return command
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the chosen command; a bad value it meets (`KVStoreError`, `OSError`) is reported
        as that command's, e.g. `kvstrata demo-remote: error: ...`."""
        try:
            return super().invoke(ctx)
        except (KVStoreError, OSError) as exc:
            name = ctx.meta.get(f"{_RESOLVED}:{ctx.command_path}")
            raise CommandFailed(f"{ctx.command_path} {name}" if name else ctx.command_path, str(exc)) from exc

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None,
                                                                              list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        ctx.meta[f"{_RESOLVED}:{ctx.command_path}"] = name
        return name, command, rest

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List commands with one-line summaries, without importing them."""
        rows = [(name, self.summaries.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, modules=BENCHMARKS, summaries=_BENCH_SUMMARIES, context_settings=CONTEXT,
             help="Benchmarks: each prints a table and writes JSON under results/ (KVSTRATA_BENCH_RESULTS).")
def bench() -> None:
    pass


@click.group(cls=LazyGroup, modules=COMMANDS, summaries=_COMMAND_SUMMARIES, context_settings=CONTEXT,
             help="kvstrata: a tiered KV-cache store for LLM inference.")
@click.version_option(package_name="kvstrata")
def kvstrata() -> None:
    pass


kvstrata.add_command(bench)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a in ("-h", "--help") for a in args):
        problem = check_environment()
        if problem is not None:
            return fail("kvstrata", problem)
    return invoke(kvstrata, args, "kvstrata")


if __name__ == "__main__":
    sys.exit(main())
