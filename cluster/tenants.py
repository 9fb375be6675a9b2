"""API keys, tenants and per-tenant cache salts, shared by the gRPC and HTTP front ends.

Each API key maps to one tenant. Keys are given as `tenant:key` entries, one per line in a file or
comma-separated in an environment variable; blank lines and lines starting with `#` are skipped. A
presented key is checked against every configured key with `hmac.compare_digest` on their SHA-256
digests, always all of them, so the time taken does not depend on which key, or how much of one,
matched.

With no keys configured the server is open: everyone is the tenant `default`, and only clients on
loopback are let in.

The server, never the client, picks a request's cache salt: an HMAC of the tenant's name under a
server secret. Different tenants therefore never share prefix blocks, and the salt is never sent to
anyone. Servers that should share prefixes (a fleet behind one router) must share the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TENANT = "default"
MIN_KEY_LENGTH = 16
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class Unauthenticated(Exception):
    """No key, or a key that matches no tenant (gRPC UNAUTHENTICATED, HTTP 401)."""


class PermissionDenied(Exception):
    """A known tenant asking for something it may not do (gRPC PERMISSION_DENIED, HTTP 403)."""


@dataclass(frozen=True)
class Tenant:
    name: str
    admin: bool


def parse_key_entries(text: str, source: str) -> dict[str, str]:
    """`tenant:key` entries, separated by newlines or commas -> {key: tenant}. ValueError names the entry."""
    keys: dict[str, str] = {}
    for n, line in enumerate(text.replace(",", "\n").splitlines(), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        tenant, sep, key = entry.partition(":")
        tenant, key = tenant.strip(), key.strip()
        where = f"{source}, entry {n}"
        if not sep:
            raise ValueError(f"{where}: expected tenant:key")
        if not _TENANT_NAME.fullmatch(tenant):
            raise ValueError(f"{where}: tenant name {tenant!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if len(key) < MIN_KEY_LENGTH or any(c.isspace() for c in key):
            raise ValueError(f"{where}: the key for tenant {tenant!r} must be at least {MIN_KEY_LENGTH} "
                             "characters with no spaces")
        if key in keys:
            raise ValueError(f"{where}: the same key is given twice")
        keys[key] = tenant
    return keys


def is_loopback(host: str | None) -> bool:
    """True for a loopback IP address or a Unix socket peer (host None or 'unix:...')."""
    if host is None or host.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def grpc_peer_host(peer: str) -> str | None:
    """grpc's `context.peer()` ('ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000', 'unix:/x') -> its host."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    if kind == "unix":
        return None
    return peer


def bearer_token(authorization: str | None) -> str | None:
    """The key in an 'Authorization: Bearer KEY' header value, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class TenantAuth:
    """Checks API keys and derives cache salts. `keys` maps key -> tenant; admin tenants may use Admin calls."""

    def __init__(self, keys: dict[str, str] | None = None, admin_tenants: frozenset[str] | set[str] = frozenset(),
                 salt_secret: bytes | None = None):
        keys = keys or {}
        unknown = set(admin_tenants) - set(keys.values())
        if keys and unknown:
            raise ValueError(f"admin_tenants: {', '.join(sorted(unknown))} has no API key")
        self._digests = [(hashlib.sha256(k.encode()).digest(), t) for k, t in keys.items()]
        self.tenants = frozenset(keys.values())
        self.admin_tenants = frozenset(admin_tenants)
        self._secret = salt_secret if salt_secret else os.urandom(32)

    @classmethod
    def from_sources(cls, keys_file: str | Path | None = None, keys_env: str | None = None,
                     admin_tenants: str | None = None, salt_secret: str | None = None) -> TenantAuth:
        """Keys from a file and/or the text of an environment variable; admin tenants comma-separated."""
        keys: dict[str, str] = {}
        if keys_file:
            try:
                text = Path(keys_file).read_text()
            except OSError as e:
                raise ValueError(f"api_keys_file: cannot read {keys_file}: {e.strerror}") from None
            keys.update(parse_key_entries(text, f"api_keys_file {keys_file}"))
        if keys_env:
            for key, tenant in parse_key_entries(keys_env, "KVSTRATA_API_KEYS").items():
                if keys.get(key, tenant) != tenant:
                    raise ValueError("KVSTRATA_API_KEYS: a key is given to two tenants")
                keys[key] = tenant
        admins = {t.strip() for t in (admin_tenants or "").split(",") if t.strip()}
        return cls(keys, admins, salt_secret.encode() if salt_secret else None)

    @property
    def open(self) -> bool:
        """No keys configured: everyone is `default`, from loopback only."""
        return not self._digests

    def authenticate(self, key: str | None, peer_host: str | None) -> Tenant:
        if self.open:
            if not is_loopback(peer_host):
                raise Unauthenticated("this server has no API keys configured and accepts loopback clients only")
            return Tenant(DEFAULT_TENANT, admin=True)
        if not key:
            raise Unauthenticated("an API key is required (Authorization: Bearer KEY)")
        presented = hashlib.sha256(key.encode()).digest()
        found = None
        for digest, tenant in self._digests:  # every entry, no early exit
            if hmac.compare_digest(presented, digest):
                found = tenant
        if found is None:
            raise Unauthenticated("invalid API key")
        return Tenant(found, admin=found in self.admin_tenants)

    def cache_salt(self, tenant: str) -> str:
        return hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def require_admin(tenant: Tenant) -> None:
        if not tenant.admin:
            raise PermissionDenied(f"tenant {tenant.name!r} may not use admin calls")
