"""The user API: `@gpu`, `Function` (.remote/.spawn/.map/.starmap/.local/.with_options)
and `FunctionCall`, with async twins (`await f.remote.aio(x)`, `async for r in f.map.aio(xs)`)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar, overload

from gpufn.api.call_forms import RemoteGenAttr, check_kind
from gpufn.api.calls import CallStream, FunctionCall, decode_result
from gpufn.api.map_run import _MapRun, _total
from gpufn.api.model import check_gang
from gpufn.client.client import Client
from gpufn.client.default import get_client
from gpufn.exceptions import InvalidSpec
from gpufn.runtime.context import current as current_context
from gpufn.wire import protocol as p
from gpufn.wire import serialization as ser
from gpufn.wire import shm
from gpufn.wire.byvalue import register_main_locals
from gpufn.wire.fingerprint import Fingerprint, fingerprint
from gpufn.wire.spec import OPTION_NAMES, GpuSpec, Retries, make_spec

if TYPE_CHECKING:
    from gpufn.api.cache import ResultCache

P = ParamSpec("P")  # the user function's parameters
R = TypeVar("R")    # and its return type
P2 = ParamSpec("P2")
R2 = TypeVar("R2")



# Each method with an async twin (`f.remote(...)` / `await f.remote.aio(...)`) is a
# non-data descriptor that binds a small typed object, so the user function's signature
# reaches `f.remote`, `f.spawn`, `call.get`, ... in type checkers and editors.


class _Remote(Generic[P, R]):
    """`f.remote(*args, **kwargs)`: run on a worker and return the value;
    `await f.remote.aio(...)` is the same without blocking the event loop."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Function[P, R]) -> None:
        self._fn = fn

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._fn._remote(*args, **kwargs)

    def aio(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        return self._fn._remote_aio(*args, **kwargs)


class _RemoteAttr:
    @overload
    def __get__(self, obj: None, cls: Any = None) -> _RemoteAttr: ...
    @overload
    def __get__(self, obj: Function[P2, R2], cls: Any = None) -> _Remote[P2, R2]: ...
    def __get__(self, obj: Function[Any, Any] | None, cls: Any = None) -> Any:
        return self if obj is None else _Remote(obj)


class _Map(Generic[R]):
    """`f.map(*iterables, ...)`: one call per input, results as they are needed;
    `async for r in f.map.aio(...)` is its async twin."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Function[Any, R]) -> None:
        self._fn = fn

    def __call__(self, *iterables: Iterable[Any], kwargs: dict[str, Any] | None = None,
                 order_outputs: bool = True, return_exceptions: bool = False,
                 cost: Callable[[Any], float] | None = None,
                 progress: bool | None = None) -> Iterator[R]:
        return self._fn._map(*iterables, kwargs=kwargs, order_outputs=order_outputs,
                             return_exceptions=return_exceptions, cost=cost, progress=progress)

    def aio(self, *iterables: Iterable[Any], kwargs: dict[str, Any] | None = None,
            order_outputs: bool = True, return_exceptions: bool = False,
            cost: Callable[[Any], float] | None = None,
            progress: bool | None = False) -> AsyncIterator[R]:
        return self._fn._map_aio(*iterables, kwargs=kwargs, order_outputs=order_outputs,
                                 return_exceptions=return_exceptions, cost=cost, progress=progress)


class _MapAttr:
    @overload
    def __get__(self, obj: None, cls: Any = None) -> _MapAttr: ...
    @overload
    def __get__(self, obj: Function[Any, R2], cls: Any = None) -> _Map[R2]: ...
    def __get__(self, obj: Function[Any, Any] | None, cls: Any = None) -> Any:
        return self if obj is None else _Map(obj)


class _Starmap(Generic[R]):
    """`f.starmap(iterable_of_arg_tuples, ...)`: `map` over argument tuples (and `.aio`)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Function[Any, R]) -> None:
        self._fn = fn

    def __call__(self, iterable: Iterable[Iterable[Any]], **kw: Any) -> Iterator[R]:
        return self._fn._starmap(iterable, **kw)

    def aio(self, iterable: Iterable[Iterable[Any]], **kw: Any) -> AsyncIterator[R]:
        return self._fn._starmap_aio(iterable, **kw)


class _StarmapAttr:
    @overload
    def __get__(self, obj: None, cls: Any = None) -> _StarmapAttr: ...
    @overload
    def __get__(self, obj: Function[Any, R2], cls: Any = None) -> _Starmap[R2]: ...
    def __get__(self, obj: Function[Any, Any] | None, cls: Any = None) -> Any:
        return self if obj is None else _Starmap(obj)


# --------------------------------------------------------------------------- functions


class _CodeCache:
    """Pickled code shared by a function and its with_options() copies."""

    __slots__ = ("code_id", "fingerprint", "frames", "lock")

    def __init__(self) -> None:
        self.code_id: str | None = None
        self.frames: list[Any] = []
        self.fingerprint: Fingerprint | None = None  # what the frames were pickled from
        self.lock = threading.Lock()


class Function(Generic[P, R]):
    """A function that runs on gpufn workers; call it like the original to run locally."""

    # Defaults for subclasses that do not run __init__ (a deployed function looked up by
    # name): not a generator, no result cache.
    _yields: bool = False
    _cache: ResultCache | None = None

    def __init__(self, fn: Callable[P, R], spec: GpuSpec, models: tuple[Any, ...] = ()) -> None:
        self._fn = fn
        self.spec = spec
        self._models = models
        self.name: str = str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "function"))
        self._code = _CodeCache()
        self._register: p.Register | None = None
        self._cache: ResultCache | None = None
        self._yields = inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)
        functools.update_wrapper(self, fn)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_code"] = None
        state["_register"] = None
        state["_cache"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._code = _CodeCache()

    def __repr__(self) -> str:
        return f"<gpufn.Function {self.name} {self.spec.describe()}>"

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._fn(*args, **kwargs)

    def local(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run in this process (no worker, no device assignment)."""
        return self._fn(*args, **kwargs)

    def with_options(self, **options: Any) -> Function[P, R]:
        """A copy with changed options, e.g. f.with_options(priority=10, timeout=60)."""
        models = self._models
        if "models" in options:
            models = _check_models(options["models"])
            options["models"] = tuple(m.name for m in models)
        unknown = set(options) - set(OPTION_NAMES)
        if unknown:
            raise InvalidSpec(f"unknown option(s) {sorted(unknown)} in with_options(); "
                              f"known options: {', '.join(OPTION_NAMES)}")
        spec = make_spec(self.spec, **options)
        check_gang(models, spec.count, spec.spmd, self.name)
        new = Function(self._fn, spec, models)
        if (new.spec.autocast, new.spec.device_args) == (self.spec.autocast, self.spec.device_args):
            new._code = self._code  # else the pickled code differs: it carries the options
            if new.spec.cache == self.spec.cache:
                new._cache = self._cache
        check_kind(self._fn, new.spec)
        new.name = self.name
        return new

    # ------------------------------------------------------------------ wire

    def _code_frames(self) -> tuple[str, list[Any]]:
        """The function's code as it is now, so a call sees its globals as they are when it
        is made (like `.local()`): pickled again only when the fingerprint of the code and
        the globals it reads changed; unchanged code keeps its id and is not sent again."""
        from gpufn.runtime.call_options import wrap

        target = wrap(self._fn, self.spec.autocast, self.spec.device_args)
        if getattr(self._fn, "__module__", None) == "__main__":
            register_main_locals()  # newly imported local modules change what is by value
        fp = fingerprint(target)
        c = self._code
        if fp is not None:
            with c.lock:
                if c.fingerprint is not None and c.code_id is not None and c.fingerprint.key == fp.key:
                    return c.code_id, c.frames
        code_id, frames = ser.dump_code(target, self.name)
        with c.lock:
            if c.code_id != code_id:
                c.code_id, c.frames = code_id, frames
            c.fingerprint = fp
            return c.code_id, c.frames

    def register_message(self) -> p.Register:
        code_id, frames = self._code_frames()
        reg = self._register
        if reg is None or reg.code_id != code_id:
            reg = self._register = build_register(code_id, frames, self.name, self.spec,
                                                  self._models)
        return reg

    def _prepare(self, client: Client) -> tuple[p.Register | None, str, dict[str, Any]]:
        """What calls are sent as: (the Register to send first, or None; the function id
        to submit; per-call options). Once per `.remote`/`.spawn`/`.map`."""
        dep = self.__dict__.get("_deployment")
        if dep is not None:  # a deployed app's function, called from that app's code on a worker
            ctx = current_context()
            if ctx is not None and ctx.app == dep[0]:
                return None, p.app_alias(dep[0], dep[1], ctx.version), {}
        reg = self.register_message()
        return reg, reg.function_id, {}

    def _result_cache(self) -> ResultCache | None:
        """This function's result cache (`@gpu(cache=...)`), or None."""
        if not self.spec.cache:
            return None
        if self._cache is None:
            from gpufn.api.cache import ResultCache, code_digest

            extra = [f"autocast={self.spec.autocast}", f"device_args={self.spec.device_args}"]
            extra += [f"model {m.name} {code_digest(m.loader)}" for m in self._models]
            self._cache = ResultCache(self.spec.cache, code_digest(self._fn, extra))
        return self._cache

    def cache_info(self) -> dict[str, Any]:
        """What the result cache did in this process: hits (read from the store), computed
        (submitted here), waited (computed by an identical call elsewhere), and its directory."""
        cache = self._result_cache()
        if cache is None:
            return {"enabled": False}
        return {"enabled": True, "dir": str(cache.store.root), **cache.stats.as_dict()}

    def _start(self, client: Client, sub: p.Submit) -> FunctionCall[R]:
        """Submit a call, through the result cache when the function has one: a stored
        result or an identical call in flight anywhere answers it without a device."""
        cache = self._result_cache()
        if cache is None:
            return FunctionCall(sub.invocation_id, client.submit(sub, self.name), self.name, client)
        inv, fut = cache.call(sub.frames, lambda: (sub.invocation_id, client.submit(sub, self.name)))
        return FunctionCall(inv, fut, self.name, client)

    def _submit_message(self, client: Client, args: tuple[Any, ...], kwargs: dict[str, Any],
                        target: tuple[p.Register | None, str, dict[str, Any]] | None = None,
                        keep: bool = False) -> p.Submit:
        # cached: keyed by its frames; plain values: nothing could go to shared memory
        is_plain = ser.plain((args, kwargs))
        out = None if self.spec.cache or is_plain else client.shm_outgoing()
        frames = ser.dump_args(self.name, args, kwargs, out, is_plain)
        reg, fid, options = target or self._prepare(client)
        if reg is not None:
            client.ensure_registered(reg)
        # keep: the scheduler keeps the Result a while, for FunctionCall.from_id
        sub = p.Submit(client.new_id(), fid, options, keep,
                       shm=client.shm_results and not self.spec.cache, frames=tuple(frames))
        if out is not None and out.names:
            client.track_shm(sub.invocation_id, out)
        return sub

    # ------------------------------------------------------------------ calls

    def spawn(self, *args: P.args, **kwargs: P.kwargs) -> FunctionCall[R]:
        """Start a call and return at once with a handle (.get(), .cancel(), .done(), .id;
        .stream() for a generator function). `FunctionCall.from_id(call.id)` in another
        process gets its result too."""
        client = get_client()
        sub = self._submit_message(client, args, kwargs, keep=True)
        if self._yields:
            fut, items = client.submit_stream(sub, self.name)
            return FunctionCall(sub.invocation_id, fut, self.name, client, items)
        return self._start(client, sub)

    def _remote_gen(self, *args: Any, **kwargs: Any) -> CallStream[Any]:
        if not self._yields:
            raise InvalidSpec(f"{self.name} is not a generator function: call it with .remote()")
        client = get_client()
        sub = self._submit_message(client, args, kwargs)
        fut, items = client.submit_stream(sub, self.name)
        return FunctionCall(sub.invocation_id, fut, self.name, client, items).stream()

    remote_gen = RemoteGenAttr()

    def _not_for_generators(self, form: str) -> None:
        if self._yields:
            raise InvalidSpec(f"{self.name} is a generator function: call it with "
                              f".remote_gen(...) or .spawn(...).stream(), not .{form}()")

    def _remote(self, *args: Any, **kwargs: Any) -> R:
        if self._yields:
            self._not_for_generators("remote")
        if self.spec.cache:
            return self.spawn(*args, **kwargs).get()
        client = get_client()
        is_plain = ser.plain((args, kwargs))  # then nothing could go to shared memory
        out = None if is_plain else client.shm_outgoing()
        frames = ser.dump_args(self.name, args, kwargs, out, is_plain)
        reg, fid, options = self._prepare(client)
        sub = p.Submit(client.new_id(), fid, options, shm=client.shm_results,
                       frames=tuple(frames))
        if out is None or not out.names:
            return decode_result(client.call(reg, sub, self.name), self.name)
        result: p.Result | None = None
        try:  # the argument files go when the call ends, read by a worker or not
            result = client.call(reg, sub, self.name)
            return decode_result(result, self.name)
        finally:  # (pooled ones the worker let go of are kept for the next call)
            shm.release(out.names, client.shm_reusable(result.meta if result else None))

    async def _remote_aio(self, *args: Any, **kwargs: Any) -> R:
        if self._yields:
            self._not_for_generators("remote.aio")
        client = get_client()
        # Not kept for `from_id` (no one holds its id): like a blocking call it may go
        # under a lease, straight to a worker (its client's I/O thread sends it).
        call = self._start(client, self._submit_message(client, args, kwargs))
        try:
            return await call.get.aio()
        except asyncio.CancelledError:
            call.cancel()  # the awaiting task was cancelled: so is the remote call
            raise

    remote = _RemoteAttr()

    def _map(self, *iterables: Iterable[Any], kwargs: dict[str, Any] | None = None,
             order_outputs: bool = True, return_exceptions: bool = False,
             cost: Callable[[Any], float] | None = None,
             progress: bool | None = None) -> Iterator[Any]:
        self._not_for_generators("map")
        if not iterables:
            raise TypeError(f"{self.name}.map() needs at least one iterable of inputs")
        total = _total(iterables)
        items = _inputs(iterables, kwargs)
        return _MapRun(self, items, total, order_outputs, return_exceptions, cost, progress).run()

    async def _map_aio(self, *iterables: Iterable[Any], kwargs: dict[str, Any] | None = None,
                       order_outputs: bool = True, return_exceptions: bool = False,
                       cost: Callable[[Any], float] | None = None,
                       progress: bool | None = False) -> AsyncIterator[Any]:
        self._not_for_generators("map")
        if not iterables:
            raise TypeError(f"{self.name}.map.aio() needs at least one iterable of inputs")
        items = _inputs(iterables, kwargs)
        run = _MapRun(self, items, _total(iterables), order_outputs, return_exceptions, cost, progress)
        async for value in run.run_aio():
            yield value

    map = _MapAttr()

    def for_each(self, *iterables: Iterable[Any], kwargs: dict[str, Any] | None = None,
                 ignore_exceptions: bool = False) -> None:
        """Run one call per input for its side effects and wait for all of them; returns
        nothing. The first failure is raised (the calls not started yet are dropped),
        unless ignore_exceptions=True."""
        for _ in self._map(*iterables, kwargs=kwargs, order_outputs=False,
                           return_exceptions=ignore_exceptions, progress=False):
            pass

    def spawn_map(self, *iterables: Iterable[Any],
                  kwargs: dict[str, Any] | None = None) -> list[FunctionCall[R]]:
        """Submit one call per input and return at once, without waiting for any: the
        calls run on their own (use the handles, or `gpufn.gather(*calls)`, for results)."""
        self._not_for_generators("spawn_map")
        if not iterables:
            raise TypeError(f"{self.name}.spawn_map() needs at least one iterable of inputs")
        client = get_client()
        subs = [self._submit_message(client, a, k, keep=True) for a, k in _inputs(iterables, kwargs)]
        futs = client.submit_many([(sub, self.name) for sub in subs])
        return [FunctionCall(sub.invocation_id, fut, self.name, client)
                for sub, fut in zip(subs, futs, strict=True)]

    def _starmap(self, iterable: Iterable[Iterable[Any]], **kw: Any) -> Iterator[Any]:
        items: Iterator[tuple[tuple[Any, ...], dict[str, Any]]] = ((tuple(a), {}) for a in iterable)
        return _MapRun(self, items, _total((iterable,)), kw.get("order_outputs", True),
                       kw.get("return_exceptions", False), kw.get("cost"), kw.get("progress")).run()

    async def _starmap_aio(self, iterable: Iterable[Iterable[Any]], **kw: Any) -> AsyncIterator[Any]:
        items: Iterator[tuple[tuple[Any, ...], dict[str, Any]]] = ((tuple(a), {}) for a in iterable)
        run = _MapRun(self, items, _total((iterable,)), kw.get("order_outputs", True),
                      kw.get("return_exceptions", False), kw.get("cost"), kw.get("progress", False))
        async for value in run.run_aio():
            yield value

    starmap = _StarmapAttr()


def build_register(code_id: str, frames: list[Any], name: str, spec: GpuSpec,
                   models: tuple[Any, ...]) -> p.Register:
    """A function's Register: its id hashes code, spec and model names; the models'
    loader code travels after the function's own frames."""
    wire = spec.to_wire()
    descs = [m.wire_description() for m in models]
    fid = ser.content_hash(code_id.encode(), json.dumps(wire, sort_keys=True).encode(),
                           json.dumps([m["name"] for m in descs]).encode())
    all_frames = list(frames)
    for m in models:
        all_frames += m.loader_frames()
    return p.Register(fid, code_id, name, wire, descs, tuple(all_frames))


def _inputs(iterables: tuple[Iterable[Any], ...], kwargs: dict[str, Any] | None,
            ) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """(args, kwargs) per call: one argument from each iterable, the same keywords for all."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs= must be a dict of keyword arguments, got {type(kwargs).__name__}")
    kw = kwargs or {}
    return ((a, kw) for a in zip(*iterables, strict=False))


def _check_models(models: Any) -> tuple[Any, ...]:
    from gpufn.api.model import Model

    if isinstance(models, Model):
        models = (models,)
    try:
        out = tuple(models)
    except TypeError:
        out = None
    if out is None or not all(isinstance(m, Model) for m in out):
        raise InvalidSpec(
            f"models={models!r} must be a list of models declared with @gpufn.model, "
            "e.g. @gpu(models=[llama])"
        )
    return out


_WARM_HINT = ("for setup that should stay warm between calls (a model, a tokenizer), "
              "declare it with @gpufn.model and name it in @gpu(models=[...])")


def _refuse_classes_and_methods(fn: Any) -> None:
    """@gpu runs one function per call; a class (Modal's @app.cls) or a method is refused."""
    if isinstance(fn, type):
        raise InvalidSpec(f"@gpu decorates functions, not the class {fn.__name__}: "
                          f"decorate a module-level function instead; {_WARM_HINT}.")
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    qualname = str(getattr(fn, "__qualname__", ""))
    owner = qualname.rpartition(".")[0]
    if inspect.isfunction(fn) and owner and not owner.endswith("<locals>"):
        raise InvalidSpec(f"@gpu decorates functions, not the method "
                          f"{qualname.rpartition('<locals>.')[2]}: move it to "
                          f"module level (it gets no `self`); {_WARM_HINT}.")


def _refuse_unknown(options: dict[str, Any]) -> None:
    from gpufn.wire.spec import modal_gpu_hint

    if "gpu" in options:
        raise InvalidSpec(f"@gpu(gpu={options['gpu']!r}) is Modal's spelling; gpufn's is "
                          f"{modal_gpu_hint(options['gpu'])}.")
    names = ", ".join(sorted(options))
    known = [o for o in OPTION_NAMES if not o.startswith("retry_") and o != "deadline"]
    raise InvalidSpec(f"@gpu got unknown option(s) {names}; its options are {', '.join(known)}.")


class _GpuDecorator(Protocol):
    """What `gpu(...)` with options returns: a decorator that keeps the signature."""

    def __call__(self, fn: Callable[P2, R2], /) -> Function[P2, R2]: ...


@overload
def gpu(
    _fn: Callable[P, R], *, count: int = 1, type: str | list[str] | None = None,
    memory: int | str | None = None, timeout: float | None = None, retries: int | Retries = 0,
    priority: int = 0, concurrency: int = 1, models: Iterable[Any] = (), gather: bool = False,
    spmd: bool = True, preemptible: bool = False, batch_size: int | None = None,
    batch_wait_ms: float | None = None, cache: bool | str = False, autocast: str | None = None,
    device_args: bool = False, host_memory: int | str | None = None,
) -> Function[P, R]: ...


@overload
def gpu(
    _fn: None = None, *, count: int = 1, type: str | list[str] | None = None,
    memory: int | str | None = None, timeout: float | None = None, retries: int | Retries = 0,
    priority: int = 0, concurrency: int = 1, models: Iterable[Any] = (), gather: bool = False,
    spmd: bool = True, preemptible: bool = False, batch_size: int | None = None,
    batch_wait_ms: float | None = None, cache: bool | str = False, autocast: str | None = None,
    device_args: bool = False, host_memory: int | str | None = None,
) -> _GpuDecorator: ...


def gpu(
    _fn: Callable[..., Any] | None = None, *, count: int = 1, type: str | list[str] | None = None,
    memory: int | str | None = None, timeout: float | None = None, retries: int | Retries = 0,
    priority: int = 0, concurrency: int = 1, models: Iterable[Any] = (), gather: bool = False,
    spmd: bool = True, preemptible: bool = False, batch_size: int | None = None,
    batch_wait_ms: float | None = None, cache: bool | str = False, autocast: str | None = None,
    device_args: bool = False, host_memory: int | str | None = None, **unknown: Any,
) -> Any:
    """Declare a function's GPU needs; it then runs remotely with .remote()/.map()/.spawn().

    `@gpu` alone works too. Every option's form is validated here: a bad value raises
    `gpufn.InvalidSpec` at import time, naming the option and the fix. Whether some device
    can satisfy it (a `type=` name, `memory=`, `count=`) the cluster decides at the first
    call (`Unschedulable` at once, listing its devices).
    """
    if unknown:
        _refuse_unknown(unknown)
    model_objs = _check_models(models)
    spec = make_spec(
        count=count, type=type, memory=memory, timeout=timeout, retries=retries,
        priority=priority, concurrency=concurrency, models=tuple(m.name for m in model_objs),
        gather=gather, spmd=spmd, preemptible=preemptible, batch_size=batch_size,
        batch_wait_ms=batch_wait_ms, cache=cache, autocast=autocast, device_args=device_args,
        host_memory=host_memory,
    )

    def wrap(fn: Callable[..., Any]) -> Function[Any, Any]:
        if isinstance(fn, Function):
            fn = fn._fn
        _refuse_classes_and_methods(fn)
        if not callable(fn):
            raise InvalidSpec(f"@gpu decorates a function, not {fn!r}")
        check_gang(model_objs, spec.count, spec.spmd, getattr(fn, "__qualname__", ""))
        check_kind(fn, spec)
        return Function(fn, spec, model_objs)

    if _fn is not None:
        if not callable(_fn):
            raise InvalidSpec(
                f"@gpu got {_fn!r} as a positional argument; options are keyword-only, "
                "e.g. @gpu(memory='2GiB')")
        return wrap(_fn)
    return wrap
