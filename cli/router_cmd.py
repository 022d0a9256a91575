"""`kvstrata router`: the KV-aware routing service (docs/routing.md, docs/security.md).

Follows the KV events (vLLM's format) of kvstrata stores and vLLM engines, and answers POST
/lookup: which instance holds the longest cached prefix of a request, and in which tiers.
Instances come from --subscribe and from POST /register. POST /prefetch forwards a prefetch
to the instance /lookup would choose, at its control URL (--control, or /register's
control_url). Also POST /unregister, GET /healthz, /instances, /metrics.
"""

from __future__ import annotations

import logging
from typing import Any

import click

from cli.args import CONTEXT, ParamType, invoke
from kvstore.errors import ConfigError
from router.fleet import Limits
from router.lookup import Scoring


class Weights(ParamType):
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
@click.option("--host", default="127.0.0.1", show_default=True,
              help="HTTP address (another than loopback needs --token-file)")
@click.option("--subscribe", multiple=True, metavar="[NAME=]ENDPOINT[,REPLAY]",
              help="an events endpoint (a store's events_endpoint, a vLLM engine's --kv-events-config endpoint), "
                   "optionally under an instance NAME (several endpoints may share one) and with its replay "
                   "endpoint; repeat for each")
@click.option("--tier-weights", type=Weights(), default="pool=1,cpu=0.8,disk=0.5,remote=0.3", show_default=True,
              help="fraction of a block's prefill a hit from each tier saves")
@click.option("--load-weight", type=click.FloatRange(min=0), default=Scoring().load_weight, show_default=True,
              help="score lost per unit of the load a lookup reports for an instance")
@click.option("--stale-after", type=click.FloatRange(min=0, min_open=True, max=3600, max_open=True), default=5.0,
              show_default=True, metavar="SECONDS", help="drop an instance from the candidates after this long silent")
@click.option("--forget-after", type=click.FloatRange(min=1), default=600.0, show_default=True, metavar="SECONDS",
              help="free what the router keeps of a source silent this long")
@click.option("--max-sources", type=click.IntRange(1, 4096), default=Limits().max_sources, show_default=True)
@click.option("--max-blocks", type=click.IntRange(1), default=Limits().max_blocks_per_slot, show_default=True,
              help="blocks indexed per source (and per shared remote tier)")
@click.option("--control", multiple=True, metavar="NAME=http://HOST:PORT",
              help="an instance's control listener (its connector's control_endpoint), where POST /prefetch "
                   "forwards; repeat for each")
@click.option("--token-file", type=click.Path(dir_okay=False), default=None,
              help="a file holding the bearer token every request but GET /healthz must carry")
@click.option("--curve-cert", type=click.Path(dir_okay=False), default=None,
              help="the router's secret ZeroMQ certificate, for publishers that require CURVE")
@click.option("--curve-server", type=click.Path(dir_okay=False), default=None,
              help="the publishers' public ZeroMQ certificate (for every --subscribe)")
def command(port: int, host: str, subscribe: tuple[str, ...], control: tuple[str, ...],
            tier_weights: tuple[float, float, float, float],
            load_weight: float, stale_after: float, forget_after: float, max_sources: int, max_blocks: int,
            token_file: str | None, curve_cert: str | None, curve_server: str | None) -> None:
    from kvevents import CurveClient, load_public
    from router.config import RouterConfig, read_token
    from router.prefetch import parse_control
    from router.service import serve

    try:
        token = read_token(token_file) if token_file else None
        if token is None and host not in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError(f"--host {host} is reachable from other hosts: give --token-file (docs/security.md)")
        config = RouterConfig(
            subscriptions=tuple(_subscription(s) for s in subscribe),
            scoring=Scoring(tier_weights, load_weight),
            limits=Limits(max_sources=max_sources, max_blocks_per_slot=max_blocks, stale_after_s=stale_after,
                          forget_after_s=forget_after),
            curve=CurveClient.from_file(curve_cert) if curve_cert else None,
            curve_server_key=load_public(curve_server, "--curve-server") if curve_server else None, token=token,
            controls=tuple(parse_control(c) for c in control))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        serve(config, host, port)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _subscription(text: str) -> Any:
    from router.config import Subscription

    try:
        return Subscription.parse(text)
    except ConfigError as exc:
        raise ConfigError(f"--subscribe {text!r}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    return invoke(command, argv, "kvstrata router")
