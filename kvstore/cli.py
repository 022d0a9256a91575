"""The `kvstrata` command: demos, the offload experiment and benchmarks."""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = {
    "hashing": "bench.hashing",
    "tiers": "bench.tiers",
    "demotion": "bench.demotion",
    "transfer": "bench.transfer",
    "trace": "bench.trace",
    "micro": "bench.micro",
    "scale": "bench.scale",
    "vllm": "bench.vllm_longdoc",  # run with .venv-vllm's Python (see docs/vllm.md)
    "workload": "bench.workload",
}
COMMANDS = {
    "demo": "engine_adapter.demo",
    "demo-store": "kvstore.demo",
    "offload": "bench.offload",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvstrata", description="kvstrata: a tiered KV-cache store.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        sub.add_parser(name, help=f"run {COMMANDS[name]}", add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        module = importlib.import_module(BENCHMARKS[args.name])
        module.main(rest)
        return 0
    result = importlib.import_module(COMMANDS[args.command]).main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
