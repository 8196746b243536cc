"""The placement pass's index of open devices (`open_index.OpenIndex`) and the model
book's ordered plan search give exactly what the full scans give (`rank_devices`,
`ModelBook.best_plan`), also after random load changes moved devices in the index."""

from __future__ import annotations

import random

from gpufn.memory_pool.ledger import DeviceLedger, Fit, HostLedger
from gpufn.memory_pool.probe import DeviceInfo
from gpufn.memory_pool.residency import Residency
from gpufn.scheduler.books.model_book import ModelBook
from gpufn.scheduler.nouns.records import Device, FunctionRecord, Invocation, drain_seconds
from gpufn.scheduler.nouns.shapes import Shape
from gpufn.scheduler.nouns.states import DeviceState
from gpufn.scheduler.placement.device_fit import rank_devices
from gpufn.scheduler.placement.open_index import OpenIndex, estimate_bounds
from gpufn.wire.spec import make_spec

GiB = 2**30
SLOTS = 4
NAMES = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "cpu")
_seq = 0


def _devices(rng: random.Random, n: int) -> list[Device]:
    out = []
    hosts = [HostLedger(64 * GiB) for _ in range(3)]
    for i in range(n):
        node = i % 3
        mem = rng.choice((16, 80)) * GiB
        info = DeviceInfo(f"n{node}", i, rng.choice(NAMES), f"u{i}", mem, mem, "cpu")
        d = Device(info=info, supervisor=b"s", ledger=DeviceLedger(mem, host=hosts[node], key=info.key))
        d.state, d.worker = DeviceState.READY, f"w{i}".encode()
        out.append(d)
    return out


def _fn(i: int, **options: object) -> FunctionRecord:
    return FunctionRecord(f"f{i}", f"code{i}", f"f{i}", make_spec(**options), (b"c",))  # type: ignore[arg-type]


def _start(d: Device, fn: FunctionRecord, now: float) -> Invocation:
    global _seq
    _seq += 1
    inv = Invocation(f"i{_seq}", fn, b"c", fn.spec, (), now, _seq)
    inv.start(now, (d.key,), _seq, Shape.SINGLE)
    d.running[inv.id] = inv
    d.running_by_fn[fn.code_id] += 1
    d.ledger.reserve(inv.id, fn.spec.memory)
    return inv


def _stop(d: Device, inv: Invocation) -> None:
    del d.running[inv.id]
    d.running_by_fn[inv.function.code_id] -= 1
    d.ledger.release(inv.id)


def _observe(rng: random.Random, fns: list[FunctionRecord], devs: list[Device], uniform: bool) -> None:
    for fn in fns:
        for _ in range(rng.randrange(0, 6)):
            secs = 0.001 if uniform else rng.choice((0.001, 0.002, 0.5, rng.random()))
            fn.observe_runtime(secs, rng.choice(devs).key if rng.random() < 0.8 else "")


def _is_open(d: Device) -> bool:
    return len(d.running) < SLOTS and d.takes_work


def _check_all(index: OpenIndex, devs: list[Device], fns: list[FunctionRecord], now: float,
               drains: dict[str, float], cache: dict[str, tuple[object, float, bool]],
               rng: random.Random) -> None:
    open_ = [d for d in devs if _is_open(d)]
    for fn in fns:
        spec = fn.spec
        avoid = {d.key for d in devs if rng.random() < 0.2}
        for memory, usable in ((spec.memory, None), (0, lambda d, avoid=avoid: d.key not in avoid)):
            ranked = rank_devices(spec, fn, open_, SLOTS, 0, check_memory=bool(memory), now=now)
            want = next((d for d in ranked if usable is None or usable(d)), None)
            lo, uniform = estimate_bounds(fn, cache)
            got = index.best(fn, spec.type, spec.concurrency, memory, lo, uniform, usable)
            assert got is want, (fn.name, got and got.key, want and want.key)
        walked = [d for _, d in index.by_drain(spec.type, fn.code_id, spec.concurrency)]
        ranked = rank_devices(spec, fn, open_, SLOTS, 0, check_memory=False, now=now)
        assert {d.key for d in walked} == {d.key for d in ranked}
        drains_walked = [drain_seconds(d, now) for d in walked]
        assert drains_walked == sorted(drains_walked)
        kept = [d for _, d in index.by_drain(spec.type, fn.code_id, spec.concurrency,
                                             lambda d, avoid=avoid: d.key not in avoid)]
        assert kept == [d for d in walked if d.key not in avoid]  # `usable` filters the walk
        for d in devs:
            assert index.ranks(d, spec.type, fn.code_id, spec.concurrency) == (d in ranked)


def test_the_index_chooses_what_the_full_ranking_chooses_after_random_load_changes() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        uniform = seed % 3 == 0  # every run time equal: the walk skips runs of equal drains
        devs = _devices(rng, rng.randrange(1, 40))
        fns = [_fn(i, memory=f"{rng.choice((1, 8, 20))}GiB", concurrency=rng.choice((1, 2)),
                   type=rng.choice((None, ("H100",), ("A100", "H100"), ("cpu",))))
               for i in range(6)]
        _observe(rng, fns, devs, uniform)
        now = 10.0
        runs: dict[str, list[Invocation]] = {d.key: [] for d in devs}
        for d in devs:
            for _ in range(rng.randrange(0, SLOTS + 1)):
                runs[d.key].append(_start(d, rng.choice(fns), now - rng.random() * rng.choice((0, 0.001, 1))))
        drains: dict[str, float] = {}
        cache: dict[str, tuple[object, float, bool]] = {}
        index = OpenIndex([d for d in devs if _is_open(d)], now, drains)
        _check_all(index, devs, fns, now, drains, cache, rng)
        for _ in range(30):  # a dispatch or a finish on one device, then the index moves it
            d = rng.choice(devs)
            if runs[d.key] and (rng.random() < 0.5 or len(d.running) >= SLOTS):
                _stop(d, runs[d.key].pop(rng.randrange(len(runs[d.key]))))
            elif len(d.running) < SLOTS:
                runs[d.key].append(_start(d, rng.choice(fns), now))
            drains.pop(d.key, None)
            index.update(d, _is_open(d))
            if rng.random() < 0.2:  # run times measured: the next pass sees them
                _observe(rng, fns, devs, uniform)
                now += rng.choice((0.0, 0.0005, 0.3))
                drains.clear()
                index = OpenIndex([d for d in devs if _is_open(d)], now, drains)
            _check_all(index, devs, fns, now, drains, cache, rng)


def _model_book() -> tuple[ModelBook, list[str]]:
    book = ModelBook()
    keys = book.register([{"name": f"m{i}", "code_id": f"loader{i}", "memory": (i + 2) * GiB,
                           "nframes": 0} for i in range(3)], ())
    return book, list(keys)


def test_the_ordered_plan_search_finds_the_full_search_s_plan() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        book, keys = _model_book()
        devs = _devices(rng, rng.randrange(1, 25))
        now = 5.0
        filler = _fn(99, memory="1GiB")
        filler.observe_runtime(rng.choice((0.001, 3.0)))
        for d in devs:
            for k in keys:  # some devices hold some of the models
                r = rng.random()
                if r < 0.3:
                    d.ledger.adopt(k, book.models[k].size, now)
            for _ in range(rng.randrange(0, 3)):
                _start(d, filler, now - rng.random() * rng.choice((0, 1, 10)))
        if rng.random() < 0.5:
            book.models[keys[0]].loads, book.models[keys[0]].load_seconds = 1, rng.choice((0.01, 20.0))
        fn = _fn(7, memory="1GiB")
        fn.model_keys = tuple(rng.sample(keys, rng.randrange(1, 3)))
        global _seq
        _seq += 1
        inv = Invocation(f"q{_seq}", fn, b"c", fn.spec, (), now, _seq)
        cands = [d for d in devs if rng.random() < 0.8]
        want = book.best_plan(inv, cands, devs, now)
        ordered = sorted(((drain_seconds(d, now), d) for d in cands), key=lambda t: t[0])
        ids = {id(d) for d in cands}
        got = book.best_plan_by_drain(inv, ordered, lambda d, ids=ids: id(d) in ids, devs, now)
        assert (got and (got[0].key, got[1].load, got[1].restore)) == \
            (want and (want[0].key, want[1].load, want[1].restore)), seed


def test_the_plan_search_s_bound_skips_only_devices_that_cannot_win() -> None:
    """Against fitting every candidate: the bound on a device's key (its drain, its
    missing models' load time and bytes) never skips the device with the best key,
    also among many equal devices (where it skips nearly all)."""
    for seed in range(60):
        rng = random.Random(1000 + seed)
        book, keys = _model_book()
        devs = _devices(rng, rng.randrange(1, 30))
        now = 5.0
        filler = _fn(99, memory="1GiB")
        filler.observe_runtime(rng.choice((0.001, 3.0)))
        alike = rng.random() < 0.5  # identical idle devices: ties everywhere
        for d in devs:
            for k in keys:
                r = rng.random()
                if r < (0.0 if alike else 0.3):
                    d.ledger.adopt(k, book.models[k].size, now)
                elif r < (0.0 if alike else 0.4) and d.ledger.state(k) is Residency.ABSENT:
                    d.ledger.adopt(k, book.models[k].size, now)
                    d.ledger.models[k].offload_allowed = True
                    d.ledger.offload_started(k, now)
                    d.ledger.offload_done(k, now)
            for _ in range(0 if alike else rng.randrange(0, 3)):
                _start(d, filler, now - rng.random() * rng.choice((0, 1, 10)))
        fn = _fn(7, memory="1GiB")
        fn.model_keys = tuple(rng.sample(keys, rng.randrange(1, 3)))
        global _seq
        _seq += 1
        inv = Invocation(f"q{_seq}", fn, b"c", fn.spec, (), now, _seq)
        req = book.request(inv)
        keyed = []
        for d in devs:
            plan = d.ledger.fit(req)
            if isinstance(plan, Fit):
                keyed.append(((drain_seconds(d, now) + book.cold_seconds(plan), plan.cost,
                               len(d.running), -plan.free_after, d.key), d))
        want = min(keyed, key=lambda t: t[0])[1] if keyed else None
        ordered = sorted(((drain_seconds(d, now), d) for d in devs),
                         key=lambda t: (t[0], len(t[1].running), -t[1].ledger.free, t[1].key))
        got = book.best_plan_by_drain(inv, ordered, lambda d: True, devs, now)
        assert (got[0] if got else None) is want, seed


def test_a_model_call_among_equal_devices_fits_one_ledger_not_all() -> None:
    """The bound is what keeps a model call's search O(1) fits at scale: among 64 equal
    idle devices (none holds the model) one is fitted, not 64."""
    book, keys = _model_book()
    devs = _devices(random.Random(3), 64)
    for d in devs:
        d.info = DeviceInfo(d.info.node, d.info.index, NAMES[0], d.info.uuid, 80 * GiB, 80 * GiB, "cpu")
        d.ledger = DeviceLedger(80 * GiB, host=HostLedger(64 * GiB), key=d.key)
    fn = _fn(7, memory="1GiB")
    fn.model_keys = (keys[0],)
    inv = Invocation("q-equal", fn, b"c", fn.spec, (), 0.0, 1)
    fitted: list[str] = []
    for d in devs:
        real = d.ledger.fit
        d.ledger.fit = (lambda req, *a, _r=real, _k=d.key, **k: fitted.append(_k) or _r(req, *a, **k))  # type: ignore[method-assign]
    ordered = sorted(((0.0, d) for d in devs), key=lambda t: t[1].key)
    got = book.best_plan_by_drain(inv, ordered, lambda d: True, devs, 0.0)
    assert got is not None and got[0] is ordered[0][1]
    assert len(fitted) == 1, fitted


def test_a_remembered_fit_is_not_used_once_the_ledger_changed() -> None:
    book, keys = _model_book()
    (d,) = _devices(random.Random(1), 1)
    fn = _fn(1, memory="1GiB")
    fn.model_keys = (keys[0],)
    inv = Invocation("a", fn, b"c", fn.spec, (), 0.0, 1)
    first = book.best_plan(inv, [d], [d], 0.0)
    assert first is not None and first[1].load == (keys[0],)
    d.ledger.adopt(keys[0], book.models[keys[0]].size, 0.0)  # the model is resident now
    again = book.best_plan(inv, [d], [d], 0.0)
    assert again is not None and isinstance(again[1], Fit) and not again[1].load
    assert d.ledger.state(keys[0]) is Residency.RESIDENT
    d.ledger.admit(inv.id, again[1], 0.0)  # planned on the ledger as it is now: not stale


def test_a_pass_places_by_the_load_its_own_dispatches_left() -> None:
    """Two calls of a concurrency-1 function in one pass go to two devices: the index
    moved the first device after its dispatch (else the second call would follow it)."""
    from gpufn.memory_pool.probe import simulated_devices
    from gpufn.scheduler.calls.recovery import Restored
    from gpufn.scheduler.core import Received, SchedulerConfig, SchedulerCore
    from gpufn.wire import protocol as p

    core = SchedulerCore(SchedulerConfig(slots_per_device=4))

    core.start(Restored(), 1.0)
    infos = simulated_devices("n0", 2, 8 * GiB)
    core.handle(Received(b"s0", p.Hello(p.Role.SUPERVISOR, p.PROTOCOL_VERSION, "", 10, p.HelloInfo(
        node="n0", devices=[d.to_wire() for d in infos]))), 1.0)
    core.handle_many([Received(f"w{i}".encode(), p.Hello(p.Role.WORKER, p.PROTOCOL_VERSION, "", 100 + i,
                      p.HelloInfo(device=f"n0:{i}", incarnation=1))) for i in range(2)], 1.0)
    core.handle(Received(b"cli", p.Hello(p.Role.CLIENT, p.PROTOCOL_VERSION, "", 2)), 1.0)
    spec = make_spec(memory="1GiB", concurrency=1)
    core.handle(Received(b"cli", p.Register("f", "code-f", "f", spec.to_wire(), [], (b"c",))), 1.0)
    out = core.handle_many([Received(b"cli", p.Submit(f"i{n}", "f", {}, frames=(b"a",)))
                            for n in range(2)], 1.1)
    runs = [s.peer for s in out if isinstance(s.msg, p.Run)]
    assert sorted(runs) == [b"w0", b"w1"], runs
