"""The read-only dashboard at `GET /`: one page that signs in with the cluster's token (kept
in the tab's sessionStorage only) and renders `GET /v1/status` (what `gpufn status --json`
shows, the apps and the gateway's recent errors) every two seconds."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=1)
def page() -> str:
    return resources.files("gpufn.http").joinpath("dashboard.html").read_text(encoding="utf-8")
