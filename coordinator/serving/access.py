"""Who may call the server, and from which web origins: the API key
(--api-key, sent as 'Authorization: Bearer KEY') and CORS (--cors-origin).
Pure: header values in, headers or an ApiError out."""
from __future__ import annotations

import hmac

from coordinator.serving import web_page
from coordinator.serving.openai_api import ApiError

# open even with --api-key: probes, scrapers, and the web page (which asks for the key)
PUBLIC_PATHS = ("/health", "/metrics", *web_page.PATHS)
PREFLIGHT_MAX_AGE = 86400  # seconds a browser may keep a preflight's answer


def needs_key(path: str) -> bool:
    return path not in PUBLIC_PATHS


class ApiKey:
    def __init__(self, key: str | list[str]):
        """One key, or several (--api-key a,b and --api-key-file): any of them is let in."""
        keys = [key] if isinstance(key, str) else list(key)
        if not keys or not all(keys):
            raise ValueError("an API key must not be empty")
        self._keys = [k.encode("utf-8", "surrogateescape") for k in keys]

    def check(self, authorization: str) -> None:
        """ApiError 401 unless `authorization` (the header's value, "" when
        absent) is 'Bearer <a key>' (the scheme in any case)."""
        scheme, _, key = authorization.partition(" ")
        given = key.strip().encode("utf-8", "surrogateescape")
        # compare_digest, against every key: the time taken does not tell how much of a key was right, or which
        matched = [hmac.compare_digest(given, k) for k in self._keys]
        if not (any(matched) and scheme.lower() == "bearer"):
            raise ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def keys_in(text: str) -> list[str]:
    """The keys an --api-key-file holds: one a line; blank lines and lines starting with '#' are skipped
    (llama-server's format)."""
    return [s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#")]


def preflight_headers(requested_headers: str | None) -> dict:
    """The answer to a CORS preflight (OPTIONS, 204), which carries no
    credentials by the browser's rules; `requested_headers`: its
    Access-Control-Request-Headers."""
    return {"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": requested_headers or "Authorization, Content-Type, X-Request-Id",
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE)}


def cors_headers(origin: str) -> dict:
    """What every response carries (streams and errors included) for --cors-origin `origin`."""
    headers = {"Access-Control-Allow-Origin": origin, "Access-Control-Expose-Headers": "X-Request-Id, Retry-After"}
    if origin != "*":
        headers["Vary"] = "Origin"
    return headers
