"""The host memory a tiered table holds (issue 16): ``storage_bytes()`` counts all of it, the
write-back buffer of a file's log included, and the planner's estimate of the share bounds it
as the table trains.

Oracle: the storages of every tensor reachable from the tier's own objects (its caches' maps and
LRU queues, its movers' buffers, its logs' maps), walked through the object graph, each storage
once, file mappings (the backing files, the logs' records) left out: the bytes allocated, against
``storage_bytes()`` less what the all-resident tables count (the cache's buffers, the index).
"""

import gc
import types

import pytest
import torch

import smaps
from modules_helpers import random_kjt
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.distributed.planner import LRU_QUEUE_BYTES_PER_SLOT, tiered_table_bytes
from torchrec_ext.modules.configs import options_of
from torchrec_ext.modules.tiered_tables import TieredTables

_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType)


def _allocated(roots, leave_out=()) -> int:
    """Bytes of the storages of the tensors reachable from ``roots``, each once, neither mapped
    from a file nor reachable from ``leave_out``."""

    def storages(start):
        found, seen, stack = {}, set(), list(start)
        while stack:
            obj = stack.pop()
            if id(obj) in seen or isinstance(obj, _NOT_STATE):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                storage = obj.untyped_storage()
                if storage.filename is None and storage.nbytes():
                    found[storage.data_ptr()] = storage.nbytes()
                continue
            stack.extend(gc.get_referents(obj))
        return found

    others = storages(leave_out)
    return sum(n for ptr, n in storages(roots).items() if ptr not in others)


def _configs(backing):
    return [
        DynamicEmbeddingBagConfig(
            name="a",
            embedding_dim=8,
            num_embeddings=400,
            feature_names=["f0"],
            backing=backing,
            cache_load_factor=0.25,
            eviction_policy="lfu",
        ),
        DynamicEmbeddingBagConfig(
            name="b", embedding_dim=4, num_embeddings=300, feature_names=["f1"], backing=backing, cache_load_factor=0.3
        ),
    ]


def _tier_bytes_allocated(tables: TieredTables) -> int:
    """What the tier adds to the all-resident tables, as allocated: its caches, movers and logs,
    less the cache's own buffers (the all-resident tables' weights and states) and host backing's store
    (``backing_bytes``)."""
    return _allocated(
        [tables.caches, tables._movers, tables.store], leave_out=[tables.weights, tables.states, tables.backing]
    )


@pytest.mark.parametrize("kind", ["file", "host", "file-records"])
def test_storage_bytes_counts_the_host_memory_the_tier_holds_and_the_plan_bounds_it(tmp_path, monkeypatch, kind):
    if kind == "file-records":  # the GPU path's pinned transfer buffers, on the CPU
        monkeypatch.setattr(TieredTables, "copy_through_records", True)
    configs = _configs("host" if kind == "host" else f"file:{tmp_path}")
    module = DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    tables = module._tables
    planned = [
        tiered_table_bytes(
            c.num_embeddings,
            c.embedding_dim,
            "adagrad",
            0.25 if c.name == "a" else 0.3,
            file=kind != "host",
            options=options_of(c),
        )
        for c in configs
    ]
    plan = sum(p.device + p.host for p in planned)
    gen = torch.Generator().manual_seed(3)
    zipf = (torch.rand(4000, generator=gen) ** 3 * 900).long()  # hot ids and a long tail: hits, misses, LRU churn
    batches = [random_kjt(["f0", "f1"], 8, zipf[i * 100 : i * 100 + 100], 6) for i in range(40)]
    saw_buffer = False
    for step, kjt in enumerate(batches):
        if step % 2 and step + 1 < len(batches):  # (also through the stage: write-backs on its worker)
            module.stage_next(batches[step + 1])
        module(kjt).values().square().sum().backward()
        tier = tables.storage_bytes() - super(TieredTables, tables).storage_bytes()
        assert tier == _tier_bytes_allocated(tables), step
        assert tables.storage_bytes() <= plan, step
        assert all(cache.order.nbytes() <= LRU_QUEUE_BYTES_PER_SLOT * cache.slots for cache in tables.caches), step
        saw_buffer |= tables.io_buffer_bytes() > 0
    assert saw_buffer == (kind == "file")  # the write-back buffer, now counted


def test_the_plan_of_device_maps_bounds_what_the_device_and_the_host_each_hold():
    """The device maps (the CUDA default, forced here) hold the cache's maps on the device and only
    their free stack's mirror on the host: each place's allocated bytes within its planned share."""
    configs = _configs("host")
    module, planned = _with_device_maps_and_plans(configs, "adagrad")
    tables = module._tables
    gen = torch.Generator().manual_seed(5)
    zipf = (torch.rand(2000, generator=gen) ** 3 * 900).long()
    for step in range(20):
        module(random_kjt(["f0", "f1"], 8, zipf[step * 100 : step * 100 + 100], 6)).values().sum().backward()
    maps = tables._maps
    assert maps is not None
    on_host = maps.free_host.untyped_storage().nbytes()
    maps_on_device = _allocated([maps]) - on_host
    assert super(TieredTables, tables).storage_bytes() + maps_on_device <= sum(p.device for p in planned)
    assert on_host + tables.backing_bytes() <= sum(p.host for p in planned)


def tiered_config(name: str, rows: int, factor: float, algorithm: str | None = None) -> DynamicEmbeddingBagConfig:
    """A host-backed table of ``rows`` rows, feature ``f<name>``, caching ``factor`` of them."""
    return DynamicEmbeddingBagConfig(
        name=name,
        embedding_dim=4,
        num_embeddings=rows,
        feature_names=[f"f{name}"],
        backing="host",
        cache_load_factor=factor,
        cache_algorithm=algorithm,
    )


def test_the_device_maps_of_an_lfu_table_beside_lru_tables_stay_within_the_plan():
    """An LFU table beside a large LRU table in one module: the maps count the lookups of the LFU
    table's rows only, as the plan does (they counted every table's rows: the LRU table's 4 bytes
    a row beyond its plan)."""
    configs = [tiered_config("a", 64, 0.5, "lfu"), tiered_config("b", 100_000, 0.01)]
    module, planned = _with_device_maps_and_plans(configs, "sgd")
    tables = module._tables
    gen = torch.Generator().manual_seed(2)
    for _ in range(6):
        ids = torch.randint(0, 400, (60,), generator=gen)
        module(random_kjt(["fa", "fb"], 6, ids, 5)).values().sum().backward()
    maps = tables._maps
    maps_on_device = _allocated([maps]) - maps.free_host.untyped_storage().nbytes()
    assert super(TieredTables, tables).storage_bytes() + maps_on_device <= sum(p.device for p in planned)


def _with_device_maps_and_plans(configs, optimizer: str):
    """A module of ``configs`` with the device maps (the CUDA default, forced here), and each
    table's plan (``tiered_table_bytes``) with them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TieredTables, "device_maps", True)
        module = DynamicEmbeddingBagCollection(configs, optimizer=optimizer, optimizer_kwargs={"lr": 0.05})
    planned = [
        tiered_table_bytes(
            c.num_embeddings,
            c.embedding_dim,
            optimizer,
            c.cache_load_factor,
            file=False,
            options=options_of(c),
            device_maps=True,
        )
        for c in configs
    ]
    return module, planned


def _mapped_kib(directory) -> dict[str, int]:
    """Per backing file under ``directory``, the kB of it this process has mapped resident (the
    kernel's own count)."""
    found: dict[str, int] = {}
    for path, fields in smaps.mappings():
        if path is not None and path.startswith(str(directory)):
            found[path] = found.get(path, 0) + int(fields["Rss:"][0])
    return found


@pytest.mark.parametrize(
    "pread, release",
    [(True, True), (True, False), (False, True), (False, False)],
    ids=["defaults", "pread", "mapped_released", "mapped_kept"],
)
def test_reads_by_pread_or_released_pages_leave_no_backing_file_mapped_and_train_alike(
    tmp_path, monkeypatch, pread, release
):
    """Rows are a fraction of a page, so each row copied through a backing file's mapping maps a
    page (and the kernel's fault-around its neighbours): kept mapped, the process's resident memory
    grows with every page the tables touched, up to the files' size. Read with pread (the default,
    ``tier_guard.READ_WITH_PREAD``), rows map no page; with ``RELEASE_AFTER_COPY`` a copy through
    the mapping unmaps its pages after it (the page cache keeps them, dirty ones too). Either way the
    rows trained are what an all-resident module trains."""
    from torchrec_ext.modules import tier_guard

    monkeypatch.setattr(tier_guard, "READ_WITH_PREAD", pread)
    monkeypatch.setattr(tier_guard, "RELEASE_AFTER_COPY", release)
    torch.manual_seed(0)
    tiered = DynamicEmbeddingBagCollection(_configs(f"file:{tmp_path}"), optimizer="adagrad")
    resident_configs = _configs("host")
    for config in resident_configs:
        config.backing, config.cache_load_factor = "device", None
    resident = DynamicEmbeddingBagCollection(resident_configs, optimizer="adagrad")
    resident.load_state_dict(tiered.state_dict())
    for step in range(12):  # 400 and 300 ids into caches of 100 and 90 rows: misses and write-backs
        kjt = random_kjt(["f0", "f1"], 32, torch.arange(step * 40, step * 40 + 400), max_len=2)
        for module in (tiered, resident):
            module(kjt).values().sum().backward()
    stats = tiered.table_stats()
    assert stats["a"].cache_misses > 0 and stats["a"].cache_write_backs > 0
    mapped = _mapped_kib(tmp_path)
    assert any(name.endswith(".rows") for name in mapped), mapped  # the files are mapped by this process
    if pread or release:
        assert sum(mapped.values()) == 0, mapped
    else:
        assert sum(mapped.values()) > 0, mapped
    for key, value in resident.state_dict().items():
        assert torch.equal(value, tiered.state_dict()[key]), key
