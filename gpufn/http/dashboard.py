"""The read-only dashboard at `GET /`: one page that signs in with the cluster's token (kept
in the tab's sessionStorage only) and renders `GET /v1/status` (what `gpufn status --json`
shows, the apps and the gateway's recent errors) every two seconds."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

# Its own inline script and style only, fetches to this origin only, never framed.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                               "style-src 'unsafe-inline'; img-src 'self' data:; "
                               "frame-ancestors 'none'",
    "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache",
}


@lru_cache(maxsize=1)
def page() -> str:
    return resources.files("gpufn.http").joinpath("dashboard.html").read_text(encoding="utf-8")
