from __future__ import annotations

import pytest

import gpufn
from gpufn.wire.spec import GpuSpec, make_spec
from gpufn.wire.units import format_bytes, parse_memory


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 0), (1024, 1024), ("20GiB", 20 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", int(1.5 * 2**30)),
     ("2g", 2 * 2**30), ("100", 100), (3.0, 3)],
)
def test_parse_memory(value: object, expected: int) -> None:
    assert parse_memory(value) == expected


@pytest.mark.parametrize("value", ["20 gigs", "-1GiB", -5, True, None, [1], "GiB", float("nan")])
def test_parse_memory_rejects(value: object) -> None:
    with pytest.raises(gpufn.InvalidSpec, match="memory="):
        parse_memory(value)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(20 * 2**30) == "20.0 GiB"


def test_bare_decorator_and_defaults() -> None:
    @gpufn.gpu
    def f(x: int) -> int:
        return x + 1

    assert isinstance(f, gpufn.Function)
    assert f.spec == GpuSpec()
    assert f(1) == 2 and f.local(2) == 3
    assert f.__name__ == "f"


def test_decorator_with_options_parses_everything() -> None:
    @gpufn.gpu(count=2, type=["H100", "A100"], memory="2GiB", timeout=30, retries=2, priority=5,
               concurrency=3, gather=True)
    def g() -> None: ...

    s = g.spec
    assert (s.count, s.type, s.memory, s.timeout, s.retries, s.priority, s.concurrency, s.gather) == (
        2, ("H100", "A100"), 2 * 2**30, 30.0, 2, 5, 3, True)
    assert GpuSpec.from_wire(s.to_wire()) == s


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"count": 0}, "count=0 must be at least 1"),
        ({"count": 1.5}, "count=1.5 must be an integer"),
        ({"count": True}, "count=True must be an integer"),
        ({"type": ""}, "type=''"),
        ({"type": ["H100", 3]}, "type="),
        ({"memory": "lots"}, "memory='lots' cannot be parsed"),
        ({"timeout": 0}, "timeout=0 must be positive"),
        ({"timeout": "10s"}, "timeout='10s' must be a number"),
        ({"retries": -1}, "retries=-1 must be at least 0"),
        ({"priority": "high"}, "priority='high' must be an integer"),
        ({"concurrency": 0}, "concurrency=0"),
        ({"models": ["llama"]}, "models="),
        ({"gather": True}, "gather=True needs count>1"),
        ({"spmd": "yes"}, "spmd='yes' must be True or False"),
        ({"batch_wait_ms": 5}, "batch_wait_ms= needs batch_size="),
        ({"batch_size": 0}, "batch_size=0"),
    ],
)
def test_bad_options_fail_at_decoration(options: dict[str, object], fragment: str) -> None:
    with pytest.raises(gpufn.InvalidSpec) as e:
        gpufn.gpu(**options)  # type: ignore[arg-type]
    assert fragment in str(e.value)


def test_positional_option_is_rejected_with_fix() -> None:
    with pytest.raises(gpufn.InvalidSpec, match="keyword-only"):
        gpufn.gpu(3)  # type: ignore[arg-type]


def test_with_options_copies_and_validates() -> None:
    @gpufn.gpu(memory="1GiB")
    def h() -> None: ...

    h2 = h.with_options(priority=7, timeout=5)
    assert h2.spec.priority == 7 and h2.spec.timeout == 5.0 and h2.spec.memory == 2**30
    assert h.spec.priority == 0
    assert h2._code is h._code  # the code is pickled once for every variant
    with pytest.raises(gpufn.InvalidSpec, match="unknown option"):
        h.with_options(colour="red")
    with pytest.raises(gpufn.InvalidSpec, match="deadline"):
        h.with_options(deadline=-1)


def test_function_ids_differ_by_spec_not_by_call() -> None:
    @gpufn.gpu
    def k(x: int) -> int:
        return x

    a = k.register_message()
    assert a is k.register_message()
    b = k.with_options(priority=1).register_message()
    assert a.code_id == b.code_id and a.function_id != b.function_id


def test_make_spec_combination_rules() -> None:
    assert make_spec(count=2, gather=True).gather
    with pytest.raises(gpufn.InvalidSpec, match="batch_size"):
        make_spec(count=2, batch_size=4)


@pytest.mark.parametrize(
    ("option", "low", "high"),
    [("count", 1, 4096), ("retries", 0, 1000), ("priority", -10**9, 10**9),
     ("concurrency", 1, 10_000), ("batch_size", 1, 1_000_000)],
)
def test_integer_options_are_bounded_everywhere(option: str, low: int, high: int) -> None:
    """Out of range is InvalidSpec naming the range, at the decorator, in with_options, on
    a deployed function and on the scheduler's side (from_wire); never msgpack's
    OverflowError at submit. The bounds themselves encode."""
    @gpufn.gpu
    def f() -> None: ...

    for bad in (high + 1, low - 1, 10**30, -(10**30)):
        with pytest.raises(gpufn.InvalidSpec, match=f"{option}="):
            gpufn.gpu(**{option: bad})  # type: ignore[arg-type]
        with pytest.raises(gpufn.InvalidSpec, match=f"{option}="):
            f.with_options(**{option: bad})
        with pytest.raises(gpufn.InvalidSpec, match=f"{option}="):
            gpufn.lookup("app", "fn").with_options(**{option: bad})
        wire = {**GpuSpec().to_wire(), option: bad}
        with pytest.raises(gpufn.InvalidSpec, match=f"{option}="):
            GpuSpec.from_wire(wire)
    edge = {option: high, **({"batch_size": None} if option == "count" else {})}
    spec = make_spec(**edge)  # type: ignore[arg-type]
    from gpufn.wire import protocol as p

    reg = p.Register("f", "c", "f", spec.to_wire(), [])
    assert p.decode(p.encode(reg)).spec[option] == high


def test_priority_far_out_of_range_names_the_bound() -> None:
    @gpufn.gpu
    def f() -> None: ...

    with pytest.raises(gpufn.InvalidSpec, match=r"priority=10+ must be at most 1,000,000,000"):
        f.with_options(priority=10**30)
    with pytest.raises(gpufn.InvalidSpec, match=r"max_retries=.* at most 1,000"):
        gpufn.Retries(max_retries=10**6)


@pytest.mark.parametrize("value", [2**61, "2097152TiB", float(2**62)])
def test_sizes_larger_than_an_exbibyte_are_refused(value: object) -> None:
    with pytest.raises(gpufn.InvalidSpec, match="larger than 1 EiB"):
        parse_memory(value, "memory")
    for option in ("memory", "host_memory"):
        with pytest.raises(gpufn.InvalidSpec, match=option):
            gpufn.gpu(**{option: value})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- issue 19


@pytest.mark.parametrize(("modal", "ours"), [
    ("H100:2", "@gpu(type='H100', count=2)"), ("A100-80GB", "@gpu(type='A100-80GB')"),
    (["H100", "A100"], "@gpu(type=['H100', 'A100'])"),
])
def test_modals_gpu_spelling_is_told_gpufns(modal: object, ours: str) -> None:
    with pytest.raises(gpufn.InvalidSpec, match="Modal's spelling") as e:
        gpufn.gpu(gpu=modal)  # type: ignore[call-overload]
    assert ours in str(e.value)


def test_unknown_options_list_the_known_ones() -> None:
    with pytest.raises(gpufn.InvalidSpec, match=r"unknown option.*image.*count, type, memory"):
        gpufn.gpu(image="debian")  # type: ignore[call-overload]


def test_a_count_inside_type_is_refused_with_the_fix() -> None:
    with pytest.raises(gpufn.InvalidSpec, match=r"type='H100', count=2"):
        gpufn.gpu(type="H100:2")
    with pytest.raises(gpufn.InvalidSpec, match="not a device name"):
        gpufn.gpu(type="--")


def test_a_class_is_refused_at_decoration_pointing_to_models() -> None:
    with pytest.raises(gpufn.InvalidSpec, match=r"not the class Model.*@gpufn.model"):
        @gpufn.gpu
        class Model:
            def __call__(self) -> int:
                return 1
    with pytest.raises(gpufn.InvalidSpec, match="not the class"):
        @gpufn.gpu(memory="1GiB")
        class Other:
            pass


def test_methods_are_refused_at_decoration_but_nested_functions_are_not() -> None:
    with pytest.raises(gpufn.InvalidSpec, match=r"not the method Holder.run.*@gpufn.model"):
        class Holder:
            @gpufn.gpu(memory="1GiB")
            def run(self) -> int:
                return 1
    with pytest.raises(gpufn.InvalidSpec, match="not the method"):
        class Static:
            @gpufn.gpu
            @staticmethod
            def run() -> int:
                return 1

    def outer() -> gpufn.Function:
        @gpufn.gpu
        def inner() -> int:
            return 1
        return inner

    assert outer().local() == 1  # a function in a function (a test, a notebook cell) is fine
