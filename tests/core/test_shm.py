"""ShmRegistry: registration rules and name/key validation, reads (private copies through the
descriptor), writes, a client that shrinks its object, unregister/close semantics (descriptor
closed, nothing ever mapped), churn safety and the IPC-namespace probe; the client policy (the
server's own objects never registered, under their name or another, the allow-list, off)."""

from __future__ import annotations

import inspect
import mmap
import os
import resource
import secrets
import threading
import time
from collections.abc import Iterator

import numpy as np
import posix_ipc
import pytest

from kserve_trio.core.errors import (
    InvalidArgument,
    ResourceExhausted,
    StatusCode,
    Unavailable,
    UnregisteredRegionError,
)
from kserve_trio.core.memory.shm import (
    RegionStatus,
    ShmRegistry,
    ShrunkRegionError,
    posix_name,
    same_ipc_namespace,
)
from kserve_trio.core.memory.shm_names import RESERVED_RULE, ClientShmPolicy, reserved_name
from kserve_trio.core.protocol.codec import ShmRegistryLike

PAGE = mmap.ALLOCATIONGRANULARITY


class ShmObject:
    """A POSIX object created by the test (as a client would), with its own mapping."""

    def __init__(self, size: int, key: str | None = None) -> None:
        self.key = key or f"/kt-test-{os.getpid()}-{secrets.token_hex(6)}"
        shm = posix_ipc.SharedMemory(self.key, flags=posix_ipc.O_CREX, mode=0o600, size=size)
        self.mm = mmap.mmap(shm.fd, size)
        shm.close_fd()
        self.size = size
        self.mm[:] = bytes(i % 251 for i in range(size))

    @property
    def bare(self) -> str:
        return self.key.lstrip("/")

    def mapped_by_us(self) -> int:
        """How many of this process's mappings point at the object (test mapping excluded)."""
        with open("/proc/self/maps") as f:
            n = sum(1 for line in f if f"/dev/shm/{self.bare}" in line)
        return n - (0 if self.mm.closed else 1)

    def open_fds(self) -> int:
        """How many of this process's descriptors are open on the object (the registry's; the
        test mapping's own duplicate, which Python's mmap keeps, excluded)."""
        n = 0 if self.mm.closed else -1
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            n += target.split(" (deleted)")[0] == f"/dev/shm/{self.bare}"
        return n

    def attached(self) -> int:
        """Descriptors the registry holds on the object; it must never map it."""
        assert self.mapped_by_us() == 0
        return self.open_fds()

    def truncate(self, size: int) -> None:
        """Resize the object as a client would (our own mapping is then only touched again
        once the object covers it)."""
        fd = os.open(f"/dev/shm/{self.bare}", os.O_RDWR)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def size_now(self) -> int:
        return os.stat(f"/dev/shm/{self.bare}").st_size

    def destroy(self) -> None:
        self.mm.close()
        try:
            posix_ipc.unlink_shared_memory(self.key)
        except posix_ipc.ExistentialError:
            pass


@pytest.fixture
def make_obj() -> Iterator:
    made: list[ShmObject] = []

    def make(size: int = 3 * PAGE, key: str | None = None) -> ShmObject:
        obj = ShmObject(size, key)
        made.append(obj)
        return obj

    yield make
    for obj in made:
        obj.destroy()


@pytest.fixture
def registry() -> Iterator[ShmRegistry]:
    reg = ShmRegistry()
    yield reg
    reg.close()


def expected(obj: ShmObject, start: int, n: int) -> bytes:
    return bytes(i % 251 for i in range(start, start + n))


# -- registration ------------------------------------------------------------------------------


def test_satisfies_codec_protocol():
    for method in ("read_view", "write"):
        ours = inspect.signature(getattr(ShmRegistry, method))
        theirs = inspect.signature(getattr(ShmRegistryLike, method))
        assert list(ours.parameters) == list(theirs.parameters), method


def test_register_read_status_unaligned_offset(registry, make_obj):
    obj = make_obj()
    registry.register("r", obj.key, PAGE + 5, 100)
    assert registry.read("r", 0, 100) == expected(obj, PAGE + 5, 100)
    assert registry.read("r", 10, 3) == expected(obj, PAGE + 15, 3)
    assert registry.status() == {"r": RegionStatus("r", obj.key, PAGE + 5, 100)}
    assert registry.status("r") == {"r": RegionStatus("r", obj.key, PAGE + 5, 100)}
    assert registry.status("nope") == {}


def test_key_without_leading_slash(registry, make_obj):
    obj = make_obj()
    registry.register("r", obj.bare, 0, 16)
    assert registry.read("r", 0, 16) == expected(obj, 0, 16)
    assert registry.status("r")["r"].key == obj.bare
    assert posix_name("abc") == "/abc" and posix_name("/abc") == "/abc"


def test_whole_object_region(registry, make_obj):
    obj = make_obj(1000)
    registry.register("r", obj.key, 0, 1000)
    assert registry.read("r", 0, 1000) == expected(obj, 0, 1000)
    registry.register("tail", obj.key, 999, 1)
    assert registry.read("tail", 0, 1) == expected(obj, 999, 1)


@pytest.mark.parametrize(
    ("name", "key", "offset", "size", "message"),
    [
        (
            "",
            "/k",
            0,
            8,
            "SystemSharedMemoryRegister: shared memory region name '' must not be empty",
        ),
        ("n", "", 0, 8, "SystemSharedMemoryRegister: shared memory key '' must not be empty"),
        ("n", "/k", -1, 8, "region 'n' offset -1 is out of range [0, 2^63-1]"),
        ("n", "/k", 2**63, 8, f"region 'n' offset {2**63} is out of range [0, 2^63-1]"),
        ("n", "/k", 0, 0, "region 'n' byte_size 0 is out of range [1, 2^63-1]"),
        ("n", "/k", 0, -4, "region 'n' byte_size -4 is out of range [1, 2^63-1]"),
    ],
)
def test_register_argument_errors(registry, name, key, offset, size, message):
    with pytest.raises(InvalidArgument) as err:
        registry.register(name, key, offset, size)
    assert err.value.message == message
    assert err.value.status == StatusCode.INVALID_ARGUMENT
    assert registry.status() == {}


@pytest.mark.parametrize(("offset", "size"), [(None, 8), (0, None), ([1], 8), (0, True)])
def test_register_non_integer_window(registry, make_obj, offset, size):
    """What a malformed body may decode to: refused, nothing opened."""
    obj = make_obj()
    with pytest.raises(InvalidArgument, match="is not an integer \\(malformed request\\)"):
        registry.register("n", obj.key, offset, size)
    assert obj.attached() == 0


def test_region_count_is_capped(make_obj):
    """Each region holds a descriptor: past ``max_regions`` a new name is RESOURCE_EXHAUSTED
    (nothing opened), while replacing a registered name still works."""
    reg = ShmRegistry(max_regions=2)
    obj = make_obj()
    reg.register("a", obj.key, 0, 8)
    reg.register("b", obj.key, 8, 8)
    with pytest.raises(ResourceExhausted) as err:
        reg.register("c", obj.key, 16, 8)
    assert err.value.status == StatusCode.RESOURCE_EXHAUSTED
    assert "the most shared memory regions it allows (2, " in err.value.message
    assert obj.attached() == 2
    reg.register("b", obj.key, 24, 8)  # a replacement needs no room
    reg.unregister("a")
    reg.register("c", obj.key, 16, 8)
    assert sorted(reg.status()) == ["b", "c"]
    reg.close()
    assert obj.attached() == 0
    assert ShmRegistry().max_regions == max(16, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)


def test_register_missing_object(registry):
    key = f"/kt-missing-{secrets.token_hex(6)}"
    with pytest.raises(InvalidArgument) as err:
        registry.register("n", key, 0, 8)
    assert err.value.message == f"shared memory object '{key}' does not exist"


@pytest.mark.parametrize(
    ("offset", "size"), [(0, 1001), (1, 1000), (1000, 1), (999, 2), (2**62, 2**62)]
)
def test_register_window_outside_object(registry, make_obj, offset, size):
    obj = make_obj(1000)
    with pytest.raises(InvalidArgument) as err:
        registry.register("n", obj.key, offset, size)
    assert err.value.message == (
        f"region 'n' offset+byte_size exceeds shared memory object '{obj.key}' size (1000)"
    )
    assert registry.status() == {}
    assert obj.attached() == 0


HOSTILE_KEYS = [
    "/ab\x00cd",
    "\x00",
    "/k\n",
    "/k\x7f",
    "/\x1b[2J",
    "/",
    "//k",
    "/a/b",
    "/..",
    ".",
    "/" + "k" * 256,
]
HOSTILE_NAMES = ["r\x00", "\x00", "r\n", "\x9b", "n" * 256]


@pytest.mark.parametrize("key", HOSTILE_KEYS)
def test_hostile_key_is_refused_before_any_os_call(registry, make_obj, key):
    """posix_ipc crashes the process on a NUL byte: the key never reaches it."""
    obj = make_obj()
    with pytest.raises(InvalidArgument) as err:
        registry.register("r", key, 0, 8)
    assert err.value.message.startswith("SystemSharedMemoryRegister: shared memory key ")
    assert err.value.message.isprintable()
    assert registry.status() == {}
    assert same_ipc_namespace(key) is False
    assert obj.attached() == 0


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_region_name_is_refused_everywhere(registry, make_obj, name):
    obj = make_obj()
    with pytest.raises(InvalidArgument) as err:
        registry.register(name, obj.key, 0, 8)
    assert err.value.message.startswith("SystemSharedMemoryRegister: shared memory region name ")
    for call, rpc in (
        (registry.unregister, "SystemSharedMemoryUnregister"),
        (registry.status, "SystemSharedMemoryStatus"),
    ):
        with pytest.raises(InvalidArgument) as err:
            call(name)
        assert err.value.message.startswith(f"{rpc}: shared memory region name ")
        assert err.value.message.isprintable()
    # an inference naming it: INVALID_ARGUMENT, the name quoted escaped
    for call in (
        lambda: registry.read_view(name, 0, 1),
        lambda: registry.write(name, 0, b"x"),
    ):
        with pytest.raises(InvalidArgument) as err:
            call()
        assert err.value.message.startswith("shared memory region name ")
        assert err.value.message.isprintable()
    assert obj.attached() == 0


# -- the client policy -------------------------------------------------------------------------


def reserved_key() -> str:
    """A key under the reserved prefix, as the node's weight store names its regions."""
    return "/" + reserved_name(f"test-{os.getpid()}-{secrets.token_hex(6)}")


def test_an_object_of_the_servers_own_is_never_registered(registry, make_obj):
    own = make_obj(key=reserved_key())
    for key in (own.key, own.bare):
        with pytest.raises(InvalidArgument) as err:
            registry.register("evil", key, 64, 64)
        assert err.value.message == (
            f"SystemSharedMemoryRegister: shared memory key '{key}' is reserved: {RESERVED_RULE}"
        )
        assert registry.same_ipc_namespace(key) is False  # the client goes inline instead
    assert same_ipc_namespace(own.key) is True  # it exists, and is visible: refused by name
    assert registry.status() == {} and own.attached() == 0  # never even opened


def test_another_name_of_a_reserved_object_is_refused_too(registry, make_obj):
    """A hard link gives a reserved object a client-looking name: the descriptor opened under
    it is compared with every reserved object, and closed again."""
    own = make_obj(key=reserved_key())
    alias = f"/kt-alias-{os.getpid()}-{secrets.token_hex(6)}"
    os.link(f"/dev/shm/{own.bare}", f"/dev/shm{alias}")
    try:
        with pytest.raises(InvalidArgument) as err:
            registry.register("evil", alias, 0, 64)
        assert err.value.message == (
            f"SystemSharedMemoryRegister: shared memory key '{alias}' is another name (a hard "
            f"link) of a reserved object: {RESERVED_RULE}"
        )
        assert registry.status() == {} and own.attached() == 0
        assert own.mm[:64] == expected(own, 0, 64)
    finally:
        os.unlink(f"/dev/shm{alias}")
    client = make_obj()
    registry.register("ok", client.key, 0, 64)  # a client's own object still registers
    assert list(registry.status()) == ["ok"]


def test_the_allow_list_refuses_other_keys_and_the_probe_says_no(make_obj):
    ok, other = make_obj(key=f"/kt-ok-{secrets.token_hex(6)}"), make_obj()
    reg = ShmRegistry(policy=ClientShmPolicy(prefixes=("kt-ok-",)))
    try:
        with pytest.raises(InvalidArgument) as err:
            reg.register("r", other.key, 0, 8)
        assert err.value.message == (
            f"SystemSharedMemoryRegister: shared memory key '{other.key}' starts with none of "
            "the allowed prefixes 'kt-ok-' (endpoints.client_shared_memory_prefixes)"
        )
        assert reg.same_ipc_namespace(other.key) is False and other.attached() == 0
        assert reg.same_ipc_namespace(ok.key) is True
        reg.register("r", ok.key, 0, 8)
        assert reg.read("r", 0, 8) == expected(ok, 0, 8)
    finally:
        reg.close()


def test_client_shared_memory_off_answers_unavailable_and_the_probe_says_no(make_obj):
    obj = make_obj()
    reg = ShmRegistry(policy=ClientShmPolicy(enabled=False))
    try:
        for rpc, call in (
            ("SystemSharedMemoryRegister", lambda: reg.register("r", obj.key, 0, 8)),
            ("SystemSharedMemoryUnregister", lambda: reg.unregister("r")),
            ("SystemSharedMemoryStatus", lambda: reg.status()),
        ):
            with pytest.raises(Unavailable) as err:
                call()
            assert err.value.message == (
                f"{rpc}: client shared memory is off on this server "
                "(endpoints.client_shared_memory: false); send tensors inline"
            )
        assert reg.same_ipc_namespace(obj.key) is False
        assert same_ipc_namespace(obj.key) is True
        assert obj.attached() == 0
        with pytest.raises(UnregisteredRegionError):  # an inference naming a region
            reg.read_view("r", 0, 8)
    finally:
        reg.close()


def test_reregister_replaces_and_detaches_old(registry, make_obj):
    a, b = make_obj(), make_obj()
    b.mm[:4] = b"BBBB"
    registry.register("r", a.key, 0, 64)
    assert a.attached() == 1
    registry.register("r", b.key, 0, 64)
    assert registry.read("r", 0, 4) == b"BBBB"
    assert registry.status()["r"].key == b.key
    assert a.attached() == 0
    assert b.attached() == 1


# -- data path ---------------------------------------------------------------------------------


def test_read_view_is_an_aligned_private_copy(registry, make_obj):
    """Inputs are copied through the descriptor: later client writes do not show through, the
    copy is read-only, and it holds no lease: unregistering closes the descriptor while the
    copy stays readable."""
    obj = make_obj()
    registry.register("r", obj.key, 100, 64)
    view, release = registry.read_view("r", 8, 16)
    assert view.nbytes == 16 and view.readonly is True
    assert bytes(view) == expected(obj, 108, 16)
    obj.mm[108:112] = b"\x01\x02\x03\x04"
    assert bytes(view) == expected(obj, 108, 16)  # the client's later write is not seen
    arr = np.frombuffer(view, dtype=np.uint8)
    registry.unregister("r")
    assert obj.attached() == 0
    assert bytes(arr[4:8]) == expected(obj, 112, 4)
    release()
    release()  # idempotent


def test_read_view_of_a_large_window(registry, make_obj):
    """From 64 KiB up the copy is 64-byte aligned, so jax on the CPU uses it in place."""
    obj = make_obj(64 * PAGE + 3)
    registry.register("r", obj.key, 3, 64 * PAGE)
    view, _ = registry.read_view("r", 0, 64 * PAGE)
    assert bytes(view) == expected(obj, 3, 64 * PAGE)
    assert np.frombuffer(view, np.uint8).ctypes.data % 64 == 0
    assert registry.read("r", 64 * PAGE - 1, 1) == expected(obj, 64 * PAGE + 2, 1)


def test_write_lands_in_object(registry, make_obj):
    obj = make_obj()
    registry.register("r", obj.key, PAGE - 8, 64)
    data = np.arange(4, dtype=np.float32)
    registry.write("r", 4, data)
    assert bytes(obj.mm[PAGE - 4 : PAGE + 12]) == data.tobytes()
    registry.write("r", 0, b"abcd")
    assert bytes(obj.mm[PAGE - 8 : PAGE - 4]) == b"abcd"
    registry.write("r", 60, memoryview(b"wxyz"))
    assert bytes(obj.mm[PAGE + 52 : PAGE + 56]) == b"wxyz"


def test_write_non_contiguous_and_multidim(registry, make_obj):
    obj = make_obj()
    registry.register("r", obj.key, 0, 64)
    m = np.arange(12, dtype=np.int32).reshape(3, 4)
    registry.write("r", 0, m[:, ::2])  # non-contiguous: written in C order
    assert np.frombuffer(obj.mm, np.int32, 6).tolist() == [0, 2, 4, 6, 8, 10]
    registry.write("r", 32, memoryview(np.ones((2, 2), np.float32)))
    assert np.frombuffer(obj.mm, np.float32, 4, offset=32).tolist() == [1.0] * 4
    registry.write("r", 48, np.array([True, False, True]))
    assert bytes(obj.mm[48:51]) == b"\x01\x00\x01"


def test_write_full_region_and_empty(registry, make_obj):
    obj = make_obj()
    registry.register("r", obj.key, 0, 8)
    registry.write("r", 0, b"12345678")
    registry.write("r", 8, b"")
    assert bytes(obj.mm[:8]) == b"12345678"


@pytest.mark.parametrize(("offset", "size"), [(0, 65), (64, 1), (60, 5), (-1, 1), (2**62, 2**62)])
def test_read_out_of_bounds(registry, make_obj, offset, size):
    obj = make_obj()
    registry.register("r", obj.key, 0, 64)
    if offset < 0:
        message = (
            f"shared memory region 'r': offset {offset} and byte_size {size} must be non-negative"
        )
    else:
        message = (
            f"shared memory region 'r': offset {offset} + byte_size {size} "
            "exceeds the region size (64)"
        )
    for call in (registry.read, registry.read_view):
        with pytest.raises(InvalidArgument) as err:
            call("r", offset, size)
        assert err.value.message == message


@pytest.mark.parametrize(("offset", "n"), [(0, 65), (61, 4), (-1, 2)])
def test_write_too_many_bytes(registry, make_obj, offset, n):
    obj = make_obj()
    registry.register("r", obj.key, 0, 64)
    with pytest.raises(InvalidArgument) as err:
        registry.write("r", offset, b"x" * n)
    assert err.value.message == (
        f"shared memory region 'r': writing {n} bytes at offset {offset} "
        "exceeds the region size (64)"
    )
    assert bytes(obj.mm[:64]) == expected(obj, 0, 64)


@pytest.mark.parametrize("op", ["read", "read_view", "write"])
def test_unknown_region_is_failed_precondition(registry, op):
    call = {
        "read": lambda: registry.read("ghost", 0, 1),
        "read_view": lambda: registry.read_view("ghost", 0, 1),
        "write": lambda: registry.write("ghost", 0, b"x"),
    }[op]
    with pytest.raises(UnregisteredRegionError) as err:
        call()
    assert err.value.message == "unregistered shared memory region: ghost"
    assert err.value.status == StatusCode.FAILED_PRECONDITION


# -- a client that shrinks its object ----------------------------------------------------------


def test_shrunk_object_fails_the_access_not_the_process(registry, make_obj):
    """A read or write past the object's current end is FAILED_PRECONDITION naming the sizes;
    the write does not grow the client's object back; a regrown object serves again."""
    obj = make_obj(2 * PAGE)
    registry.register("r", obj.key, PAGE, PAGE)
    obj.truncate(PAGE + 100)  # the window now ends 100 bytes into it
    assert registry.read("r", 0, 100) == expected(obj, PAGE, 100)  # still covered
    for call, verb in (
        (lambda: registry.read_view("r", 0, 200), "read"),
        (lambda: registry.read("r", 50, 51), "read"),
        (lambda: registry.write("r", 96, b"12345678"), "write"),
    ):
        with pytest.raises(ShrunkRegionError) as err:
            call()
        assert err.value.status == StatusCode.FAILED_PRECONDITION
        assert f"object '{obj.key}' is {PAGE + 100} bytes, smaller than offset + byte_size" in (
            err.value.message
        )
        assert f"needed to {verb}" in err.value.message
    assert obj.size_now() == PAGE + 100
    obj.truncate(0)
    with pytest.raises(
        ShrunkRegionError, match=f"is 0 bytes, smaller than offset \\+ byte_size = {PAGE} \\+ 8"
    ):
        registry.read_view("r", 0, 8)
    obj.truncate(2 * PAGE)  # regrown: zero-filled, served again
    assert registry.read("r", 0, 8) == b"\x00" * 8
    registry.write("r", 0, b"back")
    assert registry.read("r", 0, 4) == b"back"
    registry.unregister("r")
    assert obj.attached() == 0


def test_shrink_racing_reads_and_writes_never_signals(make_obj):
    """A thread resizing the object between empty and full while other threads copy through the
    region: every access either succeeds or raises ShrunkRegionError (a SIGBUS would kill this
    test process)."""
    reg = ShmRegistry()
    obj = make_obj(16 * PAGE)
    reg.register("r", obj.key, 0, 16 * PAGE)
    stop = threading.Event()
    failures: list[BaseException] = []
    counts = {"ok": 0, "shrunk": 0}

    def copier() -> None:
        payload = np.ones(16 * PAGE, np.uint8)
        while not stop.is_set():
            try:
                view, release = reg.read_view("r", 0, 16 * PAGE)
                assert view.nbytes == 16 * PAGE
                release()
                reg.write("r", 0, payload)
                counts["ok"] += 1
            except ShrunkRegionError:
                counts["shrunk"] += 1
            except BaseException as exc:
                failures.append(exc)
                return

    threads = [threading.Thread(target=copier) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        give_up = time.monotonic() + 10
        i = 0
        while i < 300 or (not (counts["ok"] and counts["shrunk"]) and time.monotonic() < give_up):
            obj.truncate((i % 3) * 8 * PAGE)  # 0, half, full
            time.sleep(0.0002)
            i += 1
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        obj.truncate(16 * PAGE)  # our own mapping covers the object again before teardown
    reg.close()
    assert failures == []
    assert counts["ok"] > 0 and counts["shrunk"] > 0, counts
    assert obj.attached() == 0


# -- unregister, close -------------------------------------------------------------------------


def test_unregister_is_idempotent_and_detaches(registry, make_obj):
    obj = make_obj()
    registry.unregister("never-registered")
    registry.register("r", obj.key, 0, 64)
    assert obj.attached() == 1
    registry.unregister("r")
    registry.unregister("r")
    assert registry.status() == {}
    assert obj.attached() == 0
    with pytest.raises(UnregisteredRegionError):
        registry.read("r", 0, 1)
    # detach only: the client's object still exists and can be registered again
    registry.register("r", obj.key, 0, 64)
    assert registry.read("r", 0, 2) == expected(obj, 0, 2)


def test_unregister_all(registry, make_obj):
    a, b = make_obj(), make_obj()
    registry.register("a", a.key, 0, 8)
    registry.register("b", b.key, 0, 8)
    registry.register("b2", b.key, 8, 8)
    assert a.attached() == 1 and b.attached() == 2
    registry.unregister("")
    assert registry.status() == {}
    assert a.attached() == 0 and b.attached() == 0
    registry.unregister("")


def test_unlinked_object_stays_readable_until_unregistered(registry, make_obj):
    """The kept descriptor holds the object: a client that unlinks it early does not break a
    registered region, and unregister then releases it (no '(deleted)' file stays open)."""
    obj = make_obj()
    registry.register("r", obj.key, 0, 64)
    posix_ipc.unlink_shared_memory(obj.key)
    assert registry.read("r", 0, 8) == expected(obj, 0, 8)
    assert obj.attached() == 1
    registry.unregister("r")
    assert obj.attached() == 0


def test_close_detaches_everything(make_obj):
    reg = ShmRegistry()
    a, b = make_obj(), make_obj()
    reg.register("a", a.key, 0, 64)
    reg.register("b", b.key, PAGE, PAGE)
    _view, release = reg.read_view("b", 0, 4)
    assert a.attached() == 1 and b.attached() == 1
    reg.close()
    assert a.attached() == 0 and b.attached() == 0
    assert reg.status() == {}
    release()  # a release after close is harmless
    with pytest.raises(Unavailable) as err:
        reg.register("a", a.key, 0, 64)
    assert err.value.message == "shared memory registry is closed (server is shutting down)"
    assert a.attached() == 0
    # the client's objects were never unlinked
    posix_ipc.SharedMemory(a.key).close_fd()
    posix_ipc.SharedMemory(b.key).close_fd()


def test_churn_never_crashes(make_obj):
    """Readers and writers racing register/unregister see only success or
    UnregisteredRegionError, every successful read returns one of the objects' bytes, and no
    descriptor outlives the churn."""
    reg = ShmRegistry()
    a, b = make_obj(PAGE), make_obj(PAGE)
    a.mm[:] = b"\x0a" * PAGE
    b.mm[:] = b"\x0b" * PAGE
    reg.register("r", a.key, 0, PAGE)
    stop = threading.Event()
    failures: list[BaseException] = []
    counts = {"ok": 0, "unregistered": 0}

    def reader() -> None:
        while not stop.is_set():
            try:
                view, release = reg.read_view("r", 0, 256)
                release()
                data = bytes(view)
                assert data in (b"\x0a" * 256, b"\x0b" * 256), data[:8]
                counts["ok"] += 1
            except UnregisteredRegionError:
                counts["unregistered"] += 1
            except BaseException as exc:
                failures.append(exc)
                return

    def writer() -> None:
        while not stop.is_set():
            try:
                reg.write("r", PAGE - 8, b"\x0c" * 8)
                reg.read("r", 0, 16)
            except UnregisteredRegionError:
                pass
            except BaseException as exc:
                failures.append(exc)
                return

    threads = [threading.Thread(target=reader) for _ in range(2)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    try:
        # at least 150 churn steps, and until readers saw both outcomes (bounded)
        give_up = time.monotonic() + 10
        i = 0
        while i < 150 or (
            not (counts["ok"] and counts["unregistered"]) and time.monotonic() < give_up
        ):
            if i % 3 == 0:
                reg.unregister("r")
            else:
                reg.register("r", (a if i % 2 else b).key, 0, PAGE)
            if i % 10 == 0:
                time.sleep(0.0005)  # hand the GIL to the readers
            i += 1
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    reg.close()
    assert failures == []
    assert counts["ok"] > 0 and counts["unregistered"] > 0, counts
    assert a.attached() == 0 and b.attached() == 0


# -- IPC namespace probe and tritonclient interop ----------------------------------------------


def test_same_ipc_namespace(registry, make_obj):
    obj = make_obj()
    assert same_ipc_namespace(obj.key) is True
    assert same_ipc_namespace(obj.bare) is True
    assert registry.same_ipc_namespace(obj.key) is True
    assert same_ipc_namespace("") is False
    assert same_ipc_namespace(f"/kt-missing-{secrets.token_hex(6)}") is False
    assert same_ipc_namespace("/bad/name") is False
    assert same_ipc_namespace(obj.key + "\x00") is False  # never reaches posix_ipc
    assert registry.status() == {}
    assert obj.attached() == 0


def test_tritonclient_region_is_readable(registry):
    import tritonclient.utils.shared_memory as shm_util

    key = f"/kt-triton-{os.getpid()}-{secrets.token_hex(6)}"
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    handle = shm_util.create_shared_memory_region("tri", key, data.nbytes + 16)
    try:
        shm_util.set_shared_memory_region(handle, [data], offset=16)
        assert same_ipc_namespace(key)
        registry.register("tri", key, 16, data.nbytes)
        view, release = registry.read_view("tri", 0, data.nbytes)
        got = np.frombuffer(view, np.float32).reshape(2, 3, 4)
        np.testing.assert_array_equal(got, data)
        del got, view
        release()
        out = np.full(4, 7, np.int32)
        registry.write("tri", 0, out)
        back = shm_util.get_contents_as_numpy(handle, np.int32, [4], offset=16)
        np.testing.assert_array_equal(back, out)
        del back
        registry.unregister("tri")
    finally:
        registry.close()
        shm_util.destroy_shared_memory_region(handle)
    assert not same_ipc_namespace(key)
