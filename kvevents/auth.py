"""ZeroMQ CURVE for the KV-event sockets: the publisher authenticates its readers by their
public keys and every byte is encrypted; a reader authenticates the publisher by its key.

Keys are ZeroMQ certificate files (`zmq.auth.create_certificates(DIR, NAME)` writes
`NAME.key` with the public key and `NAME.key_secret` with both): a publisher is given its
secret certificate and a directory of the public certificates of the readers it admits; a
reader (`kvstrata router`) its own secret certificate and the publisher's public one. See
docs/security.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tiers.errors import ConfigError


def load_keypair(path: str, what: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of a secret certificate file; `ConfigError` naming `what`."""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {path!r} is not a readable ZeroMQ certificate: {exc}") from None
    if not secret:
        raise ConfigError(f"{what} {path!r} holds no secret key (give the '.key_secret' file)")
    return public, secret


def load_public(path: str, what: str) -> bytes:
    """The Z85 public key of a certificate file (public or secret)."""
    import zmq.auth

    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {path!r} is not a readable ZeroMQ certificate: {exc}") from None
    return public


def check_public_key(value: object, what: str) -> bytes:
    """A Z85 public key given as text (40 characters); `ConfigError` naming `what`."""
    import zmq.utils.z85

    if isinstance(value, str) and len(value) == 40:
        try:
            zmq.utils.z85.decode(value)
            return value.encode()
        except (ValueError, KeyError, IndexError):
            pass
    raise ConfigError(f"{what} must be a 40-character Z85 CURVE public key, got {value!r}")


@dataclass(frozen=True)
class CurveServer:
    """A publisher's CURVE keys and the directory of the readers' public certificates."""

    public: bytes
    secret: bytes
    clients_dir: str

    @classmethod
    def from_files(cls, cert: str, clients_dir: str) -> CurveServer:
        public, secret = load_keypair(cert, "events_curve_cert")
        if not os.path.isdir(clients_dir):
            raise ConfigError(f"events_curve_clients {clients_dir!r} is not a directory of public certificates")
        return cls(public, secret, clients_dir)

    def secure(self, sock: Any) -> None:
        """Make `sock` a CURVE server (before it binds)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def start_authenticator(self, ctx: Any) -> Any:
        """Admit only the readers whose public certificates are in `clients_dir` (a ZAP
        handler on its own thread, for sockets of `ctx`); returns it, to `stop()`."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=self.clients_dir)
        return auth


@dataclass(frozen=True)
class CurveClient:
    """A reader's CURVE keys (its own pair) for connecting to publishers."""

    public: bytes
    secret: bytes

    @classmethod
    def from_file(cls, cert: str) -> CurveClient:
        return cls(*load_keypair(cert, "--curve-cert"))

    def secure(self, sock: Any, server_public: bytes) -> None:
        """Make `sock` a CURVE client of the publisher with `server_public` (before connect)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = server_public
