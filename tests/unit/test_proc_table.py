"""The process table as /proc shows it, read on real processes: a stat line whose name
holds spaces and parentheses, a zombie, a gone pid; parent, group, session and resident
bytes of this process; the children a thread started, a tree parents first, PSS against
RSS, signals to gone pids, the host's memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpufn.worker.host import proc_table

pytestmark = [pytest.mark.skipif(not proc_table.HAS_PROC, reason="needs Linux /proc"),
              pytest.mark.timeout(60)]

MiB = 2**20


def _stat_line(comm: str, state: str = "S", rss_pages: int = 25) -> bytes:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice threads itrealvalue starttime vsize rss ...
    fields = [state, "7", "8", "9", *["0"] * 16, "4096", str(rss_pages), "0", "0"]
    return f"42 ({comm}) {' '.join(fields)}".encode()


def test_a_stat_line_is_read_past_a_name_with_spaces_and_parentheses() -> None:
    got = proc_table._parse_stat(42, _stat_line("a (b) c)"))
    assert got == proc_table.Proc(42, 7, 8, 9, 25 * proc_table.PAGE)
    assert proc_table._parse_stat(42, _stat_line("z", state="Z")).rss == 0  # type: ignore[union-attr]
    assert proc_table._parse_stat(42, _stat_line("x", state="X")).rss == 0  # type: ignore[union-attr]
    assert proc_table._parse_stat(42, _stat_line("r", state="R")).rss == 25 * proc_table.PAGE  # type: ignore[union-attr]
    full = _stat_line("p").split()
    assert proc_table._parse_stat(42, b" ".join(full[:24])) is not None  # 22 fields after the name
    assert proc_table._parse_stat(42, b" ".join(full[:23])) is None  # one short


def test_this_process_as_the_table_reads_it() -> None:
    me = proc_table.read(os.getpid())
    assert me is not None
    assert (me.pid, me.ppid, me.pgrp, me.session) == (os.getpid(), os.getppid(), os.getpgrp(),
                                                      os.getsid(0))
    assert 10 * MiB < me.rss < 64 * 2**30
    assert os.getpid() in {p.pid for p in proc_table.snapshot()}
    assert os.getpid() in proc_table.in_session(os.getsid(0))
    resident = proc_table.Resident(os.getpid())
    try:
        assert abs(resident.bytes() - me.rss) < 64 * MiB
    finally:
        resident.close()
    assert resident.bytes() == 0  # closed: reads nothing
    resident.close()  # twice: no error
    pss = proc_table.pss(os.getpid())
    assert pss is not None and 0 < pss <= me.rss + 64 * MiB


def test_a_gone_process_reads_as_nothing() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    gone = child.pid
    assert proc_table.read(gone) is None and proc_table.pss(gone) is None
    assert proc_table.children(gone) == [] and proc_table.tree([gone]) == [gone]
    assert proc_table.thread_children(-1) == []
    proc_table.signal_all([gone, gone])  # no error for what is gone


def test_a_zombie_is_listed_with_no_resident_bytes() -> None:
    child = subprocess.Popen(["sleep", "0.2"])
    try:
        deadline = time.monotonic() + 20
        while _state(child.pid) != "Z":  # ended, not reaped yet: a zombie
            assert time.monotonic() < deadline
            time.sleep(0.02)
        z = proc_table.read(child.pid)
        assert z is not None and z.pid == child.pid and z.rss == 0
        assert child.pid in {p.pid for p in proc_table.snapshot()}
    finally:
        child.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[-1].split()[0]


def test_children_by_thread_and_a_tree_parents_first() -> None:
    shell = subprocess.Popen(["bash", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE,
                             text=True)
    other: list[subprocess.Popen[bytes]] = []
    started, done = threading.Event(), threading.Event()

    def start_other() -> None:  # alive while looked at: a thread's children pass to
        other.append(subprocess.Popen(["sleep", "30"]))  # another thread when it ends
        started.set()
        done.wait(30)

    t = threading.Thread(target=start_other)
    t.start()
    started.wait(30)
    try:
        assert shell.stdout is not None
        sleeper = int(shell.stdout.readline())
        mine = proc_table.thread_children(threading.get_native_id())
        assert shell.pid in mine and other[0].pid not in mine  # the other thread's
        assert {shell.pid, other[0].pid} <= set(proc_table.children(os.getpid()))
        assert proc_table.children(shell.pid) == [sleeper]
        assert proc_table.tree([shell.pid, shell.pid]) == [shell.pid, sleeper]
        proc_table.signal_all(proc_table.tree([shell.pid]), signal.SIGKILL)
        shell.wait(10)
        deadline = time.monotonic() + 10
        while (s := proc_table.read(sleeper)) is not None and s.rss:
            assert time.monotonic() < deadline, "the shell's sleep was not killed"
            time.sleep(0.02)
    finally:
        done.set()
        t.join()
        for p in (shell, *other):
            p.kill()
            p.wait()


def test_pss_counts_the_pages_a_fork_shares_once() -> None:
    script = ("import os, time\n"
              "b = b'x' * (200 * 2**20)\n"
              "if os.fork() == 0:\n"
              "    time.sleep(30)\n"
              "    os._exit(0)\n"
              "print('ready', flush=True)\n"
              "time.sleep(30)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "ready\n"
        [child] = proc_table.children(parent.pid)
        rss = [proc_table.read(p).rss for p in (parent.pid, child)]  # type: ignore[union-attr]
        pss = [proc_table.pss(p) or 0 for p in (parent.pid, child)]
        assert min(rss) > 190 * MiB  # each maps the 200 MiB...
        assert sum(pss) < sum(rss) - 150 * MiB  # ...shared: counted once between them
    finally:
        proc_table.signal_all(proc_table.in_session(parent.pid))
        parent.wait()


def test_the_hosts_memory_is_read() -> None:
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024  # MemTotal
    limit = proc_table.host_memory_limit()
    assert 0 < limit <= total
    available = proc_table.available_memory()
    assert available is not None and 0 < available <= total


# --- pieces cosmic-ray's mutants showed unpinned (scripts/mutants.py --room proc_table) ---


def _fake_files(monkeypatch: pytest.MonkeyPatch, files: dict[str, str | None]) -> None:
    """proc_table's open() sees these files (None: gone), the rest as they are."""
    import io

    real = open

    def fake_open(path: str, mode: str = "r", *args: object, **kwargs: object) -> object:
        if path in files:
            data = files[path]
            if data is None:
                raise FileNotFoundError(path)
            return io.BytesIO(data.encode()) if "b" in mode else io.StringIO(data)
        return real(path, mode, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(proc_table, "open", fake_open, raising=False)


def test_kilobytes_in_proc_files_are_read_as_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_files(monkeypatch, {
        "/proc/meminfo": "MemTotal:       16000 kB\nMemFree: 100 kB\nMemAvailable:    1000 kB\n",
        "/proc/42/smaps_rollup": "00400000-7fff [rollup]\nRss:  300 kB\nPss:  250 kB\n",
    })
    assert proc_table.available_memory() == 1000 * 1024
    assert proc_table.pss(42) == 250 * 1024


def test_a_cgroup_path_with_a_colon_is_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_files(monkeypatch, {"/proc/self/cgroup": "0::/jobs/a:b\n"})
    assert "/sys/fs/cgroup/jobs/a:b/memory.max" in proc_table._cgroup_limit_files()


def test_no_cgroup_limit_leaves_the_hosts_ram_and_an_odd_cgroup_file_is_ignored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ram = proc_table.host_memory_limit()
    _fake_files(monkeypatch, {"/proc/self/cgroup": "not a cgroup line\n",
                              "/sys/fs/cgroup/memory.max": "max\n",
                              "/sys/fs/cgroup/memory/memory.limit_in_bytes": "4096\n"})
    assert proc_table._cgroup_limit_files() == [
        "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    assert proc_table.host_memory_limit() == 4096  # "max" is no limit; v1's 4096 is one
    assert ram >= 4096


def test_a_processs_resident_bytes_read_again_are_its_rss_not_its_size() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        resident = proc_table.Resident(child.pid)
        try:
            proc = proc_table.read(child.pid)
            # statm's resident field, not its first (the size mapped, megabytes more)
            assert proc is not None and abs(resident.bytes() - proc.rss) < 2 * MiB
        finally:
            resident.close()
    finally:
        child.kill()
        child.wait()


def test_a_cgroup_limit_above_the_hosts_ram_is_not_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    ram = proc_table.host_memory_limit()
    _fake_files(monkeypatch, {"/proc/self/cgroup": "0::/\n",
                              "/sys/fs/cgroup/memory.max": f"{ram * 2}\n"})
    assert proc_table.host_memory_limit() == ram


def test_unreadable_or_odd_proc_lines_read_as_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_files(monkeypatch, {"/proc/meminfo": "MemTotal: 16000 kB\nMemAvailable:\n",
                              "/proc/42/smaps_rollup": "Rss: 300 kB\nPss:\n"})
    assert proc_table.available_memory() is None
    assert proc_table.pss(42) is None


def test_the_children_of_every_readable_thread_are_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    # task 1 is gone by the time it is read, task 2 reads oddly, task 3 has two children
    _fake_files(monkeypatch, {"/proc/99/task/2/children": "garbage\n",
                              "/proc/99/task/3/children": "5 6\n"})
    real = os.listdir
    monkeypatch.setattr(proc_table.os, "listdir",
                        lambda path: ["1", "2", "3"] if path == "/proc/99/task" else real(path))
    assert proc_table.children(99) == [5, 6]


def test_the_cgroup_files_of_our_own_v1_memory_and_v2_groups_are_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_files(monkeypatch, {"/proc/self/cgroup": "5:cpu,cpuacct:/jobs/c\n4:memory:/jobs/m\n"
                                                   "1:name=systemd:/\n0::/jobs/v2\n"})
    assert proc_table._cgroup_limit_files() == [
        "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/jobs/m/memory.limit_in_bytes", "/sys/fs/cgroup/jobs/v2/memory.max"]
    _fake_files(monkeypatch, {"/proc/self/cgroup": "0::/\n4:memory:/\n"})  # the root: no folder
    assert len(proc_table._cgroup_limit_files()) == 2


def test_without_a_cgroup_limit_the_limit_is_the_hosts_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024  # MemTotal
    _fake_files(monkeypatch, {"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/memory.max": "max\n",
                              "/sys/fs/cgroup/memory/memory.limit_in_bytes": "max\n"})
    assert abs(proc_table.host_memory_limit() - total) < 64 * MiB


def test_unreadable_proc_and_cgroup_files_are_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_files(monkeypatch, {"/proc/self/cgroup": None, "/sys/fs/cgroup/memory.max": None,
                              "/sys/fs/cgroup/memory/memory.limit_in_bytes": "8192\n",
                              "/proc/meminfo": None, "/proc/42/smaps_rollup": None})
    assert proc_table._cgroup_limit_files() == [
        "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    assert proc_table.host_memory_limit() == 8192  # the v2 file is gone: v1's is read
    assert proc_table.available_memory() is None and proc_table.pss(42) is None
    _fake_files(monkeypatch, {"/proc/meminfo": "MemAvailable: lots kB\n",
                              "/proc/42/smaps_rollup": "Pss: lots kB\n"})
    assert proc_table.available_memory() is None and proc_table.pss(42) is None
