"""The `kvstrata` command: demos, the offload experiment and benchmarks.

Every subcommand has its own parser (`kvstrata bench NAME --help` shows that benchmark's
options). A user mistake ends with one line naming the bad value and exit code 2.
"""

from __future__ import annotations

import importlib
import sys

from bench.args import check_results_dir
from kvstore.errors import KVStoreError

BENCHMARKS = {
    "hashing": "bench.hashing",
    "tiers": "bench.tiers",
    "demotion": "bench.demotion",
    "transfer": "bench.transfer",
    "trace": "bench.trace",
    "micro": "bench.micro",
    "scale": "bench.scale",
    "remote": "bench.remote",
    "vllm": "bench.vllm_longdoc",  # run with .venv-vllm's Python (see docs/vllm.md)
    "workload": "bench.workload",
    "router": "bench.router",
}
COMMANDS = {
    "demo": "bench.demo",
    "demo-store": "bench.demo_store",
    "demo-remote": "bench.demo_remote",
    "offload": "bench.offload",
    "inspect": "bench.inspect_disk",
    "router": "bench.router_cmd",
    "demo-fleet": "bench.demo_fleet",
}
USAGE = (
    "usage: kvstrata {" + ",".join(COMMANDS) + "} [options]\n"
    "       kvstrata bench {" + ",".join(BENCHMARKS) + "} [options]\n"
    "Run `kvstrata COMMAND --help` or `kvstrata bench NAME --help` for a command's options."
)


def _fail(message: str) -> int:
    print(f"kvstrata: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            print(USAGE)
            return 0 if rest else 2
        if rest[0] not in BENCHMARKS:
            return _fail(f"unknown benchmark {rest[0]!r}; choose from {', '.join(BENCHMARKS)}")
        module, rest = BENCHMARKS[rest[0]], rest[1:]
    elif command in COMMANDS:
        module = COMMANDS[command]
    else:
        return _fail(f"unknown command {command!r}; choose from {', '.join([*COMMANDS, 'bench'])}")
    problem = check_results_dir()
    if problem is not None:
        return _fail(problem)
    try:
        result = importlib.import_module(module).main(rest)
    except SystemExit as exc:  # the parser's own exits (errors: 2, --help: 0)
        return exc.code if isinstance(exc.code, int) else _fail(str(exc.code))
    except (KVStoreError, OSError) as exc:  # a bad value met at run time: no traceback
        return _fail(str(exc))
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
