"""Runs user code in threads: unpickle arguments, call, pickle the result or exception.

Each call runs with its `gpufn.context()` and output routing set for its thread; the
finished `Result` goes to `on_done`, which the worker's I/O loop drains. Processes the
call's thread started and left running are stopped after that (worker/host/children.py).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gpufn.exceptions import (
    Cancelled,
    GpufnError,
    ModelLoadError,
    NotJSONSerializable,
    OutOfMemory,
    PayloadTooLarge,
    SerializationError,
    kind_of,
)
from gpufn.runtime import context as ctxmod
from gpufn.wire import config, jsonwire
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser
from gpufn.wire import shm as shmem
from gpufn.worker.core import Unused
from gpufn.worker.groups import is_comm_error
from gpufn.worker.host import children
from gpufn.worker.host.memory_watch import Reports
from gpufn.worker.output import OutputRouter, set_current
from gpufn.worker.streaming import Driver, needs_driving


@dataclass
class Call:
    invocation_id: str
    name: str
    fn: Callable[..., Any]
    frames: tuple[Any, ...]
    context: ctxmod.CallContext
    # What the worker adds to the Result's meta (group_inits, comm_error) and scratch.
    meta: dict[str, Any] = field(default_factory=dict)
    # Runs in the call's thread before the function (model resolution, group setup).
    prepare: Callable[[], None] | None = None
    # Maps the function's value before pickling (gang gather, batching).
    finish: Callable[[Any], Any] | None = None
    # Runs in the call's thread when the function raised (a gang rank tears its group down).
    on_error: Callable[[BaseException], None] | None = None
    dispatch_token: int = 1  # Run.dispatch_token, echoed in the Result
    batch: list[int] | None = None  # frames per input when the call is a batch
    models: dict[str, str] = field(default_factory=dict)  # name -> key, resident before it runs
    retry_on: list[str] | None = None  # Retries(on=...): an exception of these is retryable
    # Runs the call elsewhere on its argument frames and returns the result frames, which
    # pass through untouched (spmd=False's device-set helper); replaces `fn`.
    relay: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None
    json: bool = False  # its arguments came as JSON: its value and items go back as JSON
    shm_owner: int = 0  # the caller's pid: big results go to it through shared memory
    host_memory: int = 0  # @gpu(host_memory=): the worker's host-memory limit while it runs


class Executor:
    def __init__(self, router: OutputRouter, on_done: Callable[[p.Message], None],
                 on_items: Callable[[], None] | None = None) -> None:
        self.router = router
        self.on_done = on_done
        # Generators, coroutines, async generators; with `on_items`, streamed values wait
        # in `driver.items` for the main loop (told by `on_items`) instead of `on_done`.
        self.driver = Driver(on_done, on_items)
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="gpufn-call")
        self._threads: dict[str, tuple[int, int]] = {}  # invocation -> (thread, dispatch token)
        self._cancelled: dict[str, tuple[int, float]] = {}  # invocation -> (dispatch token, when)
        self._lock = threading.Lock()
        self._kids = children.ThreadChildren()
        self.reports = Reports(-1)  # host-memory declarations, for the supervisor's watch

    def submit(self, call: Call) -> None:
        self.pool.submit(self._run, call)

    def running(self) -> list[str]:
        with self._lock:
            return list(self._threads)

    def interrupt(self, invocation_id: str, dispatch_token: int = 0,
                  exc: type[BaseException] = Cancelled) -> bool:
        """Raise `exc` (Cancelled) inside the call's thread (takes effect at the next
        bytecode); whether it was raised there.

        A call not running yet (still in the pool's queue, or not arrived: pipelined) is
        remembered and refused when it starts (a cancel only). `dispatch_token` (0: any)
        keeps a cancel meant for an earlier dispatch from refusing a retry. Interrupts are
        set under the lock while the call is registered, and `_run` clears any still
        pending when it deregisters.
        """
        with self._lock:
            entry = self._threads.get(invocation_id)
            if entry is None or (dispatch_token and entry[1] != dispatch_token):
                if exc is Cancelled:
                    self._cancelled[invocation_id] = (dispatch_token, time.monotonic())
                return False
            n = 1
            if not self.driver.is_async(invocation_id):  # an async call's thread only waits
                n = ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(entry[0]), ctypes.py_object(exc))
        self.driver.interrupt(invocation_id, dispatch_token)  # wakes a stream waiting for credit
        return n == 1

    def grant(self, invocation_id: str, dispatch_token: int, allowed: int) -> None:
        """A stream's consumer read more: its producer may send up to `allowed` items."""
        self.driver.grant(invocation_id, dispatch_token, allowed)

    def take_cancelled(self, invocation_id: str, dispatch_token: int) -> bool:
        """Whether a cancel arrived for this call (this dispatch) before it started."""
        with self._lock:
            return self._take_cancelled_locked(invocation_id, dispatch_token)

    def _take_cancelled_locked(self, invocation_id: str, dispatch_token: int) -> bool:
        hit = self._cancelled.get(invocation_id)
        if hit is None or (hit[0] and hit[0] != dispatch_token):
            return False
        del self._cancelled[invocation_id]
        return True

    def forget_cancels(self, older_than: float) -> None:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, (_, t) in self._cancelled.items() if now - t > older_than]:
                del self._cancelled[k]

    def run_inline(self, call: Call,
                   on_done: Callable[[p.Message], None] | None = None) -> None:
        """Run in the calling thread (short calls on the worker's main thread); its Result
        goes to `on_done` if given, else to the executor's."""
        self._run(call, on_done)

    def _run(self, call: Call, on_done: Callable[[p.Message], None] | None = None) -> None:
        inv = call.invocation_id
        t0 = time.perf_counter()
        result: p.Result | None = None
        registered = False
        before = self._kids.now()  # processes this thread started before the call
        try:
            with self._lock:
                if self._take_cancelled_locked(inv, call.dispatch_token):
                    result = p.Result(inv, False, kind_of(Cancelled),
                                      f"{call.name} call {inv} was cancelled before it started")
                else:
                    self._threads[inv] = (threading.get_ident(), call.dispatch_token)
                    registered = True
            if result is None:
                if call.host_memory:
                    self.reports.call_started(inv, call.host_memory)
                self.router.started(inv)
                set_current(inv)
                ctxmod._set(call.context)
                result = self._call(call, t0)
        except BaseException as e:  # an async Cancelled landing outside the user's code
            result = _failure(inv, e, t0, call.json)
        finally:
            if call.host_memory:
                self.reports.call_ended(inv)
            if registered:  # (usually `_ended` did this as the user's code finished)
                self._ended(inv)
            ctxmod._set(None)
            set_current(None)
            self.router.finished(inv)
        assert result is not None
        result.meta.dispatch_token = call.dispatch_token
        if call.context.world_size > 1:
            result.meta.rank = call.context.rank
        if call.meta:
            for key in ("group_inits", "group_init_s", "comm_error",  # set by the call's hooks
                        "items", "first_item_s", "items_per_s"):
                if key in call.meta:
                    setattr(result.meta, key, call.meta[key])
        (on_done or self.on_done)(result)
        left = self._kids.now() - before
        if left:  # after the Result is on its way: stopping them may take a grace
            children.stop(sorted(left))

    def _ended(self, inv: str) -> None:
        """The user's code returned or raised: interrupts no longer land in this thread,
        and one that arrived as it ended is dropped (an interrupt meant for the running
        call had replaced a gang rank's own error with Cancelled while that error's
        traceback was being formatted)."""
        with self._lock:
            if self._threads.pop(inv, None) is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(threading.get_ident()), None)

    def _out_of_memory(self, call: Call, exc: BaseException, t0: float) -> p.Result:
        """The call alone fails with gpufn.OutOfMemory; its memory goes back to the pool
        so the models resident on the device keep serving."""
        from gpufn.memory_pool.allocator import out_of_memory, release_workspace

        device = call.context.device
        err = out_of_memory(exc, device, f"{call.name} call {call.invocation_id}")
        del exc
        release_workspace(device)
        return _gpufn_failure(call.invocation_id, err, t0)

    def _call(self, call: Call, t0: float) -> p.Result:
        inv = call.invocation_id
        if call.relay is not None:
            return self._relayed(call, call.relay, t0)
        lent: list[shmem.Borrowed] = []  # pooled argument files mapped (gpufn/wire/shm.py)
        try:
            if call.batch is not None:
                args, kwargs = _batched_arguments(call)
            elif jsonwire.is_json(call.frames):  # from the HTTP gateway: never unpickled
                call.json = True
                args, kwargs = jsonwire.load_call(call.frames)
            else:
                with shmem.borrowing() as lent:
                    args, kwargs = ser.loads(call.frames)
        except GpufnError as e:
            return _gpufn_failure(inv, e, t0)
        except Exception as e:
            err = SerializationError(
                f"the arguments of {call.name} could not be unpickled on the worker: "
                f"{type(e).__name__}: {e}. Is a module the arguments need missing on the worker?"
            )
            return _gpufn_failure(inv, err, t0)
        if call.batch is not None and len(call.meta.get("batch_bad", {})) == len(call.batch):
            return _batch_result(call, [], t0)  # no input could be read: each says why
        try:
            if call.prepare is not None:
                call.prepare()
            value = call.fn(*args, **kwargs)
            if needs_driving(value):  # a generator, a coroutine or an async generator
                value = self.driver.drive(call, value)
            if call.finish is not None:
                value = call.finish(value)
        except BaseException as e:
            self._ended(inv)
            return self._raised(call, e, t0)
        self._ended(inv)
        if call.batch is not None:
            return _batch_result(call, value, t0)
        if value is Unused.VALUE:
            return p.Result(inv, True, "", "", p.ResultMeta(duration=time.perf_counter() - t0))
        is_plain = ser.plain(value)  # then nothing of it could go to shared memory
        threshold = config.shm_threshold() if call.shm_owner and not is_plain else None
        # One run on one device may send its result back in its arguments' pooled files
        # (gpufn/wire/shm.py): those it dropped are written over, those it returns named.
        alone = call.context.world_size == 1 and call.context.attempt <= 1
        out = (shmem.Outgoing(call.shm_owner, threshold, lent=lent if alone else [])
               if threshold else None)
        del args, kwargs
        try:
            frames = (jsonwire.dump_value(value, f"the value returned by {call.name}") if call.json
                      else ser.dumps(value, out, is_plain))
        except NotJSONSerializable as e:
            return _gpufn_failure(inv, e, t0)
        except Exception as e:
            err = SerializationError(
                f"the value returned by {call.name} cannot be pickled: {type(e).__name__}: {e}. "
                "Return tensors, arrays or plain Python values."
            )
            return _gpufn_failure(inv, err, t0)
        try:
            ser.check_payload(frames, f"the value returned by {call.name}", out.nbytes if out else 0)
        except PayloadTooLarge as e:
            if out is not None:
                shmem.release(out.names)
            return _gpufn_failure(inv, e, t0)
        del value  # then a pooled argument file nobody views is free again
        freed = shmem.settle(lent, out, frames)
        return p.Result(inv, True, "", "", p.ResultMeta(
            duration=time.perf_counter() - t0, shm=out.names if out and out.names else None,
            shm_freed=freed or None), tuple(frames))

    def _relayed(self, call: Call, relay: Callable[[tuple[Any, ...]], tuple[Any, ...]],
                 t0: float) -> p.Result:
        """Run where `relay` sends it: arguments and result pass through here untouched
        (JSON ones stay JSON: the helper reads the same mark)."""
        call.json = jsonwire.is_json(call.frames)
        try:
            if call.prepare is not None:
                call.prepare()
            frames = relay(call.frames)
            ser.check_payload(frames, f"the value returned by {call.name}")
        except PayloadTooLarge as e:
            return _gpufn_failure(call.invocation_id, e, t0)
        except BaseException as e:
            return self._raised(call, e, t0)
        return p.Result(call.invocation_id, True, "", "",
                        p.ResultMeta(duration=time.perf_counter() - t0), tuple(frames))

    def _raised(self, call: Call, e: BaseException, t0: float) -> p.Result:
        inv = call.invocation_id
        if call.on_error is not None:
            try:
                call.on_error(e)
            except Exception:
                pass
        if call.context.world_size > 1:
            _tag_rank(e, call.context.rank, call.context.world_size)
            if is_comm_error(e):
                call.meta["comm_error"] = True
        if isinstance(e, (ModelLoadError, OutOfMemory, NotJSONSerializable)):
            return _gpufn_failure(inv, e, t0)
        if _oom(e):
            return self._out_of_memory(call, e, t0)
        result = _failure(inv, e, t0, call.json)
        result.meta.retryable = retryable(e, call.retry_on)
        return result


def _batched_arguments(call: Call) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Each caller passed one input; the batched function gets one list per argument.
    An input that cannot be unpickled is left out and answered with its own error."""
    assert call.batch is not None
    items, bad, i = [], {}, 0
    as_json: set[int] = set()  # inputs from JSON callers: their outputs go back as JSON
    for pos, n in enumerate(call.batch):
        try:
            frames = call.frames[i:i + n]
            if jsonwire.is_json(frames):
                as_json.add(pos)
                items.append(jsonwire.load_call(frames))
            else:
                items.append(ser.loads(frames))
        except Exception as e:
            bad[pos] = SerializationError(
                f"this input of {call.name} could not be unpickled on the worker: "
                f"{type(e).__name__}: {e}")
        i += n
    call.meta["batch_bad"] = bad
    call.meta["batch_json"] = as_json
    if not items:
        return (), {}
    shapes = {(len(a), tuple(sorted(k))) for a, k in items}
    if len(shapes) != 1:
        raise GpufnError(
            f"the calls batched into {call.name} passed different arguments "
            f"({sorted(shapes)}); every call of a batched function must pass the same "
            "positional count and keyword names")
    (npos, keys), = shapes
    args = tuple([a[j] for a, _ in items] for j in range(npos))
    kwargs = {k: [kw[k] for _, kw in items] for k in keys}
    return args, kwargs


def _batch_result(call: Call, value: Any, t0: float) -> p.Result:
    """One output per input (an exception in an item's place fails only that caller)."""
    assert call.batch is not None
    bad: dict[int, GpufnError] = call.meta.pop("batch_bad", {})
    as_json: set[int] = call.meta.pop("batch_json", set())
    n = len(call.batch) - len(bad)
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"a {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (list, tuple)) else "")
        return _gpufn_failure(call.invocation_id, GpufnError(
            f"batched function {call.name} must return a list of {n} outputs, one per input "
            f"in order; it returned {got}"), t0)
    outputs = iter(value)
    frames: list[Any] = []
    items: list[dict[str, Any]] = []
    for pos in range(len(call.batch)):
        if pos in bad:
            items.append({"ok": False, "n": 0, "error_kind": kind_of(bad[pos]),
                          "message": str(bad[pos])})
            continue
        v = next(outputs)
        if isinstance(v, BaseException):
            f, tb = ser.dump_exception(v)
            if pos in as_json:
                f = []  # a JSON caller gets type, message and traceback, never a pickle
            items.append({"ok": False, "n": len(f), "error_kind": "", "message": str(v),
                          "type": type(v).__name__, "traceback": tb})
        else:
            try:
                f = (jsonwire.dump_value(v, f"an output of {call.name}") if pos in as_json
                     else ser.dumps(v))
                items.append({"ok": True, "n": len(f)})
            except NotJSONSerializable as e:
                f = []
                items.append({"ok": False, "n": 0, "error_kind": kind_of(e), "message": str(e)})
            except Exception as e:
                f = []
                items.append({"ok": False, "n": 0, "error_kind": kind_of(SerializationError),
                              "message": f"an output of {call.name} cannot be pickled: {e}"})
        frames.extend(f)
    return p.Result(call.invocation_id, True, "", "",
                    p.ResultMeta(duration=time.perf_counter() - t0, batch_items=items),
                    tuple(frames))


def retryable(exc: BaseException, on: list[str] | None) -> bool:
    """The exception is an instance of a class named in `on` ("module.qualname", matched
    along its MRO, so subclasses and classes defined in __main__ match); gpufn's own
    errors (a cancel, a timeout) never are."""
    if not on or isinstance(exc, GpufnError):
        return False
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}
    return not names.isdisjoint(on)


def _oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    if "torch" not in sys.modules:
        return False
    from gpufn.memory_pool.allocator import is_out_of_memory

    return is_out_of_memory(exc)


def _tag_rank(exc: BaseException, rank: int, world: int) -> None:
    """Name the failing rank in the exception's message (and a note for tracebacks)."""
    tag = f"[rank {rank} of {world}]"
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith("[rank "):
        exc.args = (f"{tag} {exc.args[0]}", *exc.args[1:])
    elif not exc.args:
        exc.args = (tag,)
    try:
        exc.add_note(f"raised on rank {rank} of {world}")
    except Exception:
        pass


def _failure(inv: str, exc: BaseException, t0: float, as_json: bool = False) -> p.Result:
    """A raised exception, pickled for its caller (a JSON caller gets its type, message
    and traceback only)."""
    frames, tb = ser.dump_exception(exc)
    if as_json:
        frames = []
    meta = p.ResultMeta(duration=time.perf_counter() - t0, error_type=type(exc).__name__,
                        traceback=tb)
    return p.Result(inv, False, "", str(exc), meta, tuple(frames))


def _gpufn_failure(inv: str, exc: GpufnError, t0: float) -> p.Result:
    return p.Result(inv, False, kind_of(exc), str(exc),
                    p.ResultMeta(duration=time.perf_counter() - t0))
