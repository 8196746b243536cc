"""A model whose load failed and then succeeded is healthy again: its failures since the
last good load (what `gpufn app list` and the dashboard call broken) go back to zero."""

from __future__ import annotations

import pytest

from gpufn.wire import protocol as p
from gpufn.wire.spec import make_spec

from .core_harness import GiB, Harness

MODEL = {"name": "enc", "code_id": "0123456789abc", "memory": GiB, "pin": False,
         "offload": True, "nframes": 1}

pytestmark = pytest.mark.timeout(30)


def test_a_successful_load_heals_a_model_that_failed() -> None:
    h = Harness(devices=1, memory=8 * GiB)
    w = h.start_worker(0)
    spec = make_spec()
    h.feed(b"cli", p.Register("f-1", "code-f", "f", spec.to_wire(), [dict(MODEL)],
                              (b"code", b"loader")))
    a = h.submit("f-1")
    key = next(iter(h.core.models.models))
    rec = h.core.models.models[key]
    h.feed(w, p.ModelEvent(key, p.ModelState.LOAD_FAILED, 0, 0.0, "ModelLoadError",
                           "no module named transformers"))
    h.feed(w, p.Result(a, False, "ModelLoadError", "x", p.ResultMeta(dispatch_token=h.token(a))))
    assert (rec.failures, rec.failing) == (1, 1)
    h.tick(0.1)
    b = h.submit("f-1")
    assert b not in h.results()
    h.feed(w, p.ModelEvent(key, p.ModelState.RESIDENT, GiB // 2, 0.5, "", ""))
    assert (rec.failures, rec.failing) == (1, 0), "a good load leaves the model broken"
