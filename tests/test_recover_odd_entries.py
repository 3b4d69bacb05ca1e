"""``dmi recover`` around entries named like packs that are not regular files (a FIFO, a
directory): the real packs are recovered, ``--json`` lists them and the skipped entries, and
the command exits 1 because something was left unrecovered (docs/cli.md, ``dmi recover``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dmi.storage import PackStore, PackWriter, RecordKey
from tests.test_cli import assert_one_line_error, batch, parsed

FIFO_ID = "0" * 32
DIR_ID = "f" * 32

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


def _seal(packs, layers: int) -> str:
    """A sealed pack of ``layers`` records that no catalog shows; returns its id."""
    with PackWriter(PackStore.local(packs)) as writer:
        for layer in range(layers):
            writer.append(RecordKey("m", "run-1", "r", "resid_post", layer, 0, 3), torch.ones(3, 8))
        return writer.seal().pack_id


def test_recover_json_lists_what_it_recovered_and_what_it_skipped(tmp_path):
    home = tmp_path / "home"
    packs = home / "packs"
    first, second = _seal(packs, 2), _seal(packs, 3)
    os.mkfifo(packs / f"{FIFO_ID}.arrow")
    os.mkdir(packs / f"{DIR_ID}.arrow")

    recovered, again, models = batch(home, ["recover", "--json"], ["recover", "--json"], ["models", "--json"])

    skipped = [
        {"pack_id": FIFO_ID, "location": str(packs / f"{FIFO_ID}.arrow"), "kind": "FIFO"},
        {"pack_id": DIR_ID, "location": str(packs / f"{DIR_ID}.arrow"), "kind": "directory"},
    ]
    line = assert_one_line_error(recovered, 1, "but skipped 2 entries named like packs")
    in_id_order = sorted([{"pack_id": first, "records": 2}, {"pack_id": second, "records": 3}],
                         key=lambda p: p["pack_id"])
    assert json.loads(recovered.stdout) == {"recovered": in_id_order, "not_regular_files": skipped}
    assert line.startswith(f"dmi: error: recovered 2 packs ({', '.join(sorted([first, second]))})")
    # a second run recovers nothing and still names what it cannot: exit 1 again
    assert_one_line_error(again, 1, "recovered no pack, but skipped 2 entries named like packs")
    assert json.loads(again.stdout) == {"recovered": [], "not_regular_files": skipped}
    [model] = parsed(models)
    assert (model["model_id"], model["records"]) == ("m", 5)


def test_recover_json_without_odd_entries(tmp_path):
    home = tmp_path / "home"
    pack_id = _seal(home / "packs", 2)
    recovered, again = batch(home, ["recover", "--json"], ["recover", "--json"])
    assert parsed(recovered) == {"recovered": [{"pack_id": pack_id, "records": 2}], "not_regular_files": []}
    assert parsed(again) == {"recovered": [], "not_regular_files": []}
    assert recovered.stderr == again.stderr == ""


def test_recover_prints_the_packs_it_recovered_before_the_error(tmp_path):
    home = tmp_path / "home"
    pack_id = _seal(home / "packs", 1)
    os.mkfifo(home / "packs" / f"{FIFO_ID}.arrow")
    [result] = batch(home, ["recover"])
    assert_one_line_error(result, 1, f"recovered 1 pack ({pack_id}), but skipped 1 entry named like a pack")
    assert result.stdout == f"published {pack_id} (1 record)\n"


def test_a_pack_recover_cannot_read_stops_it_before_anything_is_published(tmp_path):
    """A truncated pack stops recovery before anything is published: exit 1 and its error, no
    JSON (there is nothing recovered to list), and every pack still unpublished."""
    home = tmp_path / "home"
    whole = _seal(home / "packs", 1)
    broken = home / "packs" / f"{_seal(home / 'packs', 1)}.arrow"
    broken.write_bytes(broken.read_bytes()[:-10])
    [result, models] = batch(home, ["recover", "--json"], ["models", "--json"])
    assert_one_line_error(result, 1, f"pack {broken.stem}: not a readable Arrow IPC file (truncated or corrupt)")
    assert result.stdout == ""
    assert parsed(models) == []
    assert whole != broken.stem


def test_store_recover_raises_what_it_recovered_and_skipped(tmp_path):
    """In Python the same facts are the error's fields, not only its text."""
    import dmi
    from dmi.storage.errors import RecoveryIncompleteError

    packs = tmp_path / "home" / "packs"
    pack_id = _seal(packs, 2)
    os.mkfifo(packs / f"{FIFO_ID}.arrow")
    with dmi.open(home=tmp_path / "home") as store, pytest.raises(RecoveryIncompleteError) as raised:
        store.recover()
    assert raised.value.recovered == (pack_id,)
    assert raised.value.skipped == {FIFO_ID: "FIFO"}
    assert str(raised.value).startswith(f"recovered 1 pack ({pack_id}), but skipped 1 entry named like a pack: ")
    assert str(raised.value).endswith("; move it out of the pack store (or restore the pack files there) "
                                      "and run recover again")
