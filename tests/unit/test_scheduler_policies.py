from __future__ import annotations

import pytest

from gpufn.scheduler.nouns.states import InvState
from gpufn.wire import protocol as p

from .core_harness import Harness


def _where(h: Harness, inv: str) -> str:
    return next(k for k, d in h.core.devices.items() if inv in d.running)


def test_queue_limits_refuse_with_queue_full() -> None:
    h = Harness(devices=1, max_queue=3, max_queue_per_function=2)
    h.start_worker(0)
    f, g = h.register("f"), h.register("g")
    h.submit(f)  # runs
    a, b = h.submit(f), h.submit(f)  # queued: 2 of f
    c = h.submit(f)
    res = h.results()[c]
    assert res.error_kind == "QueueFull" and "GPUFN_MAX_QUEUE_PER_FUNCTION=2" in res.message
    assert a not in h.results() and b not in h.results()
    h.submit(g)  # g runs beside f (another function)
    h.submit(g)  # queued: 3 in total
    d = h.submit(g)
    assert h.results()[d].error_kind == "QueueFull" and "GPUFN_MAX_QUEUE=3" in h.results()[d].message
    assert h.core.counters.rejected == 2


def test_calls_go_to_the_device_expected_to_finish_first() -> None:
    h = Harness(devices=2)
    h.start_worker(0)
    h.start_worker(1)
    f = h.register("f", concurrency=8)
    fn = next(iter(h.core.functions.values()))
    fn.observe_runtime(1.0, "n:0")  # n:0 is slow for f
    fn.observe_runtime(0.1, "n:1")  # n:1 is ten times faster
    placed = [_where(h, h.submit(f)) for _ in range(6)]
    # the fast device takes calls until its queue is as long as the slow one's single call
    assert placed.count("n:1") >= 5


def test_variants_of_a_function_share_its_concurrency() -> None:
    h = Harness(devices=1)
    h.start_worker(0)
    base = h.register("f")
    urgent = h.register("f", priority=5)  # same code, another spec
    fns = list(h.core.functions.values())
    fns[1].code_id = fns[0].code_id  # as with_options() does
    h.submit(base)
    second = h.submit(urgent)
    assert h.core.invocations[second].state is InvState.QUEUED


def test_preemption_requeues_the_victim_and_frees_the_device_when_it_stops() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    low = h.register("bg", preemptible=True)
    high = h.register("bg", priority=5)
    fns = list(h.core.functions.values())
    fns[1].code_id = fns[0].code_id
    victim = h.submit(low)
    urgent = h.submit(high)
    cancels = [s for s in h.of_type(p.Cancel) if s.msg.invocation_id == victim]
    assert cancels and "preempted" in cancels[0].msg.reason
    assert h.core.invocations[victim].state is InvState.QUEUED
    assert h.core.invocations[urgent].state is InvState.QUEUED  # waits for the device
    # the victim stops: its (stale) result frees the device; the urgent call runs first
    first = h.token(victim)
    h.feed(w, p.Result(victim, False, "Cancelled", "preempted", p.ResultMeta(dispatch_token=first)))
    assert h.core.invocations[urgent].state is InvState.RUNNING
    h.finish(w, urgent)
    assert h.core.invocations[victim].state is InvState.RUNNING
    assert h.token(victim) != first
    h.feed(w, p.Result(victim, True, "", "", p.ResultMeta(dispatch_token=h.token(victim)), (b"v",)))
    res = h.results()[victim]
    assert res.ok and res.meta.attempts == 2 and h.core.counters.preempted == 1


def test_non_preemptible_calls_are_never_stopped() -> None:
    h = Harness(devices=1)
    h.start_worker(0)
    low = h.register("bg")
    high = h.register("bg", priority=5)
    fns = list(h.core.functions.values())
    fns[1].code_id = fns[0].code_id
    h.submit(low)
    h.submit(high)
    assert not h.of_type(p.Cancel)


def test_batches_fill_up_or_leave_after_the_wait() -> None:
    h = Harness(devices=1)
    w = h.start_worker(0)
    f = h.register("b", batch_size=3, batch_wait_ms=20)
    a, b = h.submit(f), h.submit(f)
    assert not h.runs()  # waiting for the batch to fill
    assert h.core.next_wakeup() is not None
    c = h.submit(f)
    (run,) = h.runs(w)
    assert run.meta.members == [a, b, c] and run.meta.batch == [1, 1, 1]
    items = [{"ok": True, "n": 1}, {"ok": False, "n": 1, "error_kind": "", "message": "x"},
             {"ok": True, "n": 1}]
    h.feed(w, p.Result(run.invocation_id, True, "", "", p.ResultMeta(dispatch_token=run.dispatch_token, batch_items=items),
                       (b"ra", b"rb", b"rc")))
    res = h.results()
    assert res[a].ok and res[a].frames == (b"ra",) and res[a].meta.batch_size == 3
    assert not res[b].ok and res[b].frames == (b"rb",)
    assert res[c].frames == (b"rc",)
    d = h.submit(f)  # alone: leaves when its wait is over
    assert not [r for r in h.runs() if d in (r.meta.members or [])]
    h.tick(dt=0.05)
    assert [r for r in h.runs() if d in (r.meta.members or [])]


def test_a_lost_batch_fails_each_member_or_retries_it() -> None:
    h = Harness(devices=1)
    h.start_worker(0)
    f = h.register("b", batch_size=2, batch_wait_ms=50, retries=1)
    a, b = h.submit(f), h.submit(f)
    assert h.core.invocations[a].carrier is h.core.invocations[b].carrier is not None
    h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed"))
    assert h.core.invocations[a].state is InvState.QUEUED  # retried on their own
    assert h.core.invocations[b].state is InvState.QUEUED
    assert h.core.counters.retried == 2


@pytest.mark.parametrize("duration, queued", [(1e-5, 7), (5e-4, 4), (2e-3, 2), (0.1, 0)])
def test_short_calls_pipeline_about_two_ms_of_work_at_a_worker(duration: float, queued: int) -> None:
    """Beyond its one running call, a worker holds as many short calls as run in about
    2 ms (at least 2, at most 7); calls not measured short are not pipelined."""
    h = Harness(devices=1)
    w0 = h.start_worker(0)
    fid = h.register()
    for _ in range(3):  # measure the function
        h.finish(w0, h.submit(fid), duration=duration)
    before = len(h.runs(w0))
    for _ in range(20):
        h.submit(fid)
    assert len(h.runs(w0)) - before == 1 + queued


def test_calls_pipelined_behind_a_call_past_its_timeout_are_queued_again_unspent() -> None:
    """The worker is killed for the call past its timeout; the short calls pipelined
    behind it never started there: each goes back to the queue with no attempt used
    (freeing the first had started the next one's clock, so each in turn was taken for
    started and, with retries=0, failed WorkerLost)."""
    h = Harness(devices=1)
    w0 = h.start_worker(0)
    fid = h.register(timeout=2)
    for _ in range(3):  # measure the function: short, so pipelined
        h.finish(w0, h.submit(fid), duration=1e-5)
    before = len(h.runs(w0))
    late, *behind = [h.submit(fid) for _ in range(4)]
    assert [r.invocation_id for r in h.runs(w0)[before:]] == [late, *behind]
    running = h.core.devices["n:0"].running
    assert running[late].run_started is not None  # its slot: the one before it ended
    assert all(running[i].run_started is None for i in behind)  # waiting behind it
    h.tick(2.5)
    assert [s.msg.reason for s in h.of_type(p.KillWorker)] == [
        f"call {late} exceeded its 2s timeout"]
    assert h.results()[late].error_kind == "Timeout"
    for inv in behind:
        assert h.core.invocations[inv].state is InvState.QUEUED, inv
        assert inv not in h.results()
    w1 = h.start_worker(0, peer=b"w0-again", pid=101)
    h.tick(0.5)  # past the backoff of a lost worker's calls
    for inv in behind:  # (retries=0: had an attempt been counted, none would run again)
        [run] = [r for r in h.runs(w1) if r.invocation_id == inv]
        assert run.meta.attempt_number == 1  # its first run (gpufn.context().attempt)
        h.finish(w1, inv)
    assert all(h.results()[inv].ok for inv in behind)
    assert h.core.counters.timeouts == 1 and h.core.counters.lost == len(behind)


def test_the_dead_workers_journal_says_which_calls_started_not_their_clocks() -> None:
    """Its exit notice carries the calls the process started (its journal): a call whose
    clock had not started but which did start (the answer before it died with the
    process) counts its attempt; one whose clock had started but which never did (the
    process died first) goes back unspent. Without a whole journal, the clocks say."""
    for journaled in (True, False):
        h = Harness(devices=1)
        w0 = h.start_worker(0)
        fid = h.register()
        for _ in range(3):  # measured short: pipelined
            h.finish(w0, h.submit(fid), duration=1e-5)
        first, second, third = h.submit(fid), h.submit(fid), h.submit(fid)
        h.finish(w0, first, duration=1e-5)  # second's clock starts; third waits behind it
        running = h.core.devices["n:0"].running
        assert running[second].run_started is not None and running[third].run_started is None
        h.feed(b"sup", p.WorkerExited("n:0", 100, -11, "killed by signal 11", 1,
                                      [first, third], journaled))
        if journaled:  # second never started, third did (and its answer died with it)
            assert h.core.invocations[second].state is InvState.QUEUED
            assert h.results()[third].error_kind == "WorkerLost"
        else:
            assert h.results()[second].error_kind == "WorkerLost"
            assert h.core.invocations[third].state is InvState.QUEUED


def test_a_call_whose_id_the_journal_cannot_hold_counts_as_started() -> None:
    """A worker journals ids of up to JOURNAL_ID_MAX bytes; a longer one (no id gpufn
    makes) is not in it though it ran, so its absence says nothing."""
    for n, unspent in ((p.JOURNAL_ID_MAX, True), (p.JOURNAL_ID_MAX + 1, False)):
        h = Harness(devices=1)
        w0 = h.start_worker(0)
        fid = h.register()
        inv = "x" * n
        h.feed(b"cli", p.Submit(inv, fid, {}, frames=(b"args",)))
        assert [r.invocation_id for r in h.runs(w0)] == [inv]
        h.feed(b"sup", p.WorkerExited("n:0", 100, -9, "killed by signal 9", 1, [], True))
        if unspent:
            assert h.core.invocations[inv].state is InvState.QUEUED
        else:
            assert h.results()[inv].error_kind == "WorkerLost"


def test_a_call_whose_worker_dies_each_time_before_it_starts_fails_at_last() -> None:
    """Lost unstarted, a call goes back unspent, but not for ever: one whose setup takes
    its worker down each time (its code's import, a model's load) would go round without
    end. After UNSTARTED_LOSSES such losses the next counts: retries=0 fails, saying so."""
    from gpufn.scheduler.calls.transitions import UNSTARTED_LOSSES

    h = Harness(devices=1)
    fid = h.register()
    inv = h.submit(fid)
    for gen in range(1, UNSTARTED_LOSSES + 2):
        h.start_worker(0, peer=f"w0-{gen}".encode(), pid=100 + gen)
        h.tick(1.0)  # past a lost call's backoff
        assert h.core.invocations[inv].state is InvState.RUNNING, gen
        h.feed(b"sup", p.WorkerExited("n:0", 100 + gen, -9, "killed by signal 9", gen, [], True))
        if gen <= UNSTARTED_LOSSES:
            assert h.core.invocations[inv].state is InvState.QUEUED, gen
    result = h.results()[inv]
    assert result.error_kind == "WorkerLost" and "before it started" in result.message


def test_a_call_queued_again_unspent_fails_when_lost_once_it_ran() -> None:
    """A call pipelined behind one past its timeout goes back unspent; dispatched again,
    it starts, and with retries=0 a second lost worker fails it (its one attempt used)."""
    h = Harness(devices=1)
    w0 = h.start_worker(0)
    fid = h.register(timeout=2)
    for _ in range(3):
        h.finish(w0, h.submit(fid), duration=1e-5)
    late, behind = h.submit(fid), h.submit(fid)
    h.tick(2.5)
    assert h.core.invocations[behind].state is InvState.QUEUED
    h.start_worker(0, peer=b"w0-again", pid=101)
    h.tick(0.5)
    assert h.core.devices["n:0"].running[behind].run_started is not None
    h.feed(b"sup", p.WorkerExited("n:0", 101, -9, "killed by signal 9", 2))
    assert h.results()[behind].error_kind == "WorkerLost"
    assert h.results()[late].error_kind == "Timeout"


def test_a_pipelined_calls_clock_starts_when_the_call_before_it_ends() -> None:
    """One at a time (concurrency 1): the calls waiting at the worker behind a running one
    are not timed; when it ends, the next one's clock starts, and only that one's."""
    h = Harness(devices=1)
    w0 = h.start_worker(0)
    fid = h.register(timeout=2)
    for _ in range(3):
        h.finish(w0, h.submit(fid), duration=1e-5)
    first, second, third = h.submit(fid), h.submit(fid), h.submit(fid)
    running = h.core.devices["n:0"].running
    assert [running[i].run_started is not None for i in (first, second, third)] == [
        True, False, False]
    h.finish(w0, first, duration=1e-5)
    assert [running[i].run_started is not None for i in (second, third)] == [True, False]


def test_a_call_waiting_for_its_functions_slot_does_not_hold_back_another_functions_clock() -> None:
    """Calls of two functions pipelined at one worker: the second call of `f` waits for
    `f`'s one slot (concurrency 1), but `g`'s call, dispatched after it, has a slot of its
    own there, so its clock starts at once (it would never be timed otherwise)."""
    h = Harness(devices=1)
    w0 = h.start_worker(0)
    f, g = h.register("f", timeout=2), h.register("g", timeout=1)
    for _ in range(3):  # measured short: pipelined
        h.finish(w0, h.submit(f), duration=1e-5)
    first, second = h.submit(f), h.submit(f)
    other = h.submit(g)
    assert {r.invocation_id for r in h.runs(w0)} >= {first, second, other}
    running = h.core.devices["n:0"].running
    assert [running[i].run_started is not None for i in (first, second, other)] == [
        True, False, True]
    h.tick(1.5)  # `g`'s call past its timeout (`f`'s first is not): its clock did run
    assert h.results()[other].error_kind == "Timeout"


def test_a_call_waiting_for_its_model_does_not_hold_back_another_calls_clock() -> None:
    """A call dispatched before its model is resident is not timed until the load ends; a
    call of another function dispatched beside it, needing no model, is timed at once."""
    from gpufn.wire.spec import make_spec

    h = Harness(devices=1)
    w0 = h.start_worker(0)
    spec = make_spec(timeout=5)
    loads = f"m-{hash(spec)}"
    h.feed(b"cli", p.Register(loads, "code-m", "m", spec.to_wire(), [
        {"name": "weights", "code_id": "abcdef0123456", "memory": 2**30, "pin": False,
         "offload": True, "nframes": 1}], (b"code", b"loader")))
    g = h.register("g", timeout=1)
    waits, other = h.submit(loads), h.submit(g)
    assert {r.invocation_id for r in h.runs(w0)} == {waits, other}
    running = h.core.devices["n:0"].running
    assert running[waits].run_started is None and running[other].run_started is not None
    key = next(iter(h.core.models.models))
    h.feed(w0, p.ModelEvent(key, "resident", 2**30, 0.1))
    assert running[waits].run_started is not None  # its model came: its clock starts


def test_calls_waiting_at_a_worker_start_in_the_order_they_were_sent_there() -> None:
    """A retried call keeps its place in the queue (its submission order) but reaches the
    worker after a newer call pipelined there first, and the worker runs them in the
    order they came: when the running call ends, the newer call's clock starts, not the
    retried one's."""
    h = Harness(devices=1)
    w0 = h.start_worker(0)
    fid = h.register(timeout=5, retries=1)
    for _ in range(3):  # measured short: pipelined
        h.finish(w0, h.submit(fid), duration=1e-5)
    retried = h.submit(fid)
    h.feed(w0, p.Result(retried, False, "", "raised", p.ResultMeta(
        dispatch_token=h.token(retried), duration=1e-5, retryable=True)))
    assert h.core.invocations[retried].state is InvState.QUEUED  # after its backoff
    running_call, newer = h.submit(fid), h.submit(fid)
    h.tick(5.0)  # past the backoff: sent to the worker behind `newer`
    sent = [r.invocation_id for r in h.runs(w0)]
    assert sent[-3:] == [running_call, newer, retried]
    h.finish(w0, running_call, duration=1e-5)
    running = h.core.devices["n:0"].running
    assert running[newer].run_started is not None and running[retried].run_started is None
