"""Nothing may destroy the index: packs carry their own, and ``recover`` rebuilds the catalog.

Each test writes real packs, publishes them, damages the real (chDB) catalog the way an
operator with a ClickHouse client or ``rm -rf`` could (``Store.sql`` is read-only, so the
damage goes through the backend: it stands in for that client), and checks that
``verify`` says so, ``recover`` brings every record back exactly once, and a second
``recover`` has nothing to do.
"""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch

import dmi
from dmi.cli import main
from dmi.storage import PackStore, PackWriter, RecordKey

LAYERS = 3
REQUESTS = 4


def _write_packs(home) -> int:
    """Sealed packs of ``REQUESTS`` x ``LAYERS`` records (5 records a pack); returns the record count."""
    with PackWriter(PackStore.local(home / "packs"), max_records=5) as writer:
        for request in range(REQUESTS):
            for layer in range(LAYERS):
                key = RecordKey("m", "run-1", f"req-{request}", "resid_post", layer, 0, 3)
                writer.append(key, torch.full((3, 8), float(request * 10 + layer)))
    return REQUESTS * LAYERS


def _keys(store) -> Counter:
    return Counter(
        (e.meta.key.request_id, e.meta.key.layer, e.meta.key.start_token) for e in store.catalog.find_records("m")
    )


def _index_rows(store) -> int:
    table = store.catalog.tables["records"]
    return store.catalog.sql(f"SELECT count() AS n FROM {table}").column("n")[0].as_py()


def _drop_tables(store, home) -> None:
    for name in ("records", "packs", "watermarks"):
        store.catalog._backend.command(f"DROP TABLE {store.catalog.tables[name]}")


def _delete_directory(store, home) -> None:
    store.close()
    shutil.rmtree(home / "catalog")


def _lose_rows(store, home) -> None:
    store.catalog._backend.command(
        f"ALTER TABLE {store.catalog.tables['records']} DELETE WHERE layer = 1 SETTINGS mutations_sync = 2"
    )


@pytest.mark.parametrize("damage", [_drop_tables, _delete_directory, _lose_rows],
                         ids=["tables-dropped", "directory-deleted", "rows-lost"])
def test_recover_rebuilds_the_index_from_the_packs(tmp_path, damage):
    home = tmp_path / "store"
    total = _write_packs(home)
    n_packs = len(PackStore.local(home / "packs").list_packs())
    with dmi.open(home=home) as store:
        assert len(store.recover()) == n_packs  # the ordinary publish of sealed packs
        assert _keys(store) == Counter({k: 1 for k in _keys(store)}) and sum(_keys(store).values()) == total
        before = torch.clone(store.get_internal("m", "req-2", "resid_post"))
        damage(store, home)
    with dmi.open(home=home) as store:
        missing = store.unindexed_packs()
        assert missing, "the damage was not noticed"
        assert sorted(store.verify().unpublished_packs) == sorted(missing)
        recovered = store.recover()
        assert sorted(p.pack_id for p in recovered) == sorted(missing)
        keys = _keys(store)
        assert sum(keys.values()) == total and set(keys.values()) == {1}  # every record, once
        assert _index_rows(store) == total  # no index row written twice
        assert torch.equal(store.get_internal("m", "req-2", "resid_post"), before)
        assert store.recover() == [] and store.unindexed_packs() == []
        assert store.verify().ok and store.verify().unpublished_packs == ()


def test_models_names_one_unindexed_pack_in_the_singular(tmp_path, capsys):
    home = tmp_path / "store"
    with PackWriter(PackStore.local(home / "packs")) as writer:
        writer.append(RecordKey("m", "run-1", "req-0", "resid_post", 0, 0, 3), torch.zeros(3, 8))
    assert main(["models", "--home", str(home)]) == 0
    assert "dmi: 1 pack on disk is not in the catalog" in capsys.readouterr().err


def test_models_after_the_catalog_directory_is_deleted_says_to_recover(tmp_path, capsys):
    home = tmp_path / "store"
    _write_packs(home)
    with dmi.open(home=home) as store:
        store.recover()
    shutil.rmtree(home / "catalog")
    assert main(["models", "--home", str(home)]) == 0
    err = capsys.readouterr().err
    packs = len(PackStore.local(home / "packs").list_packs())
    assert packs > 1 and f"dmi: {packs} packs on disk are not in the catalog" in err and "dmi recover" in err
    assert main(["recover", "--home", str(home), "-q"]) == 0
    capsys.readouterr()
    assert main(["models", "--home", str(home), "--json"]) == 0
    out = capsys.readouterr()
    assert '"model_id": "m"' in out.out and "dmi recover" not in out.err


def test_verify_says_when_packs_are_not_in_the_catalog(tmp_path, capsys):
    home = tmp_path / "store"
    _write_packs(home)
    assert main(["verify", "--home", str(home), "-q"]) == 0
    assert "sealed packs on disk are not (fully) in the catalog: run `dmi recover`" in capsys.readouterr().err
