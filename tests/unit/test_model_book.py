"""The scheduler's book of shared models (`scheduler/books/model_book.py`) on its own:
its records, requests and cold-start guesses, the orders an admission sends, what a
worker's model events do to the ledger and the records, and what it shows."""

from __future__ import annotations

from typing import Any

import pytest

from gpufn.exceptions import OutOfMemory, kind_of
from gpufn.memory_pool.ledger import Fit, GroupFit, ModelNeed, Request, StaleFit
from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.books.model_book import Holder, ModelBook
from gpufn.scheduler.nouns.records import Device
from gpufn.scheduler.nouns.shapes import Shape
from gpufn.scheduler.nouns.states import DeviceState
from gpufn.wire import protocol as p

from .test_scheduler_pieces import _devices, _fn, _inv

GiB = 2**30


def _book(*models: tuple[str, int], **desc: Any) -> tuple[ModelBook, list[str]]:
    book = ModelBook()
    keys = book.register([{"name": n, "code_id": f"{n}-code", "memory": size, "nframes": 1,
                           **desc} for n, size in models], tuple(f"{n}-loader".encode()
                                                                 for n, _ in models))
    return book, list(keys)


def _plan(load: tuple[str, ...] = (), restore: tuple[str, ...] = (), waiting: tuple[str, ...] = (),
          offload: tuple[str, ...] = (), evict: tuple[str, ...] = (),
          drop_host: tuple[tuple[str, str], ...] = ()) -> Fit:
    return Fit(Request(), (), waiting, load, restore, offload, evict, drop_host,
               0, 0, 0, 0.0, 0, 0.0, (0, 0))


def _event(book: ModelBook, d: Device, key: str, state: p.ModelState, nbytes: int = 0,
           seconds: float = 0.0, kind: str = "", message: str = "") -> bool:
    return book.on_event(d, p.ModelEvent(key, state, nbytes, seconds, kind, message), 1.0)


def _loading(book: ModelBook, d: Device, key: str) -> None:
    r = book.models[key]
    d.ledger.load_started(ModelNeed(key, r.size, r.pin, r.offload), 0.0)


def _resident(book: ModelBook, d: Device, key: str) -> None:
    _loading(book, d, key)
    d.ledger.load_done(key, 0.0, book.models[key].size, 1.0)


# --------------------------------------------------------------------------- records


def test_a_model_is_keyed_by_name_and_loader_hash_and_takes_its_own_frames() -> None:
    book = ModelBook()
    keys = book.register([
        {"name": "a", "code_id": "0123456789abcdef", "memory": 5, "nframes": 2, "pin": True,
         "offload": False, "count": 2},
        {"name": "b", "nframes": 1},
    ], (b"a1", b"a2", b"b1"))
    assert keys == ("a@0123456789", "b@")
    a, b = book.models[keys[0]], book.models[keys[1]]
    assert (a.name, a.memory, a.pin, a.offload, a.frames, a.count) == (
        "a", 5, True, False, (b"a1", b"a2"), 2)
    assert (b.name, b.memory, b.pin, b.offload, b.frames, b.count) == (
        "b", 0, False, True, (b"b1",), 1)
    # a model that names no frames of its own takes none
    assert book.register([{"name": "c"}, {"name": "d", "nframes": 1}], (b"d1",)) == ("c@", "d@")
    assert book.models["c@"].frames == () and book.models["d@"].frames == (b"d1",)
    # a new model has no history: nothing measured, loaded, moved or failed
    assert (a.measured, a.loads, a.load_seconds, a.restores, a.restore_seconds, a.offloads,
            a.evictions, a.failures, a.failing, a.last_error, a.holder) == (
        0, 0, 0.0, 0, 0.0, 0, 0, 0, 0, "", None)
    # the same key again (another function naming it) keeps the first record
    assert book.register([{"name": "a", "code_id": "0123456789zz", "memory": 9,
                           "nframes": 1}], (b"other",)) == ("a@0123456789",)
    assert book.models["a@0123456789"].memory == 5
    assert book.models["a@0123456789"].frames == (b"a1", b"a2")


def test_a_models_size_is_its_measured_bytes_else_its_estimate() -> None:
    book, (a, b) = _book(("a", 2 * GiB), ("b", 1 * GiB), pin=True, offload=False)
    fn = _fn("u", (a, b), memory="1GiB")
    assert book.model_bytes(fn) == 3 * GiB
    book.models[a].measured = 3 * GiB
    assert book.models[a].size == 3 * GiB and book.model_bytes(fn) == 4 * GiB
    req = book.request(_inv(fn, priority=5))
    assert req.models == (ModelNeed(a, 3 * GiB, True, False, 5), ModelNeed(b, GiB, True, False, 5))
    assert (req.workspace, req.function) == (GiB, "u")


def test_cold_seconds_use_the_measured_means_else_the_bandwidth_guesses() -> None:
    """Unmeasured: a restore at 8 GiB/s (HOST_BANDWIDTH), a load 1 s + 1 GiB/s."""
    book, (a, b) = _book(("a", 8 * GiB), ("b", 2 * GiB))
    assert book.cold_seconds(_plan(restore=(a,))) == pytest.approx(1.0)  # 8 GiB at 8 GiB/s
    assert book.cold_seconds(_plan(load=(b,))) == pytest.approx(3.0)  # 1 s + 2 GiB at 1 GiB/s
    assert book.cold_seconds(_plan(load=(b,), restore=(a,))) == pytest.approx(4.0)
    book.models[a].restores, book.models[a].restore_seconds = 2, 3.0
    book.models[b].loads, book.models[b].load_seconds = 4, 2.0
    assert book.cold_seconds(_plan(load=(b,), restore=(a,))) == pytest.approx(1.5 + 0.5)
    assert book.cold_seconds(_plan(waiting=(a,))) == 0.0


# --------------------------------------------------------------------------- orders


def test_an_admissions_orders_go_in_the_plans_order_and_count_the_victims() -> None:
    book, (a, b, c, d_) = _book(("a", GiB), ("b", GiB), ("c", GiB), ("d", GiB))
    devs = _devices(3)
    d0, d1, d2 = devs.values()
    d2.worker = None  # its worker is gone: no order for it
    fn = _fn("u", (c, d_))
    plan = _plan(load=(d_,), restore=(c,), offload=(a,), evict=(b, "unknown@x"),
                 drop_host=((d1.key, a), (d2.key, b), ("n:9", c)))
    adm = book._orders(_inv(fn), d0, plan, devs, [])
    assert [(x.key, m) for x, m in adm.orders] == [
        (d1.key, p.EvictModel(a, False)),
        (d0.key, p.EvictModel(a, True)),
        (d0.key, p.EvictModel(b, False)),
        (d0.key, p.EvictModel("unknown@x", False)),
        (d0.key, p.LoadModel(c, {"restore": True, "name": "c"})),
        (d0.key, p.LoadModel(d_, {"name": "d", "memory": GiB}, (b"d-loader",))),
    ]
    assert (book.models[a].offloads, book.models[a].evictions) == (1, 0)
    assert (book.models[b].offloads, book.models[b].evictions) == (0, 1)
    assert "unknown@x" not in book.models  # a model no record names is not counted
    assert adm.names == {"c": c, "d": d_} and adm.cold == "loaded"


def test_an_admission_says_how_cold_it_was() -> None:
    book, (a,) = _book(("a", GiB))
    devs = _devices(1)
    (d0,) = devs.values()
    inv = _inv(_fn("u", (a,)))
    assert book._orders(inv, d0, _plan(restore=(a,)), devs, []).cold == "restored"
    assert book._orders(inv, d0, _plan(waiting=(a,)), devs, []).cold == "waited"
    assert book._orders(inv, d0, _plan(), devs, []).cold == ""


# --------------------------------------------------------------------------- events


def test_a_load_event_learns_the_size_and_counts_the_load(
        caplog: pytest.LogCaptureFixture) -> None:
    book, (a,) = _book(("a", 2 * GiB))
    d0, d1 = _devices(2).values()
    rec = book.models[a]
    rec.failing = 2  # it had failed before
    _loading(book, d0, a)
    assert _event(book, d0, a, p.ModelState.RESIDENT, 3 * GiB, 2.0) is True  # resized
    assert d0.ledger.state(a) is Residency.RESIDENT and d0.ledger.models[a].nbytes == 3 * GiB
    assert (rec.measured, rec.loads, rec.load_seconds, rec.failing) == (3 * GiB, 1, 2.0, 0)
    # 3 GiB is 50% over its 2 GiB estimate: said once, in the log
    [said] = [r.getMessage() for r in caplog.records if r.name == "gpufn.scheduler"]
    assert "50% over its estimate" in said
    _loading(book, d1, a)
    assert _event(book, d1, a, p.ModelState.RESIDENT, 3 * GiB, 4.0) is False  # the same size
    assert (rec.loads, rec.load_seconds, rec.restores) == (2, 6.0, 0)
    [row] = book.counters()
    assert (row["mean_load_s"], row["mean_restore_s"], row["restores"]) == (3.0, None, 0)


def test_a_restore_event_counts_the_restore_not_a_load() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    (d0,) = _devices(1).values()
    rec = book.models[a]
    _resident(book, d0, a)
    d0.ledger.offload_started(a, 0.0)
    assert _event(book, d0, a, p.ModelState.OFFLOADED) is False
    assert d0.ledger.state(a) is Residency.OFFLOADED
    d0.ledger.restore_started(a, 0.0)
    assert _event(book, d0, a, p.ModelState.RESIDENT, 2 * GiB, 0.5) is False
    assert d0.ledger.state(a) is Residency.RESIDENT and d0.ledger.models[a].reload_seconds == 0.5
    assert (rec.restores, rec.restore_seconds, rec.loads, rec.measured) == (1, 0.5, 0, 0)
    d0.ledger.offload_started(a, 0.0)
    _event(book, d0, a, p.ModelState.OFFLOADED)
    d0.ledger.restore_started(a, 0.0)
    _event(book, d0, a, p.ModelState.RESIDENT, 2 * GiB, 1.5)
    [row] = book.counters()
    assert (row["restores"], row["mean_restore_s"], row["mean_load_s"]) == (2, 1.0, None)


def test_a_failed_load_is_counted_with_its_message(caplog: pytest.LogCaptureFixture) -> None:
    book, (a,) = _book(("a", 2 * GiB))
    (d0,) = _devices(1).values()
    rec = book.models[a]
    for n in (1, 2):
        _loading(book, d0, a)
        assert _event(book, d0, a, p.ModelState.LOAD_FAILED, 0, 0.0, "RuntimeError",
                      f"boom {n}\ntraceback") is False
        assert d0.ledger.state(a) is Residency.ABSENT
        assert (rec.failures, rec.failing, rec.last_error) == (n, n, f"boom {n}\ntraceback")
    assert rec.measured == 0
    # logged with the message's first line only
    assert [r.getMessage() for r in caplog.records if r.name == "gpufn.scheduler"] == [
        f"model {a} on n:0: boom 1", f"model {a} on n:0: boom 2"]


def test_a_model_larger_than_declared_is_learned_and_its_waiting_calls_planned_again() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(1)
    (d0,) = devs.values()
    fn = _fn("u", (a,), memory="1GiB")
    inv, other = _inv(fn), _inv(fn)
    got = book.best_plan(inv, [d0], devs.values(), 0.0)
    assert got is not None
    book.admit(inv, d0, got[1], 0.0, devs)
    oom = kind_of(OutOfMemory)
    assert _event(book, d0, a, p.ModelState.LOAD_FAILED, 5 * GiB, 0.0, oom, "too big") is True
    rec = book.models[a]
    assert (rec.measured, rec.failures, rec.failing, rec.last_error) == (5 * GiB, 0, 0, "")
    failed = p.Result(inv.id, False, oom, "", p.ResultMeta())
    assert book.should_replan(inv, failed) is True
    assert book.should_replan(inv, failed) is False  # once
    assert book.should_replan(other, failed) is False  # only the calls that waited for it
    # no larger than what is known: an ordinary failure
    _loading(book, d0, a)
    assert _event(book, d0, a, p.ModelState.LOAD_FAILED, 5 * GiB, 0.0, oom, "again") is False
    assert (rec.measured, rec.failures, rec.failing) == (5 * GiB, 1, 1)


def test_only_an_out_of_memory_failure_of_a_waiting_call_is_planned_again() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(1)
    (d0,) = devs.values()
    fn = _fn("u", (a,), memory="1GiB")
    oom = kind_of(OutOfMemory)
    for result_ok, kind, replans, expected in ((True, "", 0, False), (False, "Boom", 0, False),
                                               (False, oom, 1, False), (False, oom, 0, True)):
        inv = _inv(fn)
        got = book.best_plan(inv, [d0], devs.values(), 0.0)
        assert got is not None
        book.admit(inv, d0, got[1], 0.0, devs)
        _event(book, d0, a, p.ModelState.LOAD_FAILED, book.models[a].size + 1, 0.0, oom, "x")
        d0.ledger.release(inv.id)
        inv.replans = replans
        assert book.should_replan(inv, p.Result(inv.id, result_ok, kind, "", p.ResultMeta())) \
            is expected


def test_offload_and_evict_events_move_the_ledger() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    (d0,) = _devices(1).values()
    host = d0.ledger.host
    assert host is not None
    _resident(book, d0, a)
    d0.ledger.offload_started(a, 0.0)
    _event(book, d0, a, p.ModelState.OFFLOAD_FAILED)
    assert d0.ledger.state(a) is Residency.ABSENT and host.used == 0
    _resident(book, d0, a)
    d0.ledger.offload_started(a, 0.0)
    _event(book, d0, a, p.ModelState.EVICTED)  # the worker dropped it instead
    assert d0.ledger.state(a) is Residency.ABSENT and host.used == 0
    _resident(book, d0, a)
    d0.ledger.evict_started(a, 0.0)
    _event(book, d0, a, p.ModelState.EVICTED)
    assert d0.ledger.state(a) is Residency.ABSENT
    _resident(book, d0, a)
    d0.ledger.offload_started(a, 0.0)
    _event(book, d0, a, p.ModelState.OFFLOADED)
    assert host.used == 2 * GiB
    _event(book, d0, a, p.ModelState.EVICTED)  # its host copy dropped
    assert d0.ledger.state(a) is Residency.ABSENT and host.used == 0


def test_a_stale_or_unknown_model_event_is_ignored() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    (d0,) = _devices(1).values()
    rec = book.models[a]
    # no entry on the device: nothing happens
    assert _event(book, d0, a, p.ModelState.RESIDENT, 3 * GiB, 1.0) is False
    assert _event(book, d0, a, p.ModelState.EVICTED) is False
    assert a not in d0.ledger.models and (rec.measured, rec.loads) == (0, 0)
    # a model the book has no record of (it outlived a restart) still moves its entry
    d0.ledger.adopt("old@x", GiB, 0.0)
    d0.ledger.evict_started("old@x", 0.0)
    assert _event(book, d0, "old@x", p.ModelState.EVICTED) is False
    assert d0.ledger.state("old@x") is Residency.ABSENT


# --------------------------------------------------------------------------- status


def test_device_status_lists_the_models_on_a_device() -> None:
    book, (a, b) = _book(("a", 2 * GiB), ("b", GiB))
    (d0,) = _devices(1).values()
    _resident(book, d0, a)
    d0.ledger.acquire("i1", [ModelNeed(a)], 3.0, function="u")
    _loading(book, d0, b)
    d0.ledger.adopt("old@x", GiB, 0.0)
    d0.ledger.evict_started("old@x", 0.0)
    d0.ledger.evict_done("old@x", 0.0)  # absent: not listed
    d0.ledger.models[b].shards = (d0.key, "n:1")
    rows = book.device_status(d0)
    assert rows == [
        {"name": "a", "key": a, "state": "resident", "nbytes": 2 * GiB, "measured": True,
         "users": ["u"], "in_use": 1, "uses": 1, "pinned": False, "load_s": 1.0,
         "reload_s": None},
        {"name": "b", "key": b, "state": "loading", "nbytes": GiB, "measured": False,
         "users": [], "in_use": 0, "uses": 0, "pinned": False, "load_s": None,
         "reload_s": None, "shards": [d0.key, "n:1"]},
    ]
    d0.ledger.adopt("kept@y", GiB, 0.0)  # no record: named by its key
    assert book.device_status(d0)[-1]["name"] == "kept@y"


def test_counters_show_each_model_once_with_its_shards_bytes() -> None:
    book, (a, s) = _book(("a", 2 * GiB), ("s", 4 * GiB))
    devs = _devices(3)
    d0, d1, d2 = devs.values()
    book.models[s].count = 2
    book.models[s].holder = Holder((d0.key, d1.key, "n:9"), ("g", 1))
    _resident(book, d0, s)
    _loading(book, d1, s)
    d1.ledger.load_failed(s, 0.0)  # absent on d1: no bytes
    book.models[a].offloads, book.models[a].evictions, book.models[a].failures = 3, 4, 5
    rows = {r["name"]: r for r in book.counters(devs)}
    assert rows["a"] == {"name": "a", "shard_bytes": None, "key": a, "bytes": 2 * GiB,
                         "loads": 0, "count": 1, "gang": None, "mean_load_s": None,
                         "restores": 0, "mean_restore_s": None, "offloads": 3,
                         "evictions": 4, "failures": 5}
    assert rows["s"]["shard_bytes"] == {d0.key: 4 * GiB}
    assert rows["s"]["gang"] == [d0.key, d1.key, "n:9"] and rows["s"]["count"] == 2
    assert {r["name"]: r["shard_bytes"] for r in book.counters()} == {"a": None, "s": None}
    _ = d2


# --------------------------------------------------------------------------- planning


def test_planning_prefers_the_device_with_more_room_left_when_all_else_ties() -> None:
    """Two devices holding the model, both idle: the one left with more free bytes wins,
    also when it is planned second (the bound that skips a device must not skip it)."""
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(2)
    d0, d1 = devs.values()
    for d in (d0, d1):
        _resident(book, d, a)
    d0.ledger.reserve("other", GiB)  # less room left on d0
    inv = _inv(_fn("u", (a,), memory="1GiB"))
    for order in ([d0, d1], [d1, d0]):
        got = book.best_plan(inv, order, devs.values(), 0.0)
        assert got is not None and got[0] is d1, order
        got = book.best_plan_by_drain(inv, [(0.0, d) for d in order], lambda d: True,
                                      devs.values(), 0.0)
        assert got is not None and got[0] is d1, order


def test_a_call_joining_a_load_in_flight_does_not_wait_for_another_device() -> None:
    """The call's first model is loading on d0 already (its second must load too); d1
    holds both and is idle but not a candidate: the call joins d0's load, while a call
    with nothing in flight would rather wait for d1."""
    book, (a, b) = _book(("a", 2 * GiB), ("b", 2 * GiB))
    devs = _devices(2)
    d0, d1 = devs.values()
    for k in (a, b):
        _resident(book, d1, k)
    fn = _fn("u", (a, b), memory="1GiB")
    assert book.best_plan(_inv(fn), [d0], devs.values(), 0.0) is None  # d1 is free sooner
    _loading(book, d0, a)
    got = book.best_plan(_inv(fn), [d0], devs.values(), 0.0)
    assert got is not None and got[0] is d0
    assert got[1].waiting == (a,) and got[1].load == (b,)


def test_a_device_nothing_happened_on_is_not_planned_again() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(1)
    (d0,) = devs.values()
    calls = []
    real_fit = d0.ledger.fit

    def counted(req: Request, *args: Any, **kw: Any) -> Any:
        calls.append(req)
        return real_fit(req, *args, **kw)

    d0.ledger.fit = counted  # type: ignore[method-assign]
    fn = _fn("u", (a,), memory="1GiB")
    first = book.best_plan(_inv(fn), [d0], devs.values(), 0.0)
    again = book.best_plan(_inv(fn), [d0], devs.values(), 0.0)  # the same request
    assert len(calls) == 1 and first is not None and again is not None
    assert again[1] is first[1]
    d0.ledger.reserve("other", GiB)  # the ledger changed: planned again
    third = book.best_plan(_inv(fn), [d0], devs.values(), 0.0)
    assert len(calls) == 2 and third is not None and third[1].free_after == first[1].free_after - GiB


def test_the_remembered_plans_are_dropped_past_their_bound() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(1)
    (d0,) = devs.values()
    inv = _inv(_fn("u", (a,), memory="1GiB"))
    book._fits = {(f"n:{i}", Request()): ((0, 0), None) for i in range(65536)}
    book.best_plan(inv, [d0], devs.values(), 0.0)
    assert len(book._fits) == 65537  # at the bound: kept
    book.best_plan(_inv(_fn("v", (a,), memory="2GiB")), [d0], devs.values(), 0.0)
    assert len(book._fits) == 1  # past it: only the newest


# --------------------------------------------------------------------------- shards


def _sharded_book(devices: int = 4, size: int = 2 * GiB) -> tuple[ModelBook, str, dict[str, Device]]:
    """A book whose 2-way sharded model `s` is resident on n:0 and n:1, loaded in the
    group that both devices' workers still hold."""
    book, _ = _book(("w", GiB))  # a whole model first, which the gang planning passes over
    (s,) = book.register([{"name": "s", "code_id": "s-code", "memory": size, "nframes": 1,
                           "count": 2}], (b"s-loader",))
    devs = _devices(devices)
    formed, _ = book.gangs.form(("n:0", "n:1"))  # both workers hold its group now
    book.models[s].holder = Holder(("n:0", "n:1"), (formed.gang_id, formed.generation))
    for k in ("n:0", "n:1"):
        _resident(book, devs[k], s)
        devs[k].ledger.models[s].shards = ("n:0", "n:1")
    return book, s, devs


def _busy(d: Device, seconds: float) -> None:
    fn = _fn(f"busy-{d.key}")
    fn.observe_runtime(seconds, d.key)
    inv = _inv(fn)
    inv.start(0.0, (d.key,), 1, Shape.SINGLE)
    d.running[inv.id] = inv


def test_a_gang_call_goes_to_the_gang_holding_its_shards() -> None:
    book, s, devs = _sharded_book()
    fn = _fn("gen", (s,), count=2)
    fn.warm_gang = ("n:3", "n:2")
    inv = _inv(fn)
    assert book.valid(book.models[s])
    every = set(devs)
    assert book.gang_choice(inv, every, devs, 0.0) == (("n:0", "n:1"), ())
    # also named after a sharded model loaded nowhere yet
    (new,) = book.register([{"name": "new", "code_id": "new-code", "memory": GiB,
                             "nframes": 1, "count": 2}], (b"new-loader",))
    both = _inv(_fn("gen2", (new, s), count=2))
    assert book.gang_choice(both, every, devs, 0.0) == (("n:0", "n:1"), ())
    # without sharded models: its last gang, preferred again
    plain = _inv(_fn("plain", count=2))
    plain.function.warm_gang = ("n:3", "n:2")
    assert book.gang_choice(plain, every, devs, 0.0) == (("n:3", "n:2"), ())
    # a holding device busy: move the model when the gang frees later than it would load
    _busy(devs["n:1"], 100.0)
    assert book.gang_choice(inv, every - {"n:1"}, devs, 0.0) == ((), ("n:0", "n:1"))
    # ... but not while a shard is in use there, or pinned
    devs["n:0"].ledger.acquire("x", [ModelNeed(s)], 0.0)
    assert book.gang_choice(inv, every - {"n:1"}, devs, 0.0) is None
    devs["n:0"].ledger.release("x")
    devs["n:0"].ledger.models[s].pinned = True
    assert book.gang_choice(inv, every - {"n:1"}, devs, 0.0) is None


def test_a_gang_call_waits_for_its_shards_gang_when_it_frees_sooner_than_a_load() -> None:
    book, s, devs = _sharded_book(size=6 * GiB)  # a load: 1 s + 6 GiB at 1 GiB/s = 7 s
    inv = _inv(_fn("gen", (s,), count=2))
    every = set(devs)
    _busy(devs["n:1"], 7.0)
    assert book.gang_choice(inv, every - {"n:1"}, devs, 0.0) is None  # exactly the load
    devs["n:1"].running.clear()
    _busy(devs["n:1"], 7.5)
    assert book.gang_choice(inv, every - {"n:1"}, devs, 0.0) == ((), ("n:0", "n:1"))
    book.models[s].loads, book.models[s].load_seconds = 4, 2.0  # measured: 0.5 s a load
    devs["n:1"].running.clear()
    _busy(devs["n:1"], 1.0)
    assert book.gang_choice(inv, every - {"n:1"}, devs, 0.0) == ((), ("n:0", "n:1"))
    book.gangs.held["n:1"] = ("g9", 1)  # n:1's worker joined another group: stale shards
    assert not book.valid(book.models[s])
    assert book.gang_choice(inv, every, devs, 0.0) is None  # wait for the sweep


def test_a_loader_failing_on_a_rank_makes_the_shards_partial() -> None:
    book, s, devs = _sharded_book()
    rec = book.models[s]
    # a failure on a device outside the holder's gang says nothing of its shards
    _loading(book, devs["n:2"], s)
    _event(book, devs["n:2"], s, p.ModelState.LOAD_FAILED, 0, 0.0, "RuntimeError", "x")
    assert rec.holder is not None and not rec.holder.failed and book.valid(rec)
    devs["n:1"].ledger.evict_started(s, 0.0)
    devs["n:1"].ledger.evict_done(s, 0.0)
    _loading(book, devs["n:1"], s)
    _event(book, devs["n:1"], s, p.ModelState.LOAD_FAILED, 0, 0.0, "RuntimeError", "x")
    assert rec.holder.failed and not book.valid(rec)


def test_a_sharded_models_load_and_restore_count_once_on_rank_zero() -> None:
    book, (s,) = _book(("s", 2 * GiB), count=2)
    devs = _devices(2)
    rec = book.models[s]
    rec.holder = Holder(("n:1", "n:0"), ("g0", 1))  # rank 0 is n:1
    for k, seconds, nbytes in (("n:1", 2.0, 3 * GiB), ("n:0", 5.0, 2 * GiB)):
        _loading(book, devs[k], s)
        _event(book, devs[k], s, p.ModelState.RESIDENT, nbytes, seconds)
    assert (rec.loads, rec.load_seconds) == (1, 2.0)
    assert rec.measured == 3 * GiB  # the largest shard plans the gang
    for k, seconds in (("n:0", 3.0), ("n:1", 1.0)):
        led = devs[k].ledger
        led.offload_started(s, 0.0)
        led.offload_done(s, 0.0)
        led.restore_started(s, 0.0)
        _event(book, devs[k], s, p.ModelState.RESIDENT, 0, seconds)
    assert (rec.restores, rec.restore_seconds) == (1, 1.0)
    # loaded again, smaller: rank 0's report sets the size afresh, the others' only raise it
    for k in ("n:1", "n:0"):
        devs[k].ledger.evict_started(s, 0.0)
        devs[k].ledger.evict_done(s, 0.0)
    _loading(book, devs["n:1"], s)
    _event(book, devs["n:1"], s, p.ModelState.RESIDENT, GiB, 1.0)
    assert rec.measured == GiB
    _loading(book, devs["n:0"], s)
    _event(book, devs["n:0"], s, p.ModelState.RESIDENT, GiB // 2, 1.0)
    assert rec.measured == GiB and rec.loads == 2


def test_stale_shards_are_swept_where_they_can_be_and_kept_track_of_where_not() -> None:
    book, s, devs = _sharded_book()
    rec = book.models[s]
    book.gangs.held.pop("n:1")  # n:1's worker restarted: the group is gone
    devs["n:0"].ledger.acquire("call", [ModelNeed(s)], 0.0)  # still in use on n:0
    devs["n:1"].ledger.evict_started(s, 0.0)
    devs["n:1"].ledger.evict_done(s, 0.0)
    _loading(book, devs["n:1"], s)  # a load no call waits for
    orders = book.sweep(devs, 0.0)
    assert [(d.key, m) for d, m in orders] == [("n:1", p.EvictModel(s, False))]
    assert devs["n:1"].ledger.state(s) is Residency.ABSENT
    assert devs["n:0"].ledger.state(s) is Residency.RESIDENT
    assert rec.holder is not None and rec.evictions == 1  # n:0's shard is still to go
    devs["n:0"].ledger.release("call")
    orders = book.sweep(devs, 0.0)
    assert [(d.key, m) for d, m in orders] == [("n:0", p.EvictModel(s, False))]
    assert devs["n:0"].ledger.state(s) is Residency.EVICTING
    assert rec.holder is None and rec.evictions == 2


def test_a_new_gang_over_a_shards_devices_plans_them_out() -> None:
    """Shards of s on n:0 and n:1; a gang call formed on n:1 and n:2 (a new group: n:1
    leaves s's) plans s out of n:1 and its sibling on n:0, though there is room."""
    book, s, devs = _sharded_book()
    (t,) = book.register([{"name": "t", "code_id": "t-code", "memory": GiB, "nframes": 1}],
                         (b"t-loader",))
    inv = _inv(_fn("other", (t,), count=2))
    plans = book.gang_plans(inv, [devs["n:1"], devs["n:2"]], devs)
    assert plans is not None and plans["n:1"].evict == (s,) and plans["n:1"].load == (t,)
    assert plans["n:2"].victims == () and book._joint[inv.id].outside == (("n:0", s, "evict"),)
    # a gang elsewhere leaves s alone
    away = _inv(_fn("other", (t,), count=2))
    plans = book.gang_plans(away, [devs["n:2"], devs["n:3"]], devs)
    assert plans is not None and not any(x.victims for x in plans.values())
    assert book._joint[away.id].outside == ()
    # s's own gang call formed elsewhere loads s there (the old shards go by `sweep` once
    # the new gang holds them)
    moving = _inv(_fn("gen", (s,), count=2))
    plans = book.gang_plans(moving, [devs["n:2"], devs["n:3"]], devs)
    assert plans is not None and all(x.load == (s,) for x in plans.values())
    assert book._joint[moving.id].outside == ()


def test_a_batch_carrier_admits_the_joint_plan_its_head_was_planned_with() -> None:
    book, s, devs = _sharded_book()
    fn = _fn("gen", (s,), count=2)
    head, carrier = _inv(fn), _inv(fn)
    gang = [devs["n:0"], devs["n:1"]]
    plans = book.gang_plans(head, gang, devs)
    assert plans is not None and set(book._joint) == {head.id}
    carrier.members = [head]
    carrier.devices = ("n:0", "n:1")
    for d in gang:
        adm = book.admit(carrier, d, plans[d.key], 0.0, devs)
        assert adm.orders == () and adm.cold == ""  # its shards are there
        assert d.ledger.holds[carrier.id] == (s,)
    assert book._joint == {}  # kept only until the gang's last device admitted


def test_a_joint_plans_outside_orders_go_with_the_gangs_first_device() -> None:
    """A gang on n:0 and n:1 planned as one: sibling shards outside it leave as the joint
    plan says (a host copy dropped, a shard offloaded, one evicted; no order to a device
    without a worker), once, with the first device's admission; every device admits its
    part of the joint plan (not the plan it was handed), and the plan is then let go."""
    book, (a, b, c) = _book(("a", GiB), ("b", GiB), ("c", GiB))
    devs = _devices(5)
    _resident(book, devs["n:2"], a)
    devs["n:2"].ledger.offload_started(a, 0.0)
    devs["n:2"].ledger.offload_done(a, 0.0)
    _resident(book, devs["n:3"], b)
    _resident(book, devs["n:4"], c)
    devs["n:4"].worker = None
    inv = _inv(_fn("gen", count=2, memory="1GiB"))
    inv.devices = ("n:0", "n:1")
    plans = {k: devs[k].ledger.fit(Request((), GiB, "gen")) for k in inv.devices}
    assert all(isinstance(x, Fit) for x in plans.values())
    book._joint[inv.id] = GroupFit(
        plans, (("n:2", a, "drop"), ("n:3", b, "offload"), ("n:4", c, "evict")),  # type: ignore[arg-type]
        tuple((k, d.ledger._version()) for k, d in sorted(devs.items())))
    handed = devs["n:1"].ledger.fit(Request((), 0, "gen"))  # not the joint plan
    assert isinstance(handed, Fit)
    first = book.admit(inv, devs["n:0"], handed, 0.0, devs)
    assert [(d.key, m) for d, m in first.orders] == [
        ("n:2", p.EvictModel(a, False)), ("n:3", p.EvictModel(b, True))]
    assert [devs[k].ledger.state(m) for k, m in (("n:2", a), ("n:3", b), ("n:4", c))] == [
        Residency.ABSENT, Residency.OFFLOADING, Residency.EVICTING]
    assert [(book.models[m].offloads, book.models[m].evictions) for m in (a, b, c)] == [
        (0, 0), (1, 0), (0, 1)]
    handed = devs["n:1"].ledger.fit(Request((), 0, "gen"))  # fresh, but not the joint plan
    assert isinstance(handed, Fit)
    second = book.admit(inv, devs["n:1"], handed, 0.0, devs)
    assert second.orders == ()
    assert devs["n:0"].ledger.workspace[inv.id] == devs["n:1"].ledger.workspace[inv.id] == GiB
    assert book._joint == {}


def _joint_plans_of_another_model(
) -> tuple[ModelBook, str, str, dict[str, Device], Any, Any]:
    """A sharded model on n:0 and n:1, and a 2-rank call of another model planned on
    n:1 and n:2 (which must evict the shards: the joint plan)."""
    book, s, devs = _sharded_book()
    (t,) = book.register([{"name": "t", "code_id": "t-code", "memory": GiB, "nframes": 1}],
                         (b"t-loader",))
    inv = _inv(_fn("other", (t,), count=2))
    inv.devices = ("n:1", "n:2")
    plans = book.gang_plans(inv, [devs["n:1"], devs["n:2"]], devs)
    return book, s, t, devs, inv, plans


def test_a_joint_plan_that_no_longer_fits_is_not_admitted() -> None:
    book, s, _, devs, inv, plans = _joint_plans_of_another_model()
    assert plans is not None
    devs["n:0"].ledger.acquire("late", [ModelNeed(s)], 0.0)  # the sibling shard is busy now
    with pytest.raises(StaleFit):
        book.admit(inv, devs["n:1"], plans["n:1"], 0.0, devs)
    assert devs["n:0"].ledger.state(s) is Residency.RESIDENT


def test_a_joint_plan_made_again_when_a_ledger_changed_is_admitted() -> None:
    book, s, t, devs, inv, plans = _joint_plans_of_another_model()
    assert plans is not None and book._joint[inv.id].outside == (("n:0", s, "evict"),)
    devs["n:0"].ledger.reserve("late", GiB)  # changed, but the plan still fits
    adm = book.admit(inv, devs["n:1"], plans["n:1"], 0.0, devs)
    assert [(d.key, m) for d, m in adm.orders] == [
        ("n:0", p.EvictModel(s, False)), ("n:1", p.EvictModel(s, False)),
        ("n:1", p.LoadModel(t, {"name": "t", "memory": GiB}, (b"t-loader",)))]


def test_a_gang_without_shards_anywhere_is_planned_device_by_device() -> None:
    book, (a,) = _book(("a", 6 * GiB))
    devs = _devices(3)
    inv = _inv(_fn("gen", (a,), count=2, memory="1GiB"))
    plans = book.gang_plans(inv, [devs["n:0"], devs["n:1"]], devs)
    assert plans is not None and sorted(plans) == ["n:0", "n:1"]
    assert all(x.load == (a,) for x in plans.values()) and book._joint == {}
    devs["n:2"].ledger.reserve("big", 4 * GiB)  # 6 GiB + 1 GiB no longer fit there
    assert book.gang_plans(inv, [devs["n:0"], devs["n:2"]], devs) is None
    assert book.gang_plans(inv, [devs["n:2"], devs["n:0"]], devs) is None


def test_never_fits_names_the_device_closest_to_fitting() -> None:
    book, (a,) = _book(("a", 20 * GiB))
    devs = _devices(3)
    devs["n:1"].ledger.capacity = 16 * GiB
    devs["n:2"].ledger.capacity = 16 * GiB
    why = book.never_fits(_fn("big", (a,)), 0, devs.values())
    assert why is not None and "best device (n:1)" in why and why.startswith("big with models [a]")
    why = book.never_fits(_fn("big", (a,)), 0, [devs["n:2"], devs["n:1"], devs["n:0"]])
    assert why is not None and "best device (n:1)" in why  # a tie goes to the first key
    assert book.never_fits(_fn("none"), 0, devs.values()) is None  # no models
    assert book.never_fits(_fn("big", (a,)), 0, []) is None  # no devices yet
    devs["n:2"].ledger.capacity = 32 * GiB
    assert book.never_fits(_fn("big", (a,)), 0, devs.values()) is None  # one device holds it


def test_an_eviction_event_for_a_model_resident_again_is_ignored() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    (d0,) = _devices(1).values()
    _resident(book, d0, a)
    assert _event(book, d0, a, p.ModelState.EVICTED) is False
    assert d0.ledger.state(a) is Residency.RESIDENT


def test_a_single_device_call_passes_over_a_device_whose_shards_cannot_leave() -> None:
    """s's shards on n:0 and n:1 are in use on n:1: a call that needs n:0's room goes to
    n:2, whichever device is looked at first."""
    book, s, devs = _sharded_book(devices=3, size=6 * GiB)
    (t,) = book.register([{"name": "t", "code_id": "t-code", "memory": 4 * GiB, "nframes": 1}],
                         (b"t-loader",))
    devs["n:1"].ledger.acquire("busy", [ModelNeed(s)], 0.0)
    inv = _inv(_fn("one", (t,)))
    for order in ([devs["n:0"], devs["n:2"]], [devs["n:2"], devs["n:0"]]):
        got = book.best_plan(inv, order, devs.values(), 0.0)
        assert got is not None and got[0].key == "n:2" and got[1].load == (t,)


def test_one_model_moves_at_a_time_on_a_device() -> None:
    """While another model loads on d0, a call that would load, restore or evict there
    waits; a call whose models are all there still runs."""
    book, (a, x) = _book(("a", 2 * GiB), ("x", 2 * GiB))
    devs = _devices(1)
    (d0,) = devs.values()
    _loading(book, d0, x)
    assert book.best_plan(_inv(_fn("u", (a,))), [d0], devs.values(), 0.0) is None
    (c,) = book.register([{"name": "c", "code_id": "c-code", "memory": GiB, "nframes": 1}],
                         (b"c-loader",))
    _put(book, d0, c, "offloaded")  # a restore only: it waits too
    assert book.best_plan(_inv(_fn("w", (c,))), [d0], devs.values(), 0.0) is None
    spare = _devices(2)["n:1"]
    _busy(spare, 100.0)  # busy a long while, but no model moving there
    got = book.best_plan(_inv(_fn("u", (a,))), [d0, spare], [d0, spare], 0.0)
    assert got is not None and got[0] is spare
    d0.ledger.load_done(x, 0.0, 2 * GiB, 1.0)
    _resident(book, d0, a)
    d0.ledger.evict_started(x, 0.0)  # x leaves: a, resident, is a hit
    got = book.best_plan(_inv(_fn("u", (a,))), [d0], devs.values(), 0.0)
    assert got is not None and not (got[1].load or got[1].restore or got[1].victims)


def test_waiting_for_the_holding_device_only_while_it_frees_before_a_load() -> None:
    """A load of a here takes 3 s (1 s + 2 GiB at 1 GiB/s): d1, holding a, frees in
    exactly 3 s: not sooner, so the call loads a copy here; a shade sooner, it waits."""
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(2)
    d0, d1 = devs.values()
    _resident(book, d1, a)
    fn = _fn("u", (a,))
    _busy(d1, 3.0)
    got = book.best_plan(_inv(fn), [d0], devs.values(), 0.0)
    assert got is not None and got[0] is d0
    d1.running.clear()
    _busy(d1, 2.9)
    assert book.best_plan(_inv(fn), [d0], devs.values(), 0.0) is None
    d1.state = DeviceState.RESTARTING  # its worker is gone: no reason to wait for it
    got = book.best_plan(_inv(fn), [d0], devs.values(), 0.0)
    assert got is not None and got[0] is d0
    d1.state = DeviceState.READY
    got = book.best_plan(_inv(fn), [d0, d1], devs.values(), 0.0)  # both candidates
    assert got is not None


def _put(book: ModelBook, d: Device, key: str, state: str) -> None:
    if state == "resident":
        _resident(book, d, key)
    elif state == "loading":
        _loading(book, d, key)
    elif state == "offloaded":
        _resident(book, d, key)
        d.ledger.offload_started(key, 0.0)
        d.ledger.offload_done(key, 0.0)


@pytest.mark.parametrize(("better", "worse"), [
    ("resident", "absent"), ("resident", "offloaded"), ("offloaded", "absent"),
    ("loading", "absent"), ("resident", "loading"), ("loading", "offloaded")])
def test_the_device_where_the_models_are_closest_wins_whichever_is_looked_at_first(
        better: str, worse: str) -> None:
    """Resident, then loading there already, then on host, then absent: the cheaper device
    is chosen also when the worse one is planned first (a device is skipped only when its
    least possible cost is already worse than the best found)."""
    book, (a, b) = _book(("a", 2 * GiB), ("b", GiB))
    devs = _devices(2)
    d0, d1 = devs.values()
    _put(book, d0, a, better)
    _put(book, d1, a, worse)
    for k in (b,):  # b is resident on both: only a's place decides
        _resident(book, d0, k)
        _resident(book, d1, k)
    inv = _inv(_fn("u", (b, a), memory="1GiB"))
    for order in ([d0, d1], [d1, d0]):
        got = book.best_plan(inv, order, devs.values(), 0.0)
        assert got is not None and got[0] is d0, (order, got)
        got = book.best_plan_by_drain(inv, [(0.0, x) for x in order], lambda x: True,
                                      devs.values(), 0.0)
        assert got is not None and got[0] is d0, (order, got)


def test_a_device_that_frees_sooner_wins_whichever_is_looked_at_first() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(2)
    d0, d1 = devs.values()
    for d in (d0, d1):
        _resident(book, d, a)
    _busy(d1, 5.0)
    _busy(d0, 1.0)
    inv = _inv(_fn("u", (a,), memory="1GiB"))
    for order in ([d0, d1], [d1, d0]):
        got = book.best_plan(inv, order, devs.values(), 0.0)
        assert got is not None and got[0] is d0, order
    # ordered by drain, the search stops at the first device whose drain alone is worse
    got = book.best_plan_by_drain(inv, [(1.0, d0), (5.0, d1)], lambda x: True, devs.values(), 0.0)
    assert got is not None and got[0] is d0


def test_a_stale_shards_host_copy_is_dropped_and_a_device_without_a_worker_waits() -> None:
    book, (w,) = _book(("w", GiB))  # a whole model first: passed over
    (s,) = book.register([{"name": "s", "code_id": "s-code", "memory": 2 * GiB, "nframes": 1,
                           "count": 3}], (b"s-loader",))
    devs = _devices(4)
    rec = book.models[s]
    # no device holds g0 any more; n:9 (its node gone) is no device at all now, and n:3
    # (a new ledger since) has no entry for it
    rec.holder = Holder(("n:9", "n:3", "n:2", "n:0", "n:1"), ("g0", 1))
    for k in ("n:2", "n:0", "n:1"):
        _resident(book, devs[k], s)
    _resident(book, devs["n:3"], w)
    host = devs["n:0"].ledger.host
    assert host is not None
    devs["n:0"].ledger.offload_started(s, 0.0)
    devs["n:0"].ledger.offload_done(s, 0.0)
    devs["n:1"].worker = None  # its worker is gone (the device is reset when it is back)
    devs["n:2"].ledger.evict_started(s, 0.0)  # on its way out already
    orders = book.sweep(devs, 0.0)
    assert [(d.key, m) for d, m in orders] == [("n:0", p.EvictModel(s, False))]
    assert devs["n:0"].ledger.state(s) is Residency.ABSENT and host.used == 0
    assert devs["n:1"].ledger.state(s) is Residency.RESIDENT
    assert rec.holder is not None and rec.evictions == 1
    assert book.sweep(devs, 0.0) == [] and rec.evictions == 1
    devs["n:1"].worker = b"w1"
    assert [(d.key, m) for d, m in book.sweep(devs, 0.0)] == [("n:1", p.EvictModel(s, False))]
    assert rec.holder is None and rec.evictions == 2
    assert devs["n:3"].ledger.state(w) is Residency.RESIDENT  # a whole model is not swept


def test_a_device_where_nothing_fits_is_passed_over() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(2)
    d0, d1 = devs.values()
    d0.ledger.reserve("big", 7 * GiB)  # 1 GiB left: 2 GiB + 1 GiB cannot fit now
    _busy(d1, 100.0)
    inv = _inv(_fn("u", (a,), memory="1GiB"))
    got = book.best_plan(inv, [d0, d1], devs.values(), 0.0)
    assert got is not None and got[0] is d1


def test_a_host_copy_with_fewer_bytes_to_bring_back_wins() -> None:
    """Sizes are measured per device: the device whose host copy is smaller restores
    fewer bytes, whichever device is looked at first."""
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(2)
    d0, d1 = devs.values()
    for d, nbytes in ((d0, 1 * GiB), (d1, 2 * GiB)):
        _loading(book, d, a)
        d.ledger.load_done(a, 0.0, nbytes, 1.0)
        d.ledger.offload_started(a, 0.0)
        d.ledger.offload_done(a, 0.0)
    book.models[a].measured = 3 * GiB  # the largest seen anywhere
    inv = _inv(_fn("u", (a,), memory="1GiB"))
    for order in ([d0, d1], [d1, d0]):
        got = book.best_plan(inv, order, devs.values(), 0.0)
        assert got is not None and got[0] is d0 and got[1].restore_bytes == GiB, order


def test_even_a_quick_restore_waits_for_a_device_that_frees_sooner() -> None:
    book, (a,) = _book(("a", 4 * GiB))  # restored in 0.5 s (4 GiB at 8 GiB/s)
    devs = _devices(2)
    d0, d1 = devs.values()
    _resident(book, d0, a)
    d0.ledger.offload_started(a, 0.0)
    d0.ledger.offload_done(a, 0.0)
    _resident(book, d1, a)
    _busy(d1, 0.1)
    assert book.best_plan(_inv(_fn("u", (a,))), [d0], devs.values(), 0.0) is None


def test_a_gang_call_on_the_warm_gang_holding_its_shards_uses_them() -> None:
    book, s, devs = _sharded_book()
    inv = _inv(_fn("gen", (s,), count=2))
    plans = book.gang_plans(inv, [devs["n:0"], devs["n:1"]], devs)
    assert plans is not None
    assert all(x.resident == (s,) and not (x.load or x.victims) for x in plans.values())
    assert book._joint[inv.id].outside == ()


def test_a_plan_made_before_the_ledger_changed_is_made_again_at_admission() -> None:
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(1)
    (d0,) = devs.values()
    inv = _inv(_fn("u", (a,), memory="1GiB"))
    got = book.best_plan(inv, [d0], devs.values(), 0.0)
    assert got is not None
    d0.ledger.reserve("other", GiB)  # the plan is stale now, but a fresh one fits
    adm = book.admit(inv, d0, got[1], 0.0, devs)
    assert [m for _, m in adm.orders] == [p.LoadModel(a, {"name": "a", "memory": 2 * GiB},
                                                      (b"a-loader",))]
    assert d0.ledger.workspace[inv.id] == GiB and d0.ledger.state(a) is Residency.LOADING
    late = _inv(_fn("v", (a,), memory="4GiB"))
    plan = d0.ledger.fit(book.request(late))
    assert isinstance(plan, Fit)
    d0.ledger.reserve("more", 2 * GiB)  # now it no longer fits at all
    with pytest.raises(StaleFit):
        book.admit(late, d0, plan, 0.0, devs)


def test_a_measured_restore_time_is_weighed_against_a_load() -> None:
    """a's restores took 1.5 s on average: its host copy on d1 beats loading it on d0
    (3 s), whichever device is looked at first."""
    book, (a,) = _book(("a", 2 * GiB))
    devs = _devices(2)
    d0, d1 = devs.values()
    _put(book, d1, a, "offloaded")
    book.models[a].restores, book.models[a].restore_seconds = 2, 3.0
    inv = _inv(_fn("u", (a,), memory="1GiB"))
    for order in ([d0, d1], [d1, d0]):
        got = book.best_plan(inv, order, devs.values(), 0.0)
        assert got is not None and got[0] is d1 and got[1].restore == (a,), order
