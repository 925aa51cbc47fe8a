"""Host weight stores: digest and naming rules, private arrays, node-shared regions."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np
import posix_ipc
import pytest

from kserve_trio.core.memory.shm_names import SHM_DIR
from kserve_trio.core.tensors.dtypes import DType
from kserve_trio.runtime.weight_store import (
    HEADER_BYTES,
    MAGIC,
    PrivateWeightStore,
    SharedWeightStore,
    fnv1a64,
    lock_path,
    make_weight_store,
    region_layout,
    region_name,
    sanitize_model_name,
    weights_digest,
    weights_file_token,
)

SPECS = [(np.float32, (4, 3)), (np.float32, (3,)), (np.int8, (5,))]


def source() -> list[np.ndarray]:
    return [
        np.arange(12, dtype=np.float32).reshape(4, 3),
        np.array([0.5, -1.0, 2.0], dtype=np.float32),
        np.arange(5, dtype=np.int8),
    ]


class Filler:
    """A fill callback that counts its calls (a call = reading the weights file)."""

    def __init__(self, arrays=None) -> None:
        self.calls = 0
        self.arrays = arrays or source()

    def __call__(self, dst: list[np.ndarray]) -> None:
        self.calls += 1
        for d, s in zip(dst, self.arrays, strict=True):
            np.copyto(d, s)


@pytest.fixture
def model():
    """A unique model name; every region and lock file of it is removed afterwards."""
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    for p in SHM_DIR.glob(f"kst-w-{name}-*"):
        if p.name.endswith(".lock"):
            p.unlink(missing_ok=True)
        else:
            try:
                posix_ipc.unlink_shared_memory("/" + p.name)
            except posix_ipc.ExistentialError:
                pass


def files_of(name: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"kst-w-{name}-*"))


# -- digest and naming ----------------------------------------------------------------------


def test_fnv1a64_matches_the_reference_vectors():
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8


def test_file_token_is_size_and_mtime_and_zero_when_missing(tmp_path):
    assert weights_file_token("") == 0
    assert weights_file_token(None) == 0
    assert weights_file_token(tmp_path / "absent.safetensors") == 0
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x" * 10)
    os.utime(f, ns=(1_000_000_000, 1_700_000_000_123_456_789))
    assert weights_file_token(f) == fnv1a64(b"10:1700000000123456789")
    os.utime(f, ns=(1_000_000_000, 1_700_000_000_123_456_790))
    assert weights_file_token(f) == fnv1a64(b"10:1700000000123456790")


def test_digest_covers_name_layout_dtype_and_content():
    base = weights_digest("m", SPECS, content=7)
    assert base == weights_digest("m", list(SPECS), content=7)
    assert base != weights_digest("n", SPECS, content=7)
    assert base != weights_digest("m", SPECS, content=8)
    assert base != weights_digest("m", [(np.float32, (3, 4)), *SPECS[1:]], content=7)
    assert base != weights_digest("m", [(np.float64, (4, 3)), *SPECS[1:]], content=7)
    assert base != weights_digest("m", SPECS[:2], content=7)
    # same itemsize, different type: bfloat16 and float16 must not share a region
    assert weights_digest("m", [(ml_dtypes.bfloat16, (2,))]) != weights_digest(
        "m", [(np.float16, (2,))]
    )
    # DType members are accepted for the numpy dtype they stand for
    assert weights_digest("m", [(DType.F32, (2,))]) == weights_digest("m", [(np.float32, (2,))])


def test_digest_is_fnv_of_the_documented_string():
    expected = fnv1a64(b"kstw1|m|c0000000000000007|float32:4:4,3|int8:1:5")
    assert weights_digest("m", [(np.float32, (4, 3)), (np.int8, (5,))], content=7) == expected


def test_region_and_lock_names():
    assert sanitize_model_name("resnet-50.v2/x") == "resnet_50_v2_x"
    assert region_name("resnet-50", 0xAB) == "/kst-w-resnet_50-00000000000000ab"
    assert lock_path("/kst-w-a-00000000000000ab") == Path("/dev/shm/kst-w-a-00000000000000ab.lock")


def test_region_layout_aligns_every_tensor_to_64_bytes():
    offsets, total = region_layout(SPECS)
    assert offsets == (64, 128, 192)  # 48 bytes, then 12, then 5
    assert total == 197
    assert region_layout([]) == ((), HEADER_BYTES)
    offsets, total = region_layout([(np.float32, (16,)), (np.float32, (0,)), (np.uint8, (1,))])
    assert offsets == (64, 128, 128) and total == 129


def test_make_weight_store_follows_the_flag():
    assert isinstance(make_weight_store(False), PrivateWeightStore)
    store = make_weight_store(True, 0o640)
    assert isinstance(store, SharedWeightStore) and store.mode == 0o640


# -- private store ---------------------------------------------------------------------------


def test_private_store_fills_fresh_read_only_arrays_per_call():
    store = PrivateWeightStore()
    fill = Filler()
    a = store.materialize("m", 1, SPECS, fill)
    b = store.materialize("m2", 1, SPECS, fill)
    assert fill.calls == 2
    for got, want in zip(a, source(), strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype and not got.flags.writeable
    assert not np.shares_memory(a[0], b[0])
    assert store.holds("m")
    store.rename("m", "renamed")
    assert store.holds("renamed") and not store.holds("m")
    store.release("renamed")
    assert not store.holds("renamed")
    store.close()
    assert not store.holds("m2")


# -- shared store ------------------------------------------------------------------------------


def test_second_store_attaches_without_filling_and_last_release_unlinks(model):
    first, second = SharedWeightStore(), SharedWeightStore()
    digest = weights_digest(model, SPECS, content=1)
    region = region_name(model, digest)
    fill1, fill2 = Filler(), Filler()
    a = first.materialize(model, digest, SPECS, fill1)
    b = second.materialize(model, digest, SPECS, fill2)
    assert (fill1.calls, fill2.calls) == (1, 0)
    for x, y, want in zip(a, b, source(), strict=True):
        np.testing.assert_array_equal(x, want)
        np.testing.assert_array_equal(y, want)
        assert not y.flags.writeable
    assert files_of(model) == sorted([region.lstrip("/"), region.lstrip("/") + ".lock"])
    assert second.region_of(model) == region
    # the header says magic, ready, digest
    head = np.frombuffer((SHM_DIR / region.lstrip("/")).read_bytes()[:16], dtype="<u4")
    assert head[0] == MAGIC and head[1] == 1
    del a
    first.release(model)
    assert files_of(model), "another holder is still attached: the region must stay"
    np.testing.assert_array_equal(b[0], source()[0])
    del b
    second.release(model)
    assert files_of(model) == []
    second.release(model)  # idempotent


def test_concurrent_materialize_fills_exactly_once(model):
    digest = weights_digest(model, SPECS)
    stores = [SharedWeightStore() for _ in range(8)]
    fills = [Filler() for _ in stores]
    results: list = [None] * len(stores)
    barrier = threading.Barrier(len(stores))

    def attach(i: int) -> None:
        barrier.wait()
        results[i] = stores[i].materialize(model, digest, SPECS, fills[i])

    threads = [threading.Thread(target=attach, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(f.calls for f in fills) == 1
    for arrays in results:
        np.testing.assert_array_equal(arrays[2], source()[2])
    results.clear()
    for s in stores:
        s.release(model)
    assert files_of(model) == []


def test_another_process_attaches_and_sees_the_bytes(model):
    store = SharedWeightStore()
    digest = weights_digest(model, SPECS, content=3)
    store.materialize(model, digest, SPECS, Filler())
    code = f"""
import sys
import numpy as np
from kserve_trio.core.logging import configure_logging
from kserve_trio.runtime.weight_store import SharedWeightStore
configure_logging("json", "info", stream=sys.stdout)
specs = [(np.float32, (4, 3)), (np.float32, (3,)), (np.int8, (5,))]
calls = []
s = SharedWeightStore()
a = s.materialize({model!r}, {digest}, specs, lambda arrs: calls.append(1))
print("RESULT", len(calls), float(a[0].sum()), int(a[2][-1]))
del a
s.release({model!r})
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert line.split()[1:] == ["0", "66.0", "4"]
    assert "host_weights_attached" in out.stdout
    assert "host_weights_materialized" not in out.stdout
    assert files_of(model), "this process still holds the region"
    store.release(model)
    assert files_of(model) == []


def region_perms(region: str, pid: int | str = "self") -> set[str]:
    """The permission columns of ``pid``'s mappings of ``region`` (e.g. ``{"r--s"}``)."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[1] for line in f if line.rstrip().endswith("/dev/shm" + region)}


WRITER = """
import ctypes
import numpy as np
from kserve_trio.runtime.weight_store import SharedWeightStore
specs = [(np.float32, (4, 3)), (np.float32, (3,)), (np.int8, (5,))]
src = [np.arange(12, dtype=np.float32).reshape(4, 3), np.array([0.5, -1.0, 2.0], np.float32),
       np.arange(5, dtype=np.int8)]
def fill(arrays):
    for d, s in zip(arrays, src):
        np.copyto(d, s)
s = SharedWeightStore()
a = s.materialize({model!r}, {digest}, specs, fill)
with open("/proc/self/maps") as f:
    perms = sorted({{l.split()[1] for l in f if l.rstrip().endswith("/dev/shm" + {region!r})}})
print("MAPS", *perms, flush=True)
try:
    a[0].flags.writeable = True
except ValueError:
    print("FLAG refused", flush=True)
ctypes.memset(a[0].ctypes.data, 0x7F, 4)
print("WROTE", flush=True)
"""


@pytest.mark.parametrize("role", ["creator", "attacher"])
def test_a_write_through_a_workers_mapping_faults_and_the_region_is_unchanged(model, role):
    """Creator and attachers alike map the finished region read-only: numpy refuses to make a
    view writable, and a raw store into it kills the writer (SIGSEGV) instead of changing what
    every worker of the node serves."""
    digest = weights_digest(model, SPECS, content=5)
    region = region_name(model, digest)
    store = SharedWeightStore()
    if role == "attacher":
        views = store.materialize(model, digest, SPECS, Filler())
        assert region_perms(region) == {"r--s"}  # this process created it, and reads it
        del views
    code = WRITER.format(model=model, digest=digest, region=region)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stdout, out.stderr)
    assert out.stdout.split("\n")[:2] == ["MAPS r--s", "FLAG refused"]
    assert "WROTE" not in out.stdout
    offsets, _ = region_layout(SPECS)
    raw = (SHM_DIR / region.lstrip("/")).read_bytes()
    for (dtype, shape), off, want in zip(SPECS, offsets, source(), strict=True):
        got = np.frombuffer(raw, dtype, int(np.prod(shape)), off).reshape(shape)
        np.testing.assert_array_equal(got, want)
    store.release(model)


def test_a_weights_only_update_gets_a_new_region_and_sweeps_the_unheld_old_one(model):
    old, new = weights_digest(model, SPECS, content=1), weights_digest(model, SPECS, content=2)
    assert old != new
    holder, other = SharedWeightStore(), SharedWeightStore()
    holder.materialize(model, old, SPECS, Filler())
    updated = [a * 2 for a in source()]
    fill = Filler(updated)
    arrays = other.materialize(model, new, SPECS, fill)
    assert fill.calls == 1, "a new version is never served from the old region"
    np.testing.assert_array_equal(arrays[0], updated[0])
    old_name, new_name = region_name(model, old).lstrip("/"), region_name(model, new).lstrip("/")
    assert old_name in files_of(model), "the old version is still held: it must not be swept"
    holder.release(model)  # last holder of the old version unlinks it
    assert files_of(model) == sorted([new_name, new_name + ".lock"])
    del arrays
    other.release(model)
    assert files_of(model) == []


def test_a_stale_version_without_holders_is_swept(model):
    old, new = weights_digest(model, SPECS, content=1), weights_digest(model, SPECS, content=2)
    writer = SharedWeightStore()
    writer.materialize(model, old, SPECS, Filler())
    att = writer._attached.pop(model)  # a crashed worker: no release, its lock dies with it
    att.mm.close()
    os.close(att.fd)
    old_name = region_name(model, old).lstrip("/")
    assert old_name in files_of(model)
    fresh = SharedWeightStore()
    fresh.materialize(model, new, SPECS, Filler())
    assert old_name not in files_of(model)
    assert old_name + ".lock" not in files_of(model)
    fresh.release(model)
    assert files_of(model) == []


def test_an_unfinished_remnant_is_replaced_not_attached(model):
    digest = weights_digest(model, SPECS)
    region = region_name(model, digest)
    _, total = region_layout(SPECS)
    shm = posix_ipc.SharedMemory(region, posix_ipc.O_CREX, mode=0o600, size=total)
    os.write(shm.fd, np.array([MAGIC, 0], dtype="<u4").tobytes())  # ready = 0: crashed mid-fill
    shm.close_fd()
    store = SharedWeightStore()
    fill = Filler()
    arrays = store.materialize(model, digest, SPECS, fill)
    assert fill.calls == 1
    np.testing.assert_array_equal(arrays[1], source()[1])
    del arrays
    store.release(model)
    assert files_of(model) == []


def test_a_region_of_another_digest_under_the_name_is_never_attached(model):
    digest = weights_digest(model, SPECS)
    holder = SharedWeightStore()
    holder.materialize(model, digest, SPECS, Filler())
    region = region_name(model, digest)
    shm = posix_ipc.SharedMemory(region)
    os.pwrite(shm.fd, np.array([digest ^ 1], dtype="<u8").tobytes(), 8)  # foreign header
    shm.close_fd()
    fill = Filler()
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.setdefault(
            "a", SharedWeightStore().materialize(model, digest, SPECS, fill)
        )
    )
    t.start()
    t.join(0.3)
    # it cannot replace the region while another process holds it, and it never attaches it
    assert t.is_alive() and fill.calls == 0
    holder.release(model)  # once the holder leaves, the waiter replaces the foreign region
    t.join(10)
    assert not t.is_alive() and fill.calls == 1
    np.testing.assert_array_equal(box["a"][0], source()[0])


def test_permission_bits_follow_the_mode(model):
    old = os.umask(0o077)
    try:
        store = SharedWeightStore(0o640)
        digest = weights_digest(model, SPECS)
        store.materialize(model, digest, SPECS, Filler())
    finally:
        os.umask(old)
    region = region_name(model, digest).lstrip("/")
    assert stat.S_IMODE((SHM_DIR / region).stat().st_mode) == 0o640
    assert stat.S_IMODE((SHM_DIR / (region + ".lock")).stat().st_mode) == 0o640
    store.release(model)


def test_rename_moves_the_key_and_release_under_the_new_key_unlinks(model):
    store = SharedWeightStore()
    digest = weights_digest(model, SPECS)
    store.materialize(model, digest, SPECS, Filler())
    store.rename(model, "renamed-" + model)
    assert store.holds("renamed-" + model) and not store.holds(model)
    store.release(model)  # nothing under the old key
    assert files_of(model), "the region keeps its content-addressed name"
    store.release("renamed-" + model)
    assert files_of(model) == []


def test_rematerialize_same_digest_reuses_the_mapping_and_other_digest_moves(model):
    store = SharedWeightStore()
    d1, d2 = weights_digest(model, SPECS, content=1), weights_digest(model, SPECS, content=2)
    fill = Filler()
    store.materialize(model, d1, SPECS, fill)
    again = store.materialize(model, d1, SPECS, fill)
    assert fill.calls == 1
    np.testing.assert_array_equal(again[0], source()[0])
    del again
    store.materialize(model, d2, SPECS, fill)
    assert fill.calls == 2
    assert store.region_of(model) == region_name(model, d2)
    assert region_name(model, d1).lstrip("/") not in files_of(model)
    store.close()
    assert files_of(model) == []


def test_a_failing_fill_leaves_nothing_behind(model):
    store = SharedWeightStore()

    def broken(arrays):
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        store.materialize(model, weights_digest(model, SPECS), SPECS, broken)
    assert not store.holds(model)
    assert files_of(model) == []
