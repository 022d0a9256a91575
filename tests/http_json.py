"""A JSON POST over real HTTP for the tests of kvstrata's listeners (the router, an engine's
control listener): the status and the decoded answer, an error status included."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def post_json(url: str, body: object = None, *, token: str | None = None,
              raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    """POST `body` as JSON (or the bytes `raw`) to `url`, with `token` as the bearer if given."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
