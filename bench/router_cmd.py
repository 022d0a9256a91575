"""`kvstrata router`: the KV-aware routing service (docs/routing.md).

Answers POST /lookup: which engine instance holds the longest cached prefix of a request,
from the KV events of every instance's tiers. Also GET /healthz, /instances, /metrics.
"""

from __future__ import annotations

import logging
from typing import Any

import click

from bench.args import CONTEXT, invoke
from kvstore.errors import ConfigError
from kvstore.router.lookup import Scoring
from kvstore.router.service import RouterConfig, parse_vllm_events, serve


class Weights(click.ParamType):
    name = "weights"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        try:
            return Scoring.parse_weights(str(value))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


@click.command("router", help=__doc__, context_settings=CONTEXT)
@click.option("--port", type=click.IntRange(1, 65535), default=8090, show_default=True, help="HTTP port")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP address")
@click.option("--subscribe", multiple=True, required=True, metavar="ENDPOINT",
              help="a store's events_endpoint, e.g. tcp://10.0.0.5:5557 (repeat for each instance)")
@click.option("--vllm-events", multiple=True, metavar="ID=ENDPOINT",
              help="an instance's own vLLM KV events (--kv-events-config endpoint), for its GPU blocks")
@click.option("--tier-weights", type=Weights(), default="pool=1,cpu=0.8,disk=0.5,remote=0.3", show_default=True,
              help="fraction of a block's prefill a hit from each tier saves")
@click.option("--load-weight", type=click.FloatRange(min=0), default=Scoring().load_weight, show_default=True,
              help="score lost per unit of the load a lookup reports for an instance")
@click.option("--stale-after", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              metavar="SECONDS", help="drop an instance from the candidates after this long without a heartbeat")
def command(port: int, host: str, subscribe: tuple[str, ...], vllm_events: tuple[str, ...],
            tier_weights: tuple[float, float, float, float], load_weight: float, stale_after: float) -> None:
    try:
        config = RouterConfig(subscribe=subscribe, vllm_events=parse_vllm_events(vllm_events),
                              scoring=Scoring(tier_weights, load_weight), stale_after_s=stale_after)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    serve(config, host, port)


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata router")
