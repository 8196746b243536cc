"""One `.map()`: windowed submission, ordered or unordered results, cancel on failure or
when the caller stops iterating, optional longest-first ordering by cost, a progress bar."""

from __future__ import annotations

import asyncio
import functools
import queue
import sys
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from gpufn.api.calls import FunctionCall
from gpufn.client.client import Client
from gpufn.client.default import get_client
from gpufn.exceptions import InvalidSpec
from gpufn.wire import config
from gpufn.wire import protocol as p
from gpufn.wire.spec import GpuSpec

Target = tuple[p.Register | None, str, dict[str, Any]]  # what `_prepare` gives: see Function


class Mappable(Protocol):
    """What a map run needs of the function it maps (a `Function`)."""

    name: str
    spec: GpuSpec

    def _prepare(self, client: Client) -> Target: ...

    def _submit_message(self, client: Client, args: tuple[Any, ...], kwargs: dict[str, Any],
                        target: Target | None = None, keep: bool = False) -> p.Submit: ...

    def _start(self, client: Client, sub: p.Submit) -> FunctionCall[Any]: ...

MAP_WINDOW = 4096               # calls in flight per .map()
LEASED_MAPS = True  # see `_send`; False: a map's calls all go through the scheduler
MAP_REFILL = 128                # refill the window in batches of at least this many
MAP_WINDOW_BYTES = 256 * 2**20  # argument bytes in flight per .map()


def _total(iterables: tuple[Iterable[Any], ...]) -> int | None:
    try:
        return min(len(it) for it in iterables)  # type: ignore[arg-type]
    except TypeError:
        return None


def _show_progress(progress: bool | None, total: int | None) -> bool:
    if progress is not None:
        return progress
    if not config.progress_enabled() or (total is not None and total < 2):
        return False
    if "ipykernel" in sys.modules:
        return True
    try:
        return sys.stderr.isatty()
    except Exception:
        return False


class _MapRun:
    """One .map(): windowed submission, ordered or unordered results, cancel on failure
    or when the caller stops iterating, optional LPT ordering by cost, progress bar."""

    def __init__(self, fn: Mappable, items: Iterable[tuple[tuple[Any, ...], dict[str, Any]]],
                 total: int | None, order_outputs: bool, return_exceptions: bool,
                 cost: Callable[[Any], float] | None, progress: bool | None) -> None:
        self.fn = fn
        self.order_outputs = order_outputs
        self.return_exceptions = return_exceptions
        self.total = total
        self.progress = _show_progress(progress, total)
        self.ordered_by_cost = cost is not None
        if cost is not None:
            listed = list(items)
            try:
                costs = [float(cost(*a, **k)) for a, k in listed]
            except Exception as e:
                raise InvalidSpec(f"cost= raised {type(e).__name__}: {e}; it must map an input "
                                  "to a number, e.g. cost=len") from e
            # Longest first: big inputs start early and do not straggle at the end.
            order = sorted(range(len(listed)), key=lambda i: -costs[i])
            self.items: Iterator[tuple[int, tuple[Any, ...], dict[str, Any]]] = iter(
                [(i, *listed[i]) for i in order])
            self.total = len(listed)
        else:
            self.items = ((i, a, k) for i, (a, k) in enumerate(items))
        self.window = config.map_window()
        self.target: tuple[p.Register | None, str, dict[str, Any]] | None = None
        self.calls: dict[int, FunctionCall[Any]] = {}
        self.sizes: dict[int, int] = {}
        self.inflight_bytes = 0
        self.done_q: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.exhausted = False
        self.submitted = 0
        self.failed = False

    def _fill(self, client: Client) -> None:
        free = self.window - len(self.calls)
        if self.calls and free < min(MAP_REFILL, self.window // 2):
            return  # refill in batches: one send and one wake-up for many calls
        batch: list[tuple[int, p.Submit]] = []
        while (not self.exhausted and len(self.calls) + len(batch) < self.window
               and self.inflight_bytes < MAP_WINDOW_BYTES):
            try:
                idx, args, kwargs = next(self.items)
            except StopIteration:
                self.exhausted = True
                break
            if self.target is None:  # once per map: the code as it is when the map starts
                self.target = self.fn._prepare(client)
            sub = self.fn._submit_message(client, args, kwargs, self.target)
            size = sum(len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes
                       for f in sub.frames) + client.shm_bytes(sub.invocation_id)
            self.sizes[idx] = size
            self.inflight_bytes += size
            batch.append((idx, sub))
            if len(batch) >= 256:
                self._send(client, batch)
                batch = []
        if batch:
            self._send(client, batch)

    def _send(self, client: Client, batch: list[tuple[int, p.Submit]]) -> None:
        if self.fn.spec.cache:  # one by one through the cache
            for idx, sub in batch:
                call = self.calls[idx] = self.fn._start(client, sub)
                call._future.add_done_callback(functools.partial(self._completed, idx))
            self.submitted += len(batch)
            return
        # A .map's calls take leases: each lease at most a few of them in flight by their
        # run time (gpufn/client/leases.py DEPTH_SECONDS), the rest waiting in the client
        # or at the scheduler for the devices no lease holds (bench/leased_maps.py,
        # bench/multihost.py --leased-maps). Longest first (cost=) is an order across
        # devices, the scheduler's to keep: those go through it.
        futs = client.submit_many([(sub, self.fn.name) for _, sub in batch],
                                  lease=LEASED_MAPS and not self.ordered_by_cost)
        for (idx, sub), fut in zip(batch, futs, strict=True):
            self.calls[idx] = FunctionCall(sub.invocation_id, fut, self.fn.name, client)
            fut.add_done_callback(functools.partial(self._completed, idx))
        self.submitted += len(batch)

    def _completed(self, idx: int, _fut: Future[p.Result]) -> None:
        self.done_q.put(idx)

    def _cancel_rest(self, client: Client, include_running: bool, after: int = -1) -> None:
        """Cancel the calls still out (those of inputs past `after`)."""
        for idx, call in list(self.calls.items()):  # may run beside the thread that fills it
            if idx > after and not call.done():
                client.cancel(call.id, "the map was stopped", include_running)

    def _outcome(self, idx: int) -> tuple[bool, Any]:
        call = self.calls.pop(idx)
        self.inflight_bytes -= self.sizes.pop(idx, 0)
        try:
            return True, call.get()
        except Exception as e:
            if not self.return_exceptions:  # raised out of the map: say whose it was
                e.add_note(f"(input {idx} of {self.fn.name}.map, call {call.id})")
            return False, e

    def _steps(self) -> Iterator[tuple[int, bool, Any]]:
        """Completed (index, ok, value) in completion order, keeping the window full. The
        first failure ends the map: what has not started is dropped and it is raised; in
        order (`order_outputs`), the inputs before it are waited for and yielded first,
        and the failure raised is the first in input order."""
        client = get_client()
        first: tuple[int, BaseException] | None = None  # the earliest failure so far
        try:
            self._fill(client)
            while self.calls:
                if first is not None and not any(i < first[0] for i in self.calls):
                    break
                idx = self.done_q.get()
                ok, value = self._outcome(idx)
                if not ok and not self.return_exceptions:
                    self.failed = True  # no more submits; drop what has not started
                    if not self.order_outputs or self.ordered_by_cost:
                        self._cancel_rest(client, include_running=False)
                        raise value
                    if first is None or idx < first[0]:
                        first = (idx, value)
                        self._cancel_rest(client, include_running=False, after=idx)
                    continue
                if first is not None:
                    if idx < first[0]:
                        yield idx, ok, value
                    continue
                self._fill(client)
                yield idx, ok, value
            if first is not None:
                raise first[1]
        except BaseException:  # closed early, Ctrl-C, ...: stop everything still out
            if not self.failed:
                self._cancel_rest(client, include_running=True)
            raise

    def _ordered(self, steps: Iterator[tuple[int, bool, Any]]) -> Generator[Any, None, None]:
        if not self.order_outputs:
            for _, _, value in steps:
                yield value
            return
        held: dict[int, Any] = {}
        nxt = 0
        for idx, _, value in steps:
            held[idx] = value
            while nxt in held:
                yield held.pop(nxt)
                nxt += 1

    def run(self) -> Iterator[Any]:
        if not self.progress:
            yield from self._ordered(self._steps())
            return
        from gpufn.api.progress import make_bar

        get_client()  # connect (or start the embedded cluster, saying so) before the bar shows
        bar = make_bar(f"{self.fn.name}.map", self.total)

        def counted() -> Iterator[tuple[int, bool, Any]]:
            for step in self._steps():
                bar.advance()
                yield step

        try:
            yield from self._ordered(counted())
        finally:
            bar.close()

    async def run_aio(self) -> AsyncIterator[Any]:
        """The same, without blocking the event loop: completions are awaited."""
        steps: Generator[Any, None, None] = self._ordered(self._steps())
        sentinel = object()
        pool = ThreadPoolExecutor(1, thread_name_prefix="gpufn-map-aio")
        step: Future[Any] | None = None
        finished = False
        try:
            while True:
                step = pool.submit(next, steps, sentinel)
                value = await asyncio.wrap_future(step)
                if value is sentinel:
                    finished = True
                    return
                yield value
        finally:
            if not finished:
                self._cancel_rest(get_client(), include_running=True)
            if step is not None and not step.done():
                # still running in its thread (it ends as the cancelled calls report):
                # close the generator once that step returns
                step.add_done_callback(lambda _f: steps.close())
            else:
                steps.close()
            pool.shutdown(wait=False)
