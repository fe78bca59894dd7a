"""AccessConfig: the server's security settings, their flags, and the bind rule.

    forkserve serve --api-key KEY [--api-key KEY2 ...] | --api-keys-file FILE
                    [--public-prefix NAME ...] [--max-sessions-per-key N] [--max-pages-per-key N]
                    [--max-tokens-per-request N] [--tokens-per-minute N] [--host H] [--insecure]

Defaults are safe: the server binds 127.0.0.1, and it refuses to bind any other address
without API keys unless ``--insecure`` says that is intended (one error line, exit code 2).
SECURITY.md states the threat model these settings answer.
"""
from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass, field

from forkserve.interfaces.server.auth import ApiKeys
from forkserve.interfaces.server.limits import UNLIMITED, TenantLimits
from forkserve.interfaces.usage import UsageError


@dataclass(frozen=True)
class AccessConfig:
    """``keys`` None: authentication off, every caller the one ``anonymous`` tenant."""

    keys: ApiKeys | None = None
    limits: TenantLimits = UNLIMITED
    public_prefixes: frozenset[str] = field(default_factory=frozenset)


# The defaults: no keys (so loopback only), no limits, no public prefixes.
DEFAULT_ACCESS = AccessConfig()


def add_access_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("access (SECURITY.md)")
    g.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept 'Authorization: Bearer KEY'; each key is a tenant of its own "
                        "(repeatable)")
    g.add_argument("--api-keys-file", metavar="FILE",
                   help="'KEY TENANT' per line: keys of one tenant share its sessions, cache and "
                        "limits")
    g.add_argument("--public-prefix", action="append", default=[], metavar="NAME",
                   help="a prefix-cache scope shared across tenants, chosen by cache_salt "
                        "'public:NAME'")
    g.add_argument("--max-sessions-per-key", type=int, metavar="N", help="open sessions per tenant")
    g.add_argument("--max-pages-per-key", type=int, metavar="N", help="KV pages held per tenant")
    g.add_argument("--max-tokens-per-request", type=int, metavar="N",
                   help="prompt + max_tokens per request")
    g.add_argument("--tokens-per-minute", type=int, metavar="N",
                   help="tokens admitted per tenant per minute")
    g.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without API keys (anyone who can reach it may "
                        "use it)")


def access_from_args(args: argparse.Namespace) -> AccessConfig:
    keys = ApiKeys.of_keys(args.api_key) if args.api_key else None
    if args.api_keys_file:
        from_file = ApiKeys.load(args.api_keys_file)
        keys = from_file.merged(keys)
    limits = TenantLimits(args.max_sessions_per_key, args.max_pages_per_key,
                          args.max_tokens_per_request, args.tokens_per_minute)
    return AccessConfig(keys, limits, frozenset(args.public_prefix))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def bind_refusal(host: str, access: AccessConfig, insecure: bool) -> str | None:
    """Why binding ``host`` is refused, or None."""
    if access.keys is None and not insecure and not is_loopback(host):
        return (f"refusing to bind {host} without --api-key/--api-keys-file "
                f"(anyone who reaches it could read and drive every session); give keys, or "
                f"--insecure if that is intended")
    return None


def checked_access(args: argparse.Namespace) -> AccessConfig:
    """The access settings of ``forkserve serve``'s flags, for either launcher; an unreadable
    keys file or a refused bind is a ``UsageError`` (one line, exit status 2)."""
    try:
        access = access_from_args(args)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    refusal = bind_refusal(args.host, access, args.insecure)
    if refusal is not None:
        raise UsageError(refusal)
    return access
