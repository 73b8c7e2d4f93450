"""One short TCP connect to a URL's host, so a command on an offline machine fails in seconds with one line
instead of waiting out a client's retries (model/profiles.py for the Hugging Face Hub, model/modelscope.py)."""

from __future__ import annotations


def reachable(url: str, timeout_s: float = 3.0) -> bool:
    """Whether ``url``'s host accepts a TCP connection on its port (443 for https, 80 for http) in ``timeout_s``."""
    import socket
    from urllib.parse import urlparse

    parts = urlparse(url)
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
