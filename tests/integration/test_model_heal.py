"""A model whose load failed and then succeeded is healthy again, as `gpufn app list` and the
dashboard (GET /v1/apps) show it, without a restart of the head: the README's OpenAI example
deployed before its dependency was installed, then fixed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

import gpufn  # noqa: E402
from gpufn.api.deployment import list_apps  # noqa: E402

from .http_served import ServedGateway  # noqa: E402
from .test_http import client_as_default  # noqa: E402

pytestmark = pytest.mark.timeout(180)

APP = '''
import pathlib
import gpufn

@gpufn.model(memory="16MiB")
def needs_marker():
    if not pathlib.Path({marker!r}).exists():
        raise ModuleNotFoundError("No module named 'transformers'")
    return 42

@gpufn.gpu(models=[needs_marker])
def answer() -> int:
    return needs_marker.get()
'''


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedGateway]:
    s = ServedGateway(tmp_path / "home")
    s.start()
    try:
        yield s
    finally:
        s.stop()


def test_a_good_load_after_a_failed_one_heals_the_app(served: ServedGateway, tmp_path: Path) -> None:
    marker = tmp_path / "installed"
    app = tmp_path / "healing.py"
    app.write_text(APP.format(marker=str(marker)))
    client = served.client()
    try:
        served.wait_ready(client)
        gpufn.deploy(app, name="heal", client=client)
        with client_as_default(client), pytest.raises(gpufn.ModelLoadError,
                                                      match="transformers"):
            gpufn.lookup("heal", "answer").remote()

        def broken() -> tuple[bool, bool]:
            listed = next(a for a in list_apps(client) if a["name"] == "heal")
            with httpx.Client(base_url=served.url, timeout=30,
                              headers={"Authorization": f"Bearer {served.token}"}) as http:
                shown = next(a for a in http.get("/v1/apps").json()["apps"]
                             if a["name"] == "heal")
            assert "Traceback" not in str(shown)  # the dashboard's copy has no traceback
            return bool(listed["broken"]), bool(shown["broken"])

        assert broken() == (True, True)
        marker.write_text("")  # the dependency is installed now
        with client_as_default(client):
            assert gpufn.lookup("heal", "answer").remote() == 42
        assert broken() == (False, False)
    finally:
        client.close()
