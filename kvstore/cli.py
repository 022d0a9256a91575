"""The `kvstrata` command: demos and benchmarks."""

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
    "workload": "bench.workload",
}
COMMANDS = {
    "demo-store": "kvstore.demo",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvstrata", description="kvstrata: a tiered KV-cache store.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the main demo (see README)", add_help=False)
    for name in COMMANDS:
        sub.add_parser(name, help=f"run {COMMANDS[name]}", add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        module = importlib.import_module(BENCHMARKS[args.name])
        module.main(rest)
        return 0
    target = COMMANDS.get(args.command, "kvstore.demo")
    result = importlib.import_module(target).main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
