"""Who may reach the embedded server: a host reachable from other machines needs an API key,
unless serving without one is asked for explicitly. Imports no torch: the command line checks
its flags before loading a model."""

from __future__ import annotations

import ipaddress

from r3lightning.checks import check_api_key


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine.

    Args:
        host: a host name or IP address to bind.

    Returns:
        True for ``localhost`` and loopback IPs (``127.0.0.0/8``, ``::1``); False for anything
        else, names that resolve to a loopback address included (they are not resolved).
    """
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(
    host: str, api_key: str | None, allow_unauthenticated: bool, key_name: str = "api_key"
) -> None:
    """Refuse a server setup that would let anyone generate and replace its weights.

    Args:
        host: the address the server binds.
        api_key: the bearer token (None: no authentication).
        allow_unauthenticated: serve a non-loopback ``host`` without a key anyway.
        key_name: what the errors call the key setting (``--api-key`` on the command line).

    Raises:
        TypeError: ``api_key`` is neither None nor a string.
        ValueError: ``api_key`` is empty, blank or unsendable, or ``host`` is reachable from
            other machines with no key and ``allow_unauthenticated`` is false.
    """
    check_api_key(api_key, key_name)
    if api_key is None and not allow_unauthenticated and not is_loopback(host):
        raise ValueError(
            f"host {host!r} is reachable from other machines but no api_key is set: anyone could "
            "generate and replace the weights; set an api_key (--api-key), or allow_unauthenticated "
            "(--allow-unauthenticated) to serve without one"
        )
