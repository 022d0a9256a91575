"""The remote tier's URL: validation, the forms shown to people, and the client options it names.

A URL may carry credentials in two places redis-py reads: the userinfo
(`redis://user:password@host`) and the query (`?password=...`, `?username=...`,
`?ssl_password=...`), for every scheme, cluster URLs included. `redacted` is the only form of
a URL that may reach a message or log; `identity` names the server (and database) without any
credential or option, so instances that share a server can be matched.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import NamedTuple

from tiers.errors import ConfigError

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
# Query options kvstrata passes on to redis-py. Others are refused: some would break the
# tier (decode_responses), others would override the bounds it sets (timeouts, retries).
CREDENTIAL_OPTIONS = ("password", "username", "ssl_password")
_TLS_OPTIONS = ("ssl_cert_reqs", "ssl_check_hostname", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile",
                "ssl_keyfile", "ssl_password", "ssl_min_version")
_OPTIONS = ("db", "password", "username", "client_name", "protocol", *_TLS_OPTIONS)
_SHOWN = frozenset(("db", "protocol", "ssl_cert_reqs", "ssl_check_hostname", "ssl_min_version"))
_DB = re.compile(r"/?(\d{1,5})?/?")


class UrlParts(NamedTuple):
    """A remote URL taken apart (credentials still in `userinfo` and `options`)."""

    scheme: str
    userinfo: str | None  # text before the last '@' of the authority, undecoded
    hosts: tuple[tuple[str, int], ...]  # (host, port); empty for unix://
    path: str  # unix socket path, else the '/db' part
    options: tuple[tuple[str, str], ...]  # query, decoded, in order

    @property
    def password(self) -> str | None:
        """The password redis-py would send: the userinfo's, else the query's."""
        if self.userinfo is not None and ":" in self.userinfo:
            return urllib.parse.unquote(self.userinfo.split(":", 1)[1]) or None
        return dict(self.options).get("password") or None

    @property
    def username(self) -> str | None:
        if self.userinfo:
            return urllib.parse.unquote(self.userinfo.split(":", 1)[0]) or None
        return dict(self.options).get("username") or None

    @property
    def db(self) -> int:
        opts = dict(self.options)
        if "db" in opts:
            return int(opts["db"])
        match = _DB.fullmatch(self.path) if self.scheme != "unix" else None
        return int(match.group(1)) if match and match.group(1) else 0

    @property
    def secrets(self) -> list[str]:
        """Every credential in the URL, as written and decoded, longest first (to scrub from
        messages): the userinfo, its password, and the query's credential options."""
        found = [self.userinfo, self.userinfo.partition(":")[2]] if self.userinfo else []
        found += [v for k, v in self.options if k in CREDENTIAL_OPTIONS]
        return sorted({s for v in found if v for s in (v, urllib.parse.unquote(v))}, key=len, reverse=True)


def _split(url: str) -> tuple[str, str | None, str, str, str]:
    """(scheme, userinfo, host list, path, query) as written. The userinfo ends at the last '@'
    before the first '?', so a password holding '/', '@' or '#' is never shown as a host."""
    scheme, _, rest = url.partition("://")
    first_query = rest.find("?")
    at = rest.rfind("@", 0, first_query if first_query >= 0 else len(rest))
    userinfo = rest[:at] if at >= 0 else None
    main, _, query = rest[at + 1 :].split("#", 1)[0].partition("?")
    hosts, slash, path = main.partition("/")
    return scheme, userinfo, hosts, slash + path, query


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, port = text, str(DEFAULT_PORT)
    if text.startswith("["):  # [IPv6]:port
        host, _, tail = text[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else port
    elif ":" in text:
        host, port = text.rsplit(":", 1)
    if not host:
        raise ConfigError(f"remote_url names no host: {redacted(url)}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"remote_url has a port that is not 1-65535: {redacted(url)}")
    return host.lower(), int(port)


def parse(url: object) -> UrlParts:
    """`url` taken apart if it names a server kvstrata can use, else `ConfigError` (the URL
    redacted): a known scheme, host(s) with valid ports (a socket path for unix://), a database
    number where one is allowed, and only query options kvstrata passes on."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"remote_url must be a URL such as redis://host:6379, got "
                          f"{redacted(url) if isinstance(url, str) else repr(url)}")
    scheme, userinfo, host_text, path, query = _split(url)
    if scheme not in SCHEMES:
        raise ConfigError(f"remote_url scheme {scheme!r} is not one of {', '.join(SCHEMES)}: {redacted(url)}")
    if userinfo is not None and any(c in userinfo for c in "/?#"):
        raise ConfigError(f"remote_url: percent-encode '/', '?' and '#' in the user name and password "
                          f"(%2F, %3F, %23): {redacted(url)}")
    options = tuple(urllib.parse.parse_qsl(query, keep_blank_values=True))
    for name, value in options:
        if name not in _OPTIONS:
            shown = name if re.fullmatch(r"[a-z_]{1,40}", name) else "***"
            raise ConfigError(f"remote_url option {shown!r} is not one kvstrata passes on (use one of "
                              f"{', '.join(_OPTIONS)}; remote_timeout_s sets the timeouts): {redacted(url)}")
        if name == "db" and not value.isdigit():
            raise ConfigError(f"remote_url option db must be a database number: {redacted(url)}")
        if name in _TLS_OPTIONS and not scheme.startswith("rediss"):
            raise ConfigError(f"remote_url option {name!r} needs a rediss:// URL: {redacted(url)}")
    _check_values(options, url)
    if scheme == "unix":
        if host_text or not path:
            raise ConfigError(f"remote_url unix:///path.sock names no socket path: {redacted(url)}")
        return UrlParts(scheme, userinfo, (), urllib.parse.unquote(path), options)
    hosts = tuple(_host_port(h, url) for h in host_text.split(",")) if host_text else ()
    if not hosts:
        raise ConfigError(f"remote_url names no host: {redacted(url)}")
    if len(hosts) > 1 and not scheme.endswith("+cluster"):
        raise ConfigError(f"remote_url lists several hosts; use redis+cluster:// for a cluster: {redacted(url)}")
    if not _DB.fullmatch(path):
        shown = repr(path[1:]) if re.fullmatch(r"/[\w.-]{1,40}", path) else "(not shown)"
        raise ConfigError(f"remote_url database {shown} is not a database number such as /0: {redacted(url)}")
    parts = UrlParts(scheme, userinfo, hosts, path, options)
    if scheme.endswith("+cluster") and parts.db != 0:
        raise ConfigError(f"remote_url: a cluster has only database 0: {redacted(url)}")
    return parts


def _check_values(options: tuple[tuple[str, str], ...], url: str) -> None:
    """`ConfigError` if redis-py cannot read an option's value (it reads them at connect)."""
    from redis.connection import parse_url

    try:
        parse_url("redis://x/?" + urllib.parse.urlencode(options))  # type: ignore[no-untyped-call]  # unannotated
    except ValueError as exc:
        raise ConfigError(f"remote_url: {exc}: {redacted(url)}") from None
    protocol = dict(options).get("protocol")
    if protocol is not None and protocol not in ("2", "3"):
        raise ConfigError(f"remote_url option protocol must be 2 or 3: {redacted(url)}")


def check_url(url: object) -> str:
    """`url` if it names a server kvstrata can use, else `ConfigError` (see `parse`)."""
    parse(url)
    assert isinstance(url, str)
    return url


def redacted(url: str) -> str:
    """`url` with every credential replaced by `***`: the userinfo's password (or the whole
    userinfo when it has no ':'), the values of query options that are not known to be
    harmless, and anything after '#'. Never raises."""
    scheme, userinfo, hosts, path, query = _split(url)
    if "://" not in url:
        return "***"
    shown = scheme + "://"
    if userinfo is not None:
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        shown += (f"{user}:***@" if user and "/" not in user else "***@")
    host_parts = []
    for h in hosts.split(","):
        name, colon, port = h.rpartition(":") if not h.endswith("]") else (h, "", "")
        host_parts.append(f"{name}:{port}" if colon and port.isdigit() else (f"{name}:***" if colon else h))
    shown += ",".join(host_parts)
    shown += path if scheme == "unix" or _DB.fullmatch(path) else "/***"
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        shown += "?" + "&".join(f"{k}={v if k in _SHOWN and v.isalnum() else '***'}" if k in _OPTIONS else "***"
                                for k, v in pairs) if pairs else "?***"
    return shown


def identity(parts: UrlParts) -> str:
    """The server, or cluster, and database `parts` name, without credentials or options:
    equal for URLs that reach the same data (default port and database filled in, cluster
    seed nodes sorted)."""
    if parts.scheme == "unix":
        return f"unix://{parts.path}?db={parts.db}"
    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in sorted(parts.hosts))
    return f"{parts.scheme}://{hosts}/{parts.db}"


def scrub(text: str, secrets: list[str]) -> str:
    """`text` with every secret replaced by `***` (for exception messages from the client)."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text
