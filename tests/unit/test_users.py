"""Users: the token store (hashes only, 0600, reloaded), who a token is at Hello, and the
rules in the core (a user sees and touches only their own calls; operations need the admin
or an operator; the priority ceiling; the device cap, which never blocks other users)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from gpufn.exceptions import InvalidSpec, NotFound
from gpufn.scheduler.books.users import ADMIN, UserStore, UserStoreError, identify
from gpufn.wire import protocol as p

from .core_harness import Harness

ADMIN_TOKEN = "the-admin-token"


# --------------------------------------------------------------------------- the store


def test_the_store_keeps_only_hashes_owner_only_and_reloads(tmp_path: Path) -> None:
    store = UserStore.in_state_dir(str(tmp_path))
    alice, token = store.create("alice", 1.0, max_priority=3, max_devices=2)
    assert store.resolve(token) is alice and store.resolve(token + "x") is None
    path = tmp_path / "users.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert token not in text and alice.token_sha256 in text
    again = UserStore.in_state_dir(str(tmp_path))
    got = again.resolve(token)
    assert got is not None and (got.name, got.max_priority, got.max_devices) == ("alice", 3, 2)
    _, new = again.rotate("alice")
    assert again.resolve(token) is None and again.resolve(new) is not None
    again.update("alice", {"max_devices": None, "operator": True})
    assert UserStore.in_state_dir(str(tmp_path)).get("alice").max_devices is None  # type: ignore[union-attr]
    again.revoke("alice")
    assert UserStore.in_state_dir(str(tmp_path)).resolve(new) is None
    assert json.loads(path.read_text())["users"] == []


def test_the_store_refuses_bad_names_limits_and_files(tmp_path: Path) -> None:
    store = UserStore()
    for name in ("", ADMIN, "a b", "x" * 65, "../etc"):
        with pytest.raises(InvalidSpec):
            store.create(name, 0.0)
    with pytest.raises(InvalidSpec, match="at least 1"):
        store.create("bob", 0.0, max_devices=0)
    with pytest.raises(InvalidSpec, match="whole number"):
        store.create("bob", 0.0, max_priority=1.5)  # type: ignore[arg-type]
    store.create("bob", 0.0)
    with pytest.raises(InvalidSpec, match="exists already"):
        store.create("bob", 0.0)
    with pytest.raises(NotFound, match="no user 'carol'"):
        store.revoke("carol")
    with pytest.raises(InvalidSpec, match="cannot change"):
        store.update("bob", {"token_sha256": "x"})
    (tmp_path / "users.json").write_text("{not json")
    with pytest.raises(UserStoreError, match="remove it"):
        UserStore.in_state_dir(str(tmp_path))


def test_identify_admin_user_or_nobody() -> None:
    store = UserStore()
    _, bob = store.create("bob", 0.0)
    assert identify(ADMIN_TOKEN, ADMIN_TOKEN, store).admin  # type: ignore[union-attr]
    who = identify(bob, ADMIN_TOKEN, store)
    assert who is not None and (who.user, who.admin) == ("bob", False)
    assert identify("guess", ADMIN_TOKEN, store) is None
    assert identify("", ADMIN_TOKEN, store) is None
    assert identify("", None, store).admin  # type: ignore[union-attr]  # a tokenless cluster


# --------------------------------------------------------------------------- the core


def _cluster(**limits: object) -> tuple[Harness, dict[str, str]]:
    """A core with the admin on b"cli", alice on b"alice" (and b"alice2", a second process
    of hers) and bob on b"bob"; bob gets `limits`."""
    store = UserStore()
    tokens = {"alice": store.create("alice", 0.0)[1],
              "bob": store.create("bob", 0.0, **limits)[1]}  # type: ignore[arg-type]
    h = Harness(devices=2, users=store, token=ADMIN_TOKEN)
    for peer, user in ((b"alice", "alice"), (b"alice2", "alice"), (b"bob", "bob")):
        welcome = h.hello(peer, p.Role.CLIENT, token=tokens[user], info={"user": "root"})
        assert isinstance(welcome, p.Welcome) and welcome.ok
        assert (welcome.info.user, welcome.info.admin) == (user, False)
    return h, tokens


def _submit(h: Harness, peer: bytes, fid: str, keep: bool = False, **options: object) -> str:
    h.n += 1
    inv = f"{peer.decode()}-{h.n}"
    h.feed(peer, p.Submit(inv, fid, dict(options), keep, frames=(b"args",)))
    return inv


def _reply(out: list, kind: type) -> p.Message:  # type: ignore[type-arg]
    return next(s.msg for s in out if isinstance(s.msg, kind))


def test_the_token_decides_the_user_never_the_client(tmp_path: Path) -> None:
    h, tokens = _cluster()
    fid = h.register()
    h.feed(b"alice", p.Register(fid, "code-f", "f", h.core.functions[fid].spec.to_wire(), [], (b"c",)))
    inv = _submit(h, b"alice", fid)
    assert h.core.invocations[inv].user == "alice"  # her Hello claimed "root"
    admin = h.hello(b"cli2", p.Role.CLIENT, token=ADMIN_TOKEN)
    assert isinstance(admin, p.Welcome) and (admin.info.user, admin.info.admin) == (ADMIN, True)
    worker = h.hello(b"w-bob", p.Role.WORKER, token=tokens["bob"], info={"device": "n:0"})
    assert isinstance(worker, p.Welcome) and not worker.ok  # a worker sees every user's calls
    assert worker.error_kind == "AuthenticationError" and "clients only" in worker.message
    sup = h.hello(b"s-bob", p.Role.SUPERVISOR, token=tokens["bob"], info={"node": "x"})
    assert isinstance(sup, p.Welcome) and not sup.ok


def test_another_users_call_behaves_like_an_unknown_one() -> None:
    h, _ = _cluster()
    fid = h.register()
    call = _submit(h, b"alice", fid, keep=True)  # queued: no worker yet

    def attach(peer: bytes, inv: str) -> p.Result:
        return _reply(h.feed(peer, p.Attach(inv)), p.Result)  # type: ignore[return-value]

    def cancel(peer: bytes, inv: str, rid: int) -> bool:
        reply = _reply(h.feed(peer, p.Cancel(inv, "", True, 0, rid)), p.QueryReply)
        assert isinstance(reply, p.QueryReply) and reply.ok
        return bool(reply.data["cancelled"])

    theirs, unknown = attach(b"bob", call), attach(b"bob", "no-such-call")
    assert not theirs.ok and theirs.message == unknown.message.replace("no-such-call", call)
    assert cancel(b"bob", call, 1) is False and cancel(b"bob", "no-such-call", 2) is False
    assert h.core.invocations[call].state.value == "queued"  # untouched
    h.feed(b"alice2", p.Attach(call))  # her other process may attach
    w0 = h.start_worker(0)
    h.finish(w0, call)
    assert h.results(b"alice2")[call].ok  # the attached caller got the result
    assert not attach(b"bob", call).ok  # kept, but not for bob
    assert attach(b"alice2", call).ok and attach(b"cli", call).ok  # hers, and the admin's
    # Cancel: her other process and the admin may; an ended call answers False.
    second, third = _submit(h, b"alice", fid), _submit(h, b"alice", fid)
    assert cancel(b"alice2", call, 3) is False
    h.feed(w0, p.Heartbeat([], {}))
    assert cancel(b"alice2", second, 4) is True and cancel(b"cli", third, 5) is True


def test_status_logs_and_usage_show_a_user_their_own() -> None:
    h, _ = _cluster()
    w0, w1 = h.start_worker(0), h.start_worker(1)
    fid = h.register("f")
    spec = h.core.functions[fid].spec.to_wire()
    for peer in (b"alice", b"bob"):
        h.feed(peer, p.Register(fid, "code-f", "f", spec, [], (b"c",)))
    a, b = _submit(h, b"alice", fid), _submit(h, b"bob", fid)
    runner = {inv: (w0 if inv in h.core.devices["n:0"].running else w1) for inv in (a, b)}
    for inv in (a, b):
        h.feed(runner[inv], p.Output(inv, "stdout", f"secret of {inv}\n"))

    def status(peer: bytes) -> dict:  # type: ignore[type-arg]
        reply = _reply(h.feed(peer, p.StatusRequest(9)), p.StatusReply)
        return reply.status  # type: ignore[attr-defined, no-any-return]

    def rows(st: dict) -> set[str]:  # type: ignore[type-arg]
        return {r["id"] for d in st["devices"] for r in d["running"]}

    assert rows(status(b"bob")) == {b} and rows(status(b"cli")) == {a, b}
    assert status(b"bob")["you"] == {"user": "bob", "admin": False}
    h.feed(runner[a], p.Result(a, True, "", "", p.ResultMeta(dispatch_token=h.token(a)), (b"v",)), 1.0)
    h.feed(runner[b], p.Result(b, True, "", "", p.ResultMeta(dispatch_token=h.token(b)), (b"v",)), 1.0)

    def query(peer: bytes, kind: str, **args: object) -> dict:  # type: ignore[type-arg]
        reply = _reply(h.feed(peer, p.Query(7, kind, dict(args))), p.QueryReply)
        assert isinstance(reply, p.QueryReply) and reply.ok, reply
        return reply.data

    lines = query(b"bob", p.QueryKind.LOGS, target="f")["lines"]
    assert [ln["text"] for ln in lines] == [f"secret of {b}"]
    assert {ln["invocation_id"] for ln in query(b"cli", p.QueryKind.LOGS, target="f")["lines"]} == {a, b}
    usage = query(b"bob", p.QueryKind.USAGE, by="user")["rows"]
    assert [(r["user"], r["calls"]) for r in usage] == [("bob", 1)]
    assert query(b"bob", p.QueryKind.USAGE, by="function")["rows"][0]["calls"] == 1
    everyone = query(b"cli", p.QueryKind.USAGE, by="user")["rows"]
    assert sorted((r["user"], r["calls"]) for r in everyone) == [("alice", 1), ("bob", 1)]


def test_operations_need_the_admin_or_an_operator() -> None:
    h, _ = _cluster()
    denied = _reply(h.feed(b"bob", p.Deploy(1, "app", {}, [])), p.AppReply)
    assert isinstance(denied, p.AppReply) and denied.error_kind == "PermissionDenied"
    assert not denied.ok
    assert "--operator" in denied.message
    for cmd in ("rollback", "stop"):
        out = _reply(h.feed(b"bob", p.AppCommand(2, cmd, {"app": "app"})), p.AppReply)
        assert isinstance(out, p.AppReply) and out.error_kind == "PermissionDenied"
    listed = _reply(h.feed(b"bob", p.AppCommand(3, "list", {})), p.AppReply)
    assert isinstance(listed, p.AppReply) and listed.ok  # reading apps is for everyone
    drain = _reply(h.feed(b"bob", p.Drain(4, 1.0)), p.AppReply)
    assert isinstance(drain, p.AppReply) and drain.error_kind == "PermissionDenied"
    assert not h.core.ops.draining
    users = _reply(h.feed(b"bob", p.UserCommand(5, "list")), p.AppReply)
    assert isinstance(users, p.AppReply) and users.error_kind == "PermissionDenied"
    made = _reply(h.feed(b"cli", p.UserCommand(6, "update", {"name": "bob", "operator": True})),
                  p.AppReply)
    assert isinstance(made, p.AppReply) and made.ok
    ack = _reply(h.feed(b"bob", p.Drain(7, 1.0)), p.QueryReply)  # an operator now
    assert isinstance(ack, p.QueryReply) and ack.ok and h.core.ops.draining
    still = _reply(h.feed(b"bob", p.UserCommand(8, "list")), p.AppReply)
    assert isinstance(still, p.AppReply) and not still.ok  # users stay the admin's


def test_a_revoked_token_is_refused_at_once_connected_or_not() -> None:
    h, tokens = _cluster()
    fid = h.register()
    spec = h.core.functions[fid].spec.to_wire()
    h.feed(b"bob", p.Register(fid, "code-f", "f", spec, [], (b"c",)))
    queued = _submit(h, b"bob", fid)
    out = h.feed(b"cli", p.UserCommand(1, "revoke", {"name": "bob"}))
    reply = _reply(out, p.AppReply)
    assert isinstance(reply, p.AppReply) and reply.ok and reply.data["dropped"] == 1
    told = [s.msg for s in out if s.peer == b"bob" and isinstance(s.msg, p.Error)]
    assert told and told[0].error_kind == "AuthenticationError"  # it says Hello again ...
    again = h.hello(b"bob", p.Role.CLIENT, token=tokens["bob"])
    assert isinstance(again, p.Welcome) and not again.ok  # ... and is refused
    assert queued not in h.core.invocations  # its calls ended with it
    assert b"bob" not in h.core.peers and b"alice" in h.core.peers
    created = _reply(h.feed(b"cli", p.UserCommand(2, "create", {"name": "bob"})), p.AppReply)
    assert isinstance(created, p.AppReply) and created.ok
    new = h.hello(b"bob", p.Role.CLIENT, token=created.data["token"])
    assert isinstance(new, p.Welcome) and new.ok and new.info.user == "bob"
    rotated = _reply(h.feed(b"cli", p.UserCommand(3, "rotate", {"name": "bob"})), p.AppReply)
    assert isinstance(rotated, p.AppReply) and rotated.data["dropped"] == 1
    old = h.hello(b"bob", p.Role.CLIENT, token=created.data["token"])
    assert isinstance(old, p.Welcome) and not old.ok


def test_a_call_over_the_priority_ceiling_runs_at_the_ceiling() -> None:
    h, _ = _cluster(max_priority=3)
    fid = h.register()
    spec = h.core.functions[fid].spec.to_wire()
    h.feed(b"bob", p.Register(fid, "code-f", "f", spec, [], (b"c",)))
    high, low = _submit(h, b"bob", fid, priority=10), _submit(h, b"bob", fid, priority=2)
    mine = _submit(h, b"alice", fid, priority=10)
    inv = h.core.invocations
    assert (inv[high].spec.priority, inv[low].spec.priority, inv[mine].spec.priority) == (3, 2, 10)


def test_calls_over_the_device_cap_wait_aside_without_blocking_others() -> None:
    h, _ = _cluster(max_devices=1)
    w0, w1 = h.start_worker(0), h.start_worker(1)
    fid = h.register("f", memory="6GiB")  # one call per device at a time
    spec = h.core.functions[fid].spec.to_wire()
    for peer in (b"alice", b"bob"):
        h.feed(peer, p.Register(fid, "code-f", "f", spec, [], (b"c",)))
    b1 = _submit(h, b"bob", fid)
    b2 = _submit(h, b"bob", fid)  # bob holds 1 device already: it waits ...
    a1 = _submit(h, b"alice", fid)  # ... and alice's call behind it in the queue runs
    running = {r.invocation_id for r in h.runs()}
    assert running == {b1, a1}
    st = _reply(h.feed(b"bob", p.StatusRequest(1)), p.StatusReply).status  # type: ignore[attr-defined]
    (row,) = st["capped"]
    assert (row["user"], row["waiting"], row["max_devices"]) == ("bob", 1, 1)
    assert "max-devices" in row["why"] and "wait their turn" in row["why"]
    assert _reply(h.feed(b"alice", p.StatusRequest(2)), p.StatusReply).status["capped"] == []  # type: ignore[attr-defined]
    where = w0 if b1 in h.core.devices["n:0"].running else w1
    h.finish(where, b1)
    assert b2 in {r.invocation_id for r in h.runs()}  # its turn
    assert _reply(h.feed(b"bob", p.StatusRequest(3)), p.StatusReply).status["capped"] == []  # type: ignore[attr-defined]
    # A call needing more devices than the cap can never run: refused at once.
    gang = h.register("g", count=2)
    h.feed(b"bob", p.Register(gang, "code-g", "g", h.core.functions[gang].spec.to_wire(), [], (b"c",)))
    refused = _submit(h, b"bob", gang)
    res = h.results(b"bob")[refused]
    assert not res.ok and res.error_kind == "Unschedulable" and "max-devices" in res.message
    assert h.core.counters.unschedulable == 1


def test_raising_the_cap_lets_waiting_calls_go_at_once() -> None:
    h, _ = _cluster(max_devices=1)
    h.start_worker(0), h.start_worker(1)
    fid = h.register("f", memory="6GiB")
    h.feed(b"bob", p.Register(fid, "code-f", "f", h.core.functions[fid].spec.to_wire(), [], (b"c",)))
    b1, b2 = _submit(h, b"bob", fid), _submit(h, b"bob", fid)
    assert {r.invocation_id for r in h.runs()} == {b1}
    assert h.core.queue.held("bob") == 1 and len(h.core.queue) == 1
    h.feed(b"cli", p.UserCommand(1, "update", {"name": "bob", "max_devices": None}))
    assert {r.invocation_id for r in h.runs()} == {b1, b2}
    assert len(h.core.queue) == 0


# --- pieces cosmic-ray's mutants showed unpinned (scripts/mutants.py --room users) ---


def test_limits_at_their_bounds() -> None:
    from gpufn.scheduler.books.users import MAX_PRIORITY_BOUND, check_limit

    assert MAX_PRIORITY_BOUND == 10**6
    assert check_limit("max_priority", 10**6) == 10**6
    assert check_limit("max_priority", -(10**6)) == -(10**6)
    for bad in (10**6 + 1, -(10**6) - 1):
        with pytest.raises(InvalidSpec, match="out of range"):
            check_limit("max_priority", bad)
    assert check_limit("max_devices", 10**7) == 10**7  # the priority bound is priority's only


def test_the_store_file_is_0600_also_when_found_wider(tmp_path: Path) -> None:
    store = UserStore.in_state_dir(str(tmp_path))
    store.create("alice", 0.0)
    assert store.path is not None
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    for wider in (0o644, 0o601, 0o610):
        store.path.chmod(wider)
        UserStore.in_state_dir(str(tmp_path))
        assert stat.S_IMODE(store.path.stat().st_mode) == 0o600


def test_a_batch_charges_each_member_its_share_of_the_devices() -> None:
    from types import SimpleNamespace
    from typing import Any

    from gpufn.scheduler.books.users import device_share

    batch: Any = SimpleNamespace(devices=["d0"], carrier=None, user="alice",
                                 members=[SimpleNamespace(user="alice"),
                                          SimpleNamespace(user="bob")])
    assert sorted(device_share(batch)) == [("alice", 0.5), ("bob", 0.5)]
    single: Any = SimpleNamespace(devices=["d0", "d1"], carrier=None, user="carol", members=[])
    assert list(device_share(single)) == [("carol", 2.0)]


def test_a_capped_user_gets_one_dispatch_per_free_device_of_their_cap_in_one_pass() -> None:
    """Capped at one device, three calls queued, two devices free in one pass: the pass
    dispatches exactly one (the first it took counts against the cap at once)."""
    from types import SimpleNamespace
    from typing import Any

    from gpufn.scheduler.books.users import DeviceCaps

    store = UserStore()
    store.create("alice", 0.0, max_devices=1)
    caps = DeviceCaps(store)
    assert caps.begin([]) is True
    calls: list[Any] = [SimpleNamespace(user="alice", spec=SimpleNamespace(count=1))
                        for _ in range(3)]
    dispatched = []
    for inv in calls:
        if caps.admits(inv):
            caps.took(inv)
            dispatched.append(inv)
    assert len(dispatched) == 1
    store.update("alice", {"max_devices": 2})
    assert caps.begin([]) is True
    assert sum(1 for inv in calls if caps.admits(inv) and caps.took(inv) is None) == 2
    two: Any = SimpleNamespace(user="alice", spec=SimpleNamespace(count=3))
    assert caps.begin([]) and not caps.admits(two)  # 3 devices at once, cap 2, none held


def test_the_store_file_format(tmp_path: Path) -> None:
    store = UserStore.in_state_dir(str(tmp_path))
    store.create("alice", 0.0)
    assert store.path is not None
    data = json.loads(store.path.read_text())
    assert data["version"] == 1
    # A user written before `operator` existed is not an operator.
    data["users"][0].pop("operator")
    data["users"][0].pop("created")
    store.path.write_text(json.dumps(data))
    again = UserStore.in_state_dir(str(tmp_path)).get("alice")
    assert again is not None and again.operator is False and again.created == 0.0


def test_store_edges(tmp_path: Path) -> None:
    from gpufn.scheduler.books.users import new_token

    assert len(new_token()) == 48
    deep = UserStore.in_state_dir(str(tmp_path / "a" / "b"))  # its folders are made
    deep.create("alice", 0.0)
    with pytest.raises(NotFound, match="users: none yet"):
        UserStore().revoke("carol")
    blocked = UserStore(tmp_path / "blocked" / "users.json")
    (tmp_path / "blocked" / "users.json").mkdir(parents=True)  # a folder where it goes
    with pytest.raises(UserStoreError, match="cannot write the user store"):
        blocked.create("alice", 0.0)
    assert [p.name for p in (tmp_path / "blocked").iterdir()] == ["users.json"]  # no tmp left


def test_held_devices_counts_a_gang_once_and_every_call_after_it() -> None:
    from types import SimpleNamespace
    from typing import Any

    from gpufn.scheduler.books.users import held_devices

    def call(cid: str, user: str, devices: list[str]) -> Any:
        return SimpleNamespace(id=cid, user=user, devices=devices, members=[], carrier=None)

    gang = call("g", "alice", ["d0", "d1"])
    d0: Any = SimpleNamespace(running={"g": gang})
    d1: Any = SimpleNamespace(running={"g": gang, "s": call("s", "bob", ["d1"])})
    assert held_devices([d0, d1]) == {"alice": 2.0, "bob": 1.0}


# --- the user desk's pieces cosmic-ray's mutants showed unpinned (--room user_desk) ---


def test_the_user_list_says_who_is_admin_and_how_many_connections_each_has() -> None:
    h, _ = _cluster()
    h.feed(b"cli", p.UserCommand(1, "create", {"name": "carol"}))  # never connected
    listed = _reply(h.feed(b"cli", p.UserCommand(2, "list")), p.AppReply)
    assert isinstance(listed, p.AppReply) and listed.ok
    rows = {r["name"]: r for r in listed.data["users"]}
    assert {n: (r["admin"], r["operator"], r["connections"]) for n, r in rows.items()} == {
        ADMIN: (True, True, 1), "alice": (False, False, 2), "bob": (False, False, 1),
        "carol": (False, False, 0)}  # made without --operator: not one


def test_a_failed_user_command_is_answered_not_ok_saying_why() -> None:
    h, _ = _cluster()
    nothing = _reply(h.feed(b"cli", p.UserCommand(1, "update", {"name": "bob"})), p.AppReply)
    assert isinstance(nothing, p.AppReply) and not nothing.ok
    assert nothing.error_kind == "InvalidSpec" and "nothing to change" in nothing.message
    unknown = _reply(h.feed(b"cli", p.UserCommand(2, "frobnicate", {"name": "bob"})), p.AppReply)
    assert isinstance(unknown, p.AppReply) and not unknown.ok
    assert unknown.error_kind == "InvalidSpec" and "frobnicate" in unknown.message
    assert all(k.value in unknown.message for k in p.UserCommandKind)  # what it could be


def test_each_capped_user_sees_their_own_waiting_calls_past_anothers() -> None:
    store = UserStore()
    tokens = {u: store.create(u, 0.0, max_devices=1)[1] for u in ("alice", "bob")}
    h = Harness(devices=2, users=store, token=ADMIN_TOKEN)
    for user in ("alice", "bob"):
        assert h.hello(user.encode(), p.Role.CLIENT, token=tokens[user]).ok  # type: ignore[attr-defined]
    h.start_worker(0), h.start_worker(1)
    fid = h.register("f", memory="6GiB")
    spec = h.core.functions[fid].spec.to_wire()
    for peer in (b"alice", b"bob"):
        h.feed(peer, p.Register(fid, "code-f", "f", spec, [], (b"c",)))
        _submit(h, peer, fid)
        _submit(h, peer, fid)  # each holds one device: the second waits at the cap
    for peer in (b"alice", b"bob"):
        st = _reply(h.feed(peer, p.StatusRequest(1)), p.StatusReply).status  # type: ignore[attr-defined]
        assert [(r["user"], r["waiting"], r["holds"]) for r in st["capped"]] == [
            (peer.decode(), 1, 1.0)]
    st = _reply(h.feed(b"cli", p.StatusRequest(2)), p.StatusReply).status  # type: ignore[attr-defined]
    assert [r["user"] for r in st["capped"]] == ["alice", "bob"]  # the admin sees both
