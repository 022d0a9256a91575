"""`kvstrata router`: the KV-aware routing service (docs/routing.md)."""

from __future__ import annotations

import argparse
import logging

from bench.args import Parser, int_in
from kvstore.errors import ConfigError
from kvstore.router.lookup import Scoring
from kvstore.router.service import RouterConfig, parse_vllm_events, serve


def _weights(text: str) -> tuple[float, float, float, float]:
    try:
        return Scoring.parse_weights(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not a number >= 0")
    return value


def parser() -> Parser:
    p = Parser(prog="kvstrata router", description="Answer POST /lookup: which engine instance holds the longest "
               "cached prefix of a request, from the KV events of every instance's tiers.")
    p.add_argument("--port", type=int_in(1, 65535), default=8090, help="HTTP port (default 8090)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--subscribe", action="append", required=True, metavar="ENDPOINT",
                   help="a store's events_endpoint, e.g. tcp://10.0.0.5:5557 (repeat for each instance)")
    p.add_argument("--vllm-events", action="append", default=[], metavar="ID=ENDPOINT",
                   help="an instance's own vLLM KV events (--kv-events-config endpoint), for its GPU blocks")
    p.add_argument("--tier-weights", type=_weights, default=Scoring().weights, metavar="pool=1,cpu=0.8,...",
                   help="fraction of a block's prefill a hit from each tier saves (default pool=1,cpu=0.8,disk=0.5,"
                        "remote=0.3)")
    p.add_argument("--load-weight", type=_nonneg_float, default=Scoring().load_weight,
                   help="score lost per unit of the load a lookup reports for an instance (default 0.1)")
    p.add_argument("--stale-after", type=_nonneg_float, default=5.0, metavar="SECONDS",
                   help="drop an instance from the candidates after this long without a heartbeat (default 5)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = RouterConfig(subscribe=tuple(args.subscribe), vllm_events=parse_vllm_events(args.vllm_events),
                          scoring=Scoring(args.tier_weights, args.load_weight), stale_after_s=args.stale_after)
    serve(config, args.host, args.port)
    return 0
