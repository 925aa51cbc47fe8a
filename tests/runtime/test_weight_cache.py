"""The weight cache: budget arithmetic, LRU bookkeeping, and residency over fake and real models."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from structlog.testing import capture_logs

from kserve_trio.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kserve_trio.core.memory.shm_names import SHM_DIR
from kserve_trio.core.process.config import ResidencyMode, ResidencyState
from kserve_trio.runtime.weight_cache import (
    NEEDS_CACHE,
    SELF_MANAGED,
    CacheBook,
    EvictionPlan,
    NotResidentError,
    WeightBudget,
    WeightCache,
    least_resident,
    plan_eviction,
    resolve_floor,
    weight_budget,
    weight_cache_stats,
)
from kserve_trio.runtime.weight_store import SharedWeightStore
from kserve_trio.runtime.weights import read_weights_index, write_weights

UNPINNED, SYSTEM, DEVICE = (
    ResidencyState.UNPINNED,
    ResidencyState.PINNED_SYSTEM,
    ResidencyState.PINNED_DEVICE,
)
EXTERNAL = ResidencyMode.EXTERNALLY_MANAGED


# -- pure: budget ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "scratch", "pinned", "pool", "budget", "over"),
    [
        (1.0, 0, 0, 900, 900, False),
        (0.5, 0, 0, 500, 500, False),
        (1.0, 300, 0, 600, 600, False),
        (1.0, 300, 200, 600, 400, False),
        (1.0, 0, 700, 900, 200, False),
        (1.0, 300, 700, 600, 0, True),
        (1.0, 950, 0, 0, 0, False),
    ],
)
def test_weight_budget_vectors(fraction, scratch, pinned, pool, budget, over):
    got = weight_budget(
        arena=1000, fraction=fraction, wiggle=0.1, max_scratch=scratch, pinned_bytes=pinned
    )
    assert got == WeightBudget(budget, pool, 900, over)


def test_weight_budget_of_an_empty_arena_is_zero():
    got = weight_budget(arena=0, fraction=1.0, wiggle=0.1, max_scratch=0, pinned_bytes=0)
    assert (got.on_demand_budget, got.weight_pool, got.scratch_ceiling) == (0, 0, 0)


# -- pure: LRU ------------------------------------------------------------------------------------


def test_plan_eviction_takes_the_least_recent_until_it_fits():
    lru = [("a", 40), ("b", 30), ("c", 20)]
    assert plan_eviction(lru, 90, 10, 100) == EvictionPlan((), True)
    assert plan_eviction(lru, 90, 11, 100) == EvictionPlan(("a",), True)
    assert plan_eviction(lru, 90, 50, 100) == EvictionPlan(("a",), True)
    assert plan_eviction(lru, 90, 51, 100) == EvictionPlan(("a", "b"), True)
    assert plan_eviction(lru, 90, 101, 100) == EvictionPlan(("a", "b", "c"), False)
    assert plan_eviction([], 0, 5, 0) == EvictionPlan((), False)


def test_cache_book_tracks_order_bytes_and_renames_in_place():
    book = CacheBook(max_bytes=100)
    book.add("a", 10)
    book.add("b", 20)
    book.add("c", 30)
    assert book.resident_bytes == 60 and list(book.lru) == ["a", "b", "c"]
    assert book.touch("a") and list(book.lru) == ["b", "c", "a"]
    assert not book.touch("zz")
    book.rename("c", "c2")
    assert list(book.lru) == ["b", "c2", "a"]
    assert book.plan(60) == EvictionPlan(("b",), True)
    assert book.remove("b") and not book.remove("b")
    assert book.resident_bytes == 40
    book.add("a", 10)  # re-adding moves, never double counts
    assert book.resident_bytes == 40 and list(book.lru) == ["c2", "a"]
    assert book.clear() == ["c2", "a"] and book.resident_bytes == 0


def test_floor_resolution_and_least_resident():
    assert resolve_floor(None, True) is SYSTEM
    assert resolve_floor(None, False) is UNPINNED
    assert resolve_floor(DEVICE, False) is DEVICE
    assert least_resident([DEVICE, SYSTEM]) is SYSTEM
    assert least_resident([DEVICE, DEVICE]) is DEVICE
    assert least_resident([]) is UNPINNED


# -- fakes ----------------------------------------------------------------------------------------


class CountingIndex:
    """A WeightsIndex whose file reads (``host_arrays``) are counted."""

    def __init__(self, index) -> None:
        self._index = index
        self.reads = 0

    def __getattr__(self, name):
        return getattr(self._index, name)

    def host_arrays(self):
        self.reads += 1
        return self._index.host_arrays()


class FakeBackend:
    """Device memory = the fake models' device copies (+ ``extra`` live bytes)."""

    def __init__(self, limit: int = 1000, peak: bool = False) -> None:
        self.models: list[FakeModel] = []
        self.limit = limit
        self.peak = 0 if peak else None
        self.extra = 0

    def memory_in_use(self) -> int:
        return sum(m.device_bytes for m in self.models) + self.extra

    def memory_stats(self) -> dict[str, int]:
        stats = {"bytes_in_use": self.memory_in_use(), "bytes_limit": self.limit}
        if self.peak is not None:
            stats["peak_bytes_in_use"] = self.peak
        return stats

    def transfer_to_device(self, hosts):
        return [np.array(h) for h in hosts]


class FakeModel:
    """The residency surface of ``CompiledModel`` over a real weights file."""

    def __init__(self, backend: FakeBackend, tmp_path, name: str, n: int) -> None:
        path = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}.safetensors"
        write_weights(path, [("w", np.arange(n, dtype=np.uint8))])
        self.name = name
        self.weights = CountingIndex(read_weights_index(path, bundle=name))
        self.weight_nbytes = n
        self.device: list[np.ndarray] | None = None
        self.loaded_from: list[object] = []
        self.frees = 0
        backend.models.append(self)

    @property
    def device_bytes(self) -> int:
        return sum(a.nbytes for a in self.device) if self.device is not None else 0

    def weights_resident(self) -> bool:
        return self.device is not None

    def load_weights(self, hosts=None) -> None:
        if self.device is not None:
            return
        assert hosts is not None
        self.loaded_from.append(hosts)
        self.device = [np.array(h) for h in hosts]

    def free_weights(self) -> None:
        if self.device is not None:
            self.frees += 1
        self.device = None


def make(tmp_path, sizes: dict[str, int], *, limit=1000, budget=None, peak=False, **kw):
    backend = FakeBackend(limit, peak=peak)
    cache = WeightCache(backend, arena=limit, wiggle=0.0, **kw)
    models = {n: FakeModel(backend, tmp_path, n, s) for n, s in sizes.items()}
    if budget is not None:
        cache._book.max_bytes = budget
    return backend, cache, models


# -- the hot path ---------------------------------------------------------------------------------


def test_first_acquire_loads_then_reuses(tmp_path):
    _, cache, m = make(tmp_path, {"a": 100})
    assert cache.admit(m["a"], UNPINNED) is UNPINNED
    assert not m["a"].weights_resident()
    cache.acquire(m["a"])
    cache.acquire(m["a"])
    st = cache.stats()
    assert (st.loads, st.evicts, st.resident_bytes, st.lru) == (1, 0, 100, ("a",))
    assert m["a"].weights.reads == 1  # UNPINNED: the load read the weights file


def test_lru_eviction_frees_the_least_recently_used(tmp_path):
    _, cache, m = make(tmp_path, {"a": 40, "b": 40, "c": 40}, budget=90)
    for name in "abc":
        cache.admit(m[name], UNPINNED)
    cache.acquire(m["a"])
    cache.acquire(m["b"])
    cache.acquire(m["a"])  # b is now the least recent
    cache.acquire(m["c"])
    assert (m["a"].weights_resident(), m["b"].weights_resident(), m["c"].weights_resident()) == (
        True,
        False,
        True,
    )
    assert m["b"].frees == 1
    st = cache.stats()
    assert (st.loads, st.evicts, st.resident_bytes, st.lru) == (3, 1, 80, ("a", "c"))


def test_pinned_device_is_never_evicted_and_not_in_the_budget(tmp_path):
    _, cache, m = make(tmp_path, {"p": 500, "a": 60, "b": 60}, budget=100)
    cache.admit(m["p"], DEVICE)
    cache.admit(m["a"], UNPINNED)
    cache.admit(m["b"], UNPINNED)
    assert m["p"].weights_resident()
    for _ in range(3):
        cache.acquire(m["a"])
        cache.acquire(m["p"])
        cache.acquire(m["b"])
    st = cache.stats()
    assert m["p"].frees == 0 and st.pinned_bytes == 500
    assert st.resident_bytes == 60 and st.lru == ("b",)
    assert (st.loads, st.evicts) == (6, 5)
    assert cache.residency("p").floor is DEVICE
    assert not cache.residency("p").host_resident  # device-pinned keeps no host copy


def test_a_model_larger_than_the_budget_loads_anyway_with_a_warning(tmp_path):
    _, cache, m = make(tmp_path, {"small": 10, "huge": 500}, budget=100)
    cache.admit(m["small"], UNPINNED)
    cache.admit(m["huge"], UNPINNED)
    cache.acquire(m["small"])
    with capture_logs() as logs:
        cache.acquire(m["huge"])
    assert m["huge"].weights_resident() and not m["small"].weights_resident()
    (warning,) = [e for e in logs if e["event"] == "model_exceeds_weight_budget"]
    assert warning["model"] == "huge" and warning["budget_bytes"] == 100
    assert cache.stats().resident_bytes == 500


def test_pinned_system_loads_from_the_host_copy_without_reading_the_file(tmp_path):
    _, cache, m = make(tmp_path, {"a": 64})
    cache.admit(m["a"], SYSTEM)
    assert m["a"].weights.reads == 1  # materialised once
    assert cache.residency("a").host_resident
    host = cache._records["a"].host
    for _ in range(3):
        cache.compact()
        cache.acquire(m["a"])
    assert m["a"].weights.reads == 1, "on-demand loads come from the host tier"
    assert all(src is host for src in m["a"].loaded_from)
    np.testing.assert_array_equal(m["a"].device[0], np.arange(64, dtype=np.uint8))


def test_unspecified_floor_is_pinned_system_with_the_cache_and_unpinned_without(tmp_path):
    _, on, m = make(tmp_path, {"a": 8})
    assert on.admit(m["a"]) is SYSTEM
    backend = FakeBackend(0)
    off = WeightCache(backend, arena=0)
    model = FakeModel(backend, tmp_path, "b", 8)
    assert off.admit(model) is UNPINNED
    assert model.weights_resident(), "without the cache every model is loaded at admission"
    model.free_weights()
    off.acquire(model)
    assert model.weights_resident()
    assert off.stats().loads == 0 and off.max_bytes == 0
    assert off.compact(["b"]) == 0


def test_stale_version_is_unavailable_and_duplicate_admit_refused(tmp_path):
    backend, cache, m = make(tmp_path, {"a": 8})
    cache.admit(m["a"], UNPINNED)
    with pytest.raises(FailedPrecondition, match="already managed"):
        cache.admit(m["a"])
    newer = FakeModel(backend, tmp_path, "a", 8)
    assert cache.replace(newer) is UNPINNED
    with pytest.raises(Unavailable, match="model 'a' was reloaded; retry"):
        cache.acquire(m["a"])
    cache.acquire(newer)
    assert newer.weights_resident()


# -- explicit mode and transitions ----------------------------------------------------------------


def test_externally_managed_acquire_refuses_and_transitions_move_buffers(tmp_path):
    _, cache, m = make(tmp_path, {"a": 32}, mode=EXTERNAL)
    cache.admit(m["a"])
    assert not cache.is_servable("a")
    with pytest.raises(NotResidentError) as err:
        cache.acquire(m["a"])
    assert err.value.message == "model 'a' is not resident"
    with pytest.raises(NotResidentError):
        cache.check_servable("a")
    assert cache.set_residency("a", DEVICE) is DEVICE
    assert m["a"].weights_resident() and cache.is_servable("a")
    cache.acquire(m["a"])  # no error, no load counted
    assert cache.stats().pinned_bytes == 32 and cache.stats().loads == 0
    assert cache.set_residency("a", SYSTEM) is SYSTEM
    assert not m["a"].weights_resident(), "leaving PINNED_DEVICE in explicit mode frees it"
    assert cache.residency("a") == cache.residency("a").__class__(SYSTEM, False, True, 32)
    assert cache.set_residency("a", UNPINNED) is UNPINNED
    assert not cache.residency("a").host_resident
    assert cache.set_residency("a", int(DEVICE)) is DEVICE  # from the file this time
    assert m["a"].weights_resident()
    assert cache.stats().pinned_bytes == 32


def test_set_residency_errors(tmp_path):
    _, cache, m = make(tmp_path, {"a": 8}, mode=EXTERNAL)
    cache.admit(m["a"])
    with pytest.raises(InvalidArgument) as err:
        cache.set_residency("a", 0)
    assert str(err.value) == (
        "residency target must be UNPINNED, PINNED_SYSTEM or PINNED_DEVICE (got 0)"
    )
    with pytest.raises(NotFound, match=r"^unknown model: nope$"):
        cache.set_residency("nope", DEVICE)
    _, selfm, m2 = make(tmp_path, {"a": 8})
    selfm.admit(m2["a"])
    with pytest.raises(FailedPrecondition) as err:
        selfm.set_residency("a", DEVICE)
    assert str(err.value) == SELF_MANAGED
    backend = FakeBackend(0)
    off = WeightCache(backend, arena=0, mode=EXTERNAL)
    off.admit(FakeModel(backend, tmp_path, "a", 8))
    with pytest.raises(FailedPrecondition) as err:
        off.set_residency("a", DEVICE)
    assert str(err.value) == NEEDS_CACHE


def test_shared_store_backs_pinned_system_and_unpin_unlinks(tmp_path):
    name = f"m{uuid.uuid4().hex[:8]}"
    backend = FakeBackend(1000)
    cache = WeightCache(backend, store=SharedWeightStore(), arena=1000, mode=EXTERNAL)
    model = FakeModel(backend, tmp_path, name, 100)
    cache.admit(model)
    regions = [p.name for p in SHM_DIR.glob(f"kst-w-{name}-*") if not p.name.endswith(".lock")]
    assert len(regions) == 1
    cache.set_residency(name, DEVICE)
    np.testing.assert_array_equal(model.device[0], np.arange(100, dtype=np.uint8))
    cache.set_residency(name, UNPINNED)
    assert list(SHM_DIR.glob(f"kst-w-{name}-*")) == []
    cache.set_residency(name, SYSTEM)
    assert len(list(SHM_DIR.glob(f"kst-w-{name}-*"))) == 2  # region + lock
    cache.close()
    assert list(SHM_DIR.glob(f"kst-w-{name}-*")) == []


# -- compaction -----------------------------------------------------------------------------------


def test_compaction_frees_on_demand_keeps_pinned_and_reloads_listed(tmp_path):
    _, cache, m = make(tmp_path, {"p": 10, "a": 20, "b": 30})
    cache.admit(m["p"], DEVICE)
    cache.admit(m["a"], SYSTEM)
    cache.admit(m["b"], UNPINNED)
    cache.acquire(m["a"])
    cache.acquire(m["b"])
    assert cache.compact() == 0
    st = cache.stats()
    assert (st.resident_bytes, st.lru, st.compactions) == (0, (), 1)
    assert m["p"].weights_resident() and not m["a"].weights_resident()
    assert cache.residency("a").host_resident, "host tiers are untouched"
    cache.acquire(m["a"])
    assert cache.compact(["b", "p", "b"]) == 1  # p is pinned, b listed twice
    assert m["b"].weights_resident() and not m["a"].weights_resident()
    with pytest.raises(NotFound, match=r"^unknown model: zz$"):
        cache.compact(["b", "zz"])
    assert m["b"].weights_resident(), "nothing is freed when a name is unknown"


def test_compaction_in_explicit_mode_ignores_reloads(tmp_path):
    _, cache, m = make(tmp_path, {"a": 20}, mode=EXTERNAL)
    cache.admit(m["a"])
    assert cache.compact(["a"]) == 0
    assert not m["a"].weights_resident()


def test_auto_compaction_every_n_loads(tmp_path):
    _, cache, m = make(tmp_path, {"a": 20, "b": 20}, compaction_interval=2)
    cache.admit(m["a"], UNPINNED)
    cache.admit(m["b"], UNPINNED)
    cache.acquire(m["a"])
    cache.after_dispatch()
    assert cache.stats().compactions == 0
    cache.acquire(m["b"])
    cache.after_dispatch()
    st = cache.stats()
    assert st.compactions == 1 and st.resident_bytes == 0
    cache.after_dispatch()
    assert cache.stats().compactions == 1  # no new loads since the mark


# -- removal, rename ---------------------------------------------------------------------------


def test_release_frees_and_forgets_and_rename_keeps_the_lru_position(tmp_path):
    _, cache, m = make(tmp_path, {"a": 10, "b": 10})
    cache.admit(m["a"], UNPINNED)
    cache.admit(m["b"], SYSTEM)
    cache.acquire(m["a"])
    cache.acquire(m["b"])
    cache.rename("a", "a2")
    assert cache.stats().lru == ("a2", "b")
    m["a"].free_weights()  # the entry still carries its old name: found by identity
    cache.acquire(m["a"])
    assert m["a"].weights_resident() and cache.stats().lru == ("b", "a2")
    cache.acquire(m["a"])
    cache.acquire(m["b"])
    assert cache.has("a2") and not cache.has("a")
    assert cache.store.holds("b")
    cache.rename("b", "b2")
    assert cache.store.holds("b2") and not cache.store.holds("b")
    with pytest.raises(FailedPrecondition, match="'b2' is managed"):
        cache.rename("a2", "b2")
    assert cache.release("b2")
    assert not cache.release("b2")
    assert not m["b"].weights_resident() and not cache.store.holds("b2")
    assert cache.stats().lru == ("a2",)
    assert not cache.release("a2", entry=m["b"]), "another version is not released"
    assert cache.release("a2", entry=m["a"])
    assert cache.stats().resident_bytes == 0


def test_replace_keeps_the_floor_set_by_the_control_plane(tmp_path):
    backend, cache, m = make(tmp_path, {"a": 10}, mode=EXTERNAL)
    cache.admit(m["a"])
    cache.set_residency("a", DEVICE)
    newer = FakeModel(backend, tmp_path, "a", 10)
    assert cache.replace(newer) is DEVICE
    assert newer.weights_resident() and not m["a"].weights_resident()
    assert cache.stats().pinned_bytes == 10


# -- the probe --------------------------------------------------------------------------------


class Live:
    """An output that keeps ``n`` device bytes live until it is dropped."""

    def __init__(self, backend: FakeBackend, n: int) -> None:
        self.backend, self.n = backend, n
        backend.extra += n
        if backend.peak is not None:
            backend.peak = max(backend.peak, backend.memory_in_use())

    def __del__(self) -> None:
        self.backend.extra -= self.n


def programs_for(backend: FakeBackend, scratch: dict[str, int]):
    """One program per model whose outputs keep ``scratch`` bytes live while they exist."""

    def programs(name):
        if name not in scratch:
            return []
        return [(("v", 1), [np.zeros(2)], lambda inputs: Live(backend, scratch[name]))]

    return programs


def test_probe_with_an_allocator_peak_uses_the_spec_formula(tmp_path):
    backend, cache, m = make(tmp_path, {"p": 100, "a": 50, "b": 200}, limit=1000, peak=True)
    cache.wiggle = 0.1
    cache.admit(m["p"], DEVICE)
    cache.admit(m["a"], SYSTEM)
    cache.admit(m["b"], UNPINNED)
    assert cache.max_bytes == 1000  # provisional: floor(fraction * arena)
    result = cache.probe(programs_for(backend, {"a": 300, "b": 120, "p": 999}))
    # ascending weight: a (peak 100+50+300=450 -> 450-(100+50)=300), then b (100+200+120=420,
    # but the allocator peak stays 450 -> 450-(100+200)=150)
    assert result.max_scratch == 300 and result.max_weight == 200
    assert result.budget == weight_budget(
        arena=1000, fraction=1.0, wiggle=0.1, max_scratch=300, pinned_bytes=100
    )
    assert cache.max_bytes == 500 and cache.stats().weight_pool_bytes == 600
    assert set(result.costs) == {"a", "b"} and ("v", 1) in result.costs["a"]
    assert not m["a"].weights_resident() and not m["b"].weights_resident()
    assert m["p"].weights_resident()
    assert cache.stats().loads == 0, "probe loads are not counted"
    # pinning more later shrinks the on-demand budget
    cache.mode = EXTERNAL
    cache.set_residency("a", DEVICE)
    assert cache.max_bytes == 450


def test_probe_without_a_peak_samples_the_live_bytes_of_each_run(tmp_path):
    backend, cache, m = make(tmp_path, {"a": 50, "b": 20}, limit=1000)
    cache.admit(m["a"], UNPINNED)
    cache.admit(m["b"], UNPINNED)
    backend.extra = 400  # someone else's arrays: not this worker's scratch
    with capture_logs() as logs:
        result = cache.probe(programs_for(backend, {"a": 30, "b": 70}))
    assert result.max_scratch == 70 and result.max_weight == 50
    assert backend.extra == 400, "the probe dropped its outputs"
    (resolved,) = [e for e in logs if e["event"] == "weight_budget_resolved"]
    assert resolved["max_scratch_bytes"] == 70 and resolved["on_demand_budget_bytes"] == 930


def test_a_zero_budget_warns_that_models_reload_on_every_dispatch(tmp_path):
    backend, cache, m = make(tmp_path, {"a": 50}, limit=100)
    cache.admit(m["a"], UNPINNED)
    with capture_logs() as logs:
        cache.probe(programs_for(backend, {"a": 100}))
    assert cache.max_bytes == 0
    (warning,) = [e for e in logs if e["event"] == "weight_budget_zero"]
    assert warning["models"] == ["a"]
    assert warning["detail"] == "non-pinned models reload on every dispatch"


def test_pinned_over_commit_warns(tmp_path):
    backend, cache, m = make(tmp_path, {"p": 900}, limit=1000)
    cache.wiggle = 0.5
    cache.admit(m["p"], DEVICE)
    with capture_logs() as logs:
        result = cache.probe(programs_for(backend, {}))
    assert result.budget.pinned_over_commit and cache.max_bytes == 0
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "pinned_weights_over_commit"
    ]


def test_probe_failures_are_reported_not_raised(tmp_path):
    _, cache, m = make(tmp_path, {"a": 10})
    cache.admit(m["a"], UNPINNED)

    def boom(inputs):
        raise RuntimeError("kaboom")

    result = cache.probe(lambda name: [("k", [], boom)])
    assert result.failures == {"a": ["k: RuntimeError('kaboom')"]}
    assert weight_cache_stats(cache).probed


def test_probe_on_the_cpu_measures_real_scratch(backend, demo_bundles):
    from kserve_trio.runtime.model import load_compiled_model
    from kserve_trio.worker.layout import ModelLayout

    backend._cpu_memory_limit = 10 << 20
    try:
        cache = WeightCache(backend, arena=10 << 20)
        models = {
            n: load_compiled_model(demo_bundles / n, backend, resident=False)
            for n in ("mlp", "cnn")
        }
        for model in models.values():
            cache.admit(model, UNPINNED)

        def programs(name):
            model = models[name]
            layout = ModelLayout.build(name, model.manifest, {None: model.batch_keys(None)})
            return [
                (key, layout.zero_inputs(None, key), lambda i, k=key: model.execute(None, k, i))
                for key in model.batch_keys(None)
            ]

        result = cache.probe(programs)
        # mlp at batch 64: input 64x16 f32 + output 64x8 f32 = 6144 bytes live
        assert result.max_scratch >= 64 * (16 + 8) * 4
        assert set(result.costs["mlp"]) == {1, 8, 32, 64}
        assert result.max_weight == max(m.weight_nbytes for m in models.values())
        assert not any(m.weights_resident() for m in models.values())
        cache.acquire(models["mlp"])
        y = models["mlp"].execute(None, 1, [np.ones((1, 16), np.float32)])[0]
        assert y.shape == (1, 8)
        cache.close()
    finally:
        backend._cpu_memory_limit = 0
