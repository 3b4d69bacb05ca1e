"""The quickstart and the read commands against a ClickHouse server catalog (``live``).

The same SQL the facade runs on chDB must run on the server CI uses (Debian's 18.16):
summaries, contents, verify and the demo's statistics query.
"""

from __future__ import annotations

import pytest

from dmi._demo import NORMS_QUERY
from tests.test_cli import LAYERS, batch, dmi, parsed

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_demo_and_every_read_command_on_a_server_catalog(clickhouse_uri, tmp_path):
    where = ["--catalog", clickhouse_uri, "--packs", str(tmp_path / "packs")]
    report = parsed(dmi("demo", "--json", "--plot", str(tmp_path / "demo.png"), *where))
    assert report["bit_exact"] and report["layers"] == LAYERS
    rid = report["request_ids"][0]
    models, requests, show, get, norms, verify, recover = batch(
        None,
        ["models", "--json", *where],
        ["requests", "tiny-llama", "--json", *where],
        ["show", "tiny-llama", rid, "--json", *where],
        ["get", "tiny-llama", rid, "resid_post", "-o", str(tmp_path / "r.pt"), "--json", *where],
        ["sql", NORMS_QUERY, "--json", *where],
        ["verify", "--json", *where],
        ["recover", "--json", *where],
    )
    [model] = parsed(models)
    assert (model["model_id"], model["runs"], model["records"]) == ("tiny-llama", 1, report["records"])
    assert model["stored_bytes"] == report["stored_bytes"]
    assert [r["request_id"] for r in parsed(requests)] == report["request_ids"]
    hooks = {h["hook"]: h for h in parsed(show)["hooks"]}
    assert list(hooks) == report["hooks"] and hooks["resid_post"]["feature_shape"] == [64]
    assert parsed(get)["shape"][0] == len(LAYERS)
    assert [row["layer"] for row in parsed(norms)] == LAYERS
    checked = parsed(verify)
    assert checked["ok"] and checked["records_checked"] == report["records"]
    assert parsed(recover) == {"recovered": [], "not_regular_files": []}
