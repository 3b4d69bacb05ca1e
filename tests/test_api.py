"""The ``import dmi`` facade in process: open, capture, summaries, tensors, lazy views, SQL, guards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dmi
from dmi.storage import PackStore
from dmi.reader import plan_reads

PROMPTS = ["the quick brown fox", "hi"]


@pytest.fixture(scope="module")
def tiny():
    from dmi._models import load_model

    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def captured(tmp_path_factory, tiny):
    """Run ``run-a``: a scoring pass over two prompts as requests ``a`` and ``b``.
    Run ``run-b``: greedy generation (prefill + 2 decode forwards) reusing request id ``a``."""
    home = tmp_path_factory.mktemp("api-home")
    enc = tiny.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with dmi.open(home=home) as opened:
        with dmi.capture(tiny.model, hooks="resid_post,token_ids", store=opened, model_id="m", run_id="run-a") as cap:
            with torch.inference_mode():
                ids, out = cap.forward(enc["input_ids"], enc["attention_mask"], request_ids=["a", "b"],
                                       output_hidden_states=True)
        assert ids == ("a", "b")
        with opened.capture(tiny.model, hooks="resid_post", model_id="m", run_id="run-b") as cap:
            with torch.inference_mode():
                cap.generate(enc["input_ids"][:1], enc["attention_mask"][:1], request_ids=["a"],
                             max_new_tokens=3, do_sample=False)
        # the model's own hidden states from the captured call, for the bit-exact checks
        yield SimpleNamespace(store=opened, hidden=out.hidden_states, mask=enc["attention_mask"])


@pytest.fixture
def store(captured):
    return captured.store


class ReadCounter:
    """Counts pack opens and the byte ranges read through ``PackInput.read_into``."""

    def __init__(self, packs: PackStore, monkeypatch):
        self.opens = 0
        self.ranges: list[tuple[str, int, int]] = []
        original = packs.open_input

        def open_input(pack_id, **options):
            self.opens += 1
            source = original(pack_id, **options)
            read_into = source.read_into

            def counted(offset, out):
                self.ranges.append((pack_id, offset, len(out)))
                return read_into(offset, out)

            source.read_into = counted
            return source

        monkeypatch.setattr(packs, "open_input", open_input)


def test_capture_is_both_the_package_and_the_facade():
    import dmi.capture as package
    from dmi.capture import HOOKS, attach

    assert package is dmi.capture and callable(dmi.capture)
    assert dmi.capture.attach is attach and "resid_post" in HOOKS


def test_resid_post_is_bit_exact_against_output_hidden_states(captured):
    store, hidden = captured.store, captured.hidden
    for row, rid in enumerate(["a", "b"]):
        real = captured.mask[row].bool()
        got = store.get_internal("m", rid, "resid_post", run_id="run-a")
        assert got.shape == (4, int(real.sum()), 64) and got.dtype == torch.bfloat16
        for layer in range(3):  # the last hidden state is after the final norm
            assert torch.equal(got[layer], hidden[layer + 1][row][real])


def test_summaries(captured):
    store = captured.store
    [model] = store.models()
    assert (model.model_id, model.runs, model.requests) == ("m", 2, 2)
    a_len = int(captured.mask[0].sum())
    rows = {(r.run_id, r.request_id): r for r in store.requests("m")}
    assert set(rows) == {("run-a", "a"), ("run-a", "b"), ("run-b", "a")}
    assert rows["run-a", "a"].n_tokens == a_len and rows["run-b", "a"].n_tokens == a_len + 2
    assert rows["run-a", "a"].hooks == ("token_ids", "resid_post")
    contents = store.contents("m", "b")
    assert contents.run_id == "run-a"
    assert contents.hook("resid_post").layers == (0, 1, 2, 3)
    assert contents.hook("token_ids").layers == (-1,)
    assert model.records == sum(r.records for r in rows.values())
    assert model.stored_bytes == sum(r.stored_bytes for r in rows.values())


def test_dropped_records_are_shown_never_silent(store, capsys):
    from dmi.cli import main

    assert store.contents("m", "b").losses == ()
    store.catalog.record_losses("m", "run-a", "b", "resid_post", 2, 3, "ring full")
    assert store.contents("m", "b").losses == (dmi.Loss("resid_post", 2, 3, "ring full"),)
    assert store.contents("m", "a", run_id="run-a").losses == ()
    assert main(["show", "m", "b", "--home", store.home]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "lost: 3 resid_post records (layer 2) dropped: ring full"


def test_a_request_in_two_runs_is_never_merged(store):
    with pytest.raises(dmi.DuplicateChunkError, match=r"2 runs \(run-a, run-b\).*run_id="):
        store.get_internal("m", "a", "resid_post")
    with pytest.raises(dmi.DuplicateChunkError, match="run_id="):
        store.contents("m", "a")
    a = store.get_internal("m", "a", "resid_post", run_id="run-a")
    b = store.get_internal("m", "a", "resid_post", run_id="run-b")
    assert b.shape[1] == a.shape[1] + 2
    assert torch.equal(b[:, : a.shape[1]], a)  # same weights, same prompt: the prefill is identical


def test_layer_selections(store):
    full = store.get_internal("m", "b", "resid_post")
    assert torch.equal(store.get_internal("m", "b", "resid_post", layers=2), full[2:3])
    assert torch.equal(store.get_internal("m", "b", "resid_post", layers=range(1, 3)), full[1:3])
    assert torch.equal(store.get_internal("m", "b", "resid_post", layers=[3, 0]), full[[0, 3]])
    assert torch.equal(store.get_internal("m", "b", "resid_post", layers=slice(2, None)), full[2:])
    with pytest.raises(dmi.InvalidArgumentError, match="layers must be"):
        store.get_internal("m", "b", "resid_post", layers="0:2")


def test_token_ids_are_the_tokenizers(store, tiny):
    ids = store.get_internal("m", "b", "token_ids")
    assert ids.tolist() == tiny.tokenizer("hi")["input_ids"]


def test_unknown_names_are_named_errors(store):
    with pytest.raises(dmi.HookSelectionError, match="unknown hook 'resid'.*is a group.*resid_post"):
        store.get_internal("m", "b", "resid")
    with pytest.raises(dmi.RecordNotFoundError, match=r"no model 'x'.*\(models: m\)"):
        store.get_internal("x", "b", "resid_post")
    with pytest.raises(dmi.RecordNotFoundError, match="no request 'zz'"):
        store.lazy("m", "zz", "resid_post")
    with pytest.raises(dmi.RecordNotFoundError, match="holds no 'mlp_out' records"):
        store.get_internal("m", "b", "mlp_out")
    with pytest.raises(dmi.RecordNotFoundError, match=r"has layers \[0, 1, 2, 3\]"):
        store.get_internal("m", "b", "resid_post", layers=[9])
    with pytest.raises(dmi.RecordNotFoundError, match="no run 'run-z'"):
        store.requests("m", run_id="run-z")


def test_lazy_view_reads_nothing_until_indexed(store, monkeypatch):
    full = store.get_internal("m", "a", "resid_post", run_id="run-b")
    counter = ReadCounter(store.packs, monkeypatch)
    view = store.lazy("m", "a", "resid_post", run_id="run-b")
    assert (view.shape, view.dtype, len(view), view.layers) == (full.shape, full.dtype, 4, (0, 1, 2, 3))
    assert view.per_layer and view.records == 8  # prefill + one decode chunk, per layer
    assert (counter.opens, counter.ranges) == (0, [])

    layer1 = store.catalog.find_records("m", request_id="a", hook="resid_post", layers=[1], run_id="run-b")
    assert torch.equal(view[1], full[1])
    assert counter.ranges == [(p.pack_id, p.range.offset, p.range.length) for p in plan_reads(layer1)]

    counter.ranges.clear()
    decode = [e for e in store.catalog.find_records("m", request_id="a", hook="resid_post", run_id="run-b")
              if e.meta.key.phase == "decode"]
    assert torch.equal(view[:, -1], full[:, -1])  # the last token lives in the decode records only
    assert counter.ranges == [(p.pack_id, p.range.offset, p.range.length) for p in plan_reads(decode)]

    for index in (0, -1, slice(1, 3), (slice(None), slice(2, 5)), (2, 3), (slice(None, None, 2), -2), (1, 4, 7),
                  (slice(None), slice(3, None, 2)), ...):
        assert torch.equal(view[index], full[index]), index
    assert torch.equal(view.layer(3), full[3]) and torch.equal(view.read(), full)
    with pytest.raises(IndexError):
        view[4]
    for bad in (slice(None, None, -1), (slice(None), slice(None, None, -1))):
        with pytest.raises(ValueError, match="step must be greater than zero"):
            full[bad]
        with pytest.raises(ValueError, match="step must be greater than zero"):
            view[bad]
    with pytest.raises(KeyError):
        view.layer(7)


def test_lazy_view_of_a_global_hook(store):
    full = store.get_internal("m", "b", "token_ids")
    view = store.lazy("m", "b", "token_ids")
    assert not view.per_layer and view.layers == () and view.shape == full.shape
    assert torch.equal(view[1:], full[1:]) and torch.equal(view[-1], full[-1])


def test_sql_placeholders(store):
    assert store.tables["records"].endswith("dmi_records_published`")
    total = sum(m.records for m in store.models())
    assert store.sql("SELECT count() AS n FROM {records}").to_pylist() == [{"n": total}]
    assert store.sql("SELECT '{x}' AS s").to_pylist() == [{"s": "{x}"}]  # other braces untouched
    with pytest.raises(dmi.ServerError):
        store.sql("SELECT nonsense FROM {records}")
    with pytest.raises(dmi.InvalidArgumentError):
        store.sql(b"SELECT 1")


def test_sql_takes_values_as_params_never_as_sql(store):
    by_literal = store.sql("SELECT layer, count() AS n FROM {records} WHERE hook = 'resid_post' AND layer IN (0, 1) "
                           "GROUP BY layer ORDER BY layer").to_pylist()
    by_params = store.sql("SELECT layer, count() AS n FROM {records} WHERE hook = %(hook)s AND layer IN %(layers)s "
                          "GROUP BY layer ORDER BY layer", params={"hook": "resid_post", "layers": (0, 1)}).to_pylist()
    assert by_params == by_literal and [row["layer"] for row in by_literal] == [0, 1]
    injected = store.sql("SELECT count() AS n FROM {records} WHERE hook = %(hook)s",
                         params={"hook": "resid_post' OR 1 = 1 OR hook = '"}).to_pylist()
    assert injected == [{"n": 0}]  # the quote is a character of the value, not SQL
    assert store.sql("SELECT '100%%' AS s WHERE 1 = %(one)s", params={"one": 1}).to_pylist() == [{"s": "100%"}]
    with pytest.raises(dmi.InvalidArgumentError, match="names the parameter 'hook', which params does not have"):
        store.sql("SELECT count() FROM {records} WHERE hook = %(hook)s", params={"other": 1})
    with pytest.raises(dmi.InvalidArgumentError, match="params must be a dict"):
        store.sql("SELECT 1", params=[("hook", "resid_post")])


def test_sql_names_a_placeholder_that_is_not_a_table(store):
    """A typo in a table placeholder reached ClickHouse as ``{recs}`` and came back as its bare
    syntax error ("Expected colon between name and type"); the error now names the typo and the
    tables, keeping ClickHouse's code. A ``{word}`` inside a query that fails otherwise (here
    inside a string, the query failing on a column) leaves ClickHouse's error alone."""
    with pytest.raises(dmi.ServerError) as info:
        store.sql("SELECT count() FROM {recs} JOIN {pack} USING pack_id")
    tables = ", ".join("{" + t + "}" for t in store.tables)
    assert str(info.value).startswith(f"{{pack}}, {{recs}} are not tables; the tables are {tables} (")
    assert (info.value.code, info.value.name) == (62, "SYNTAX_ERROR")
    with pytest.raises(dmi.ServerError) as info:
        store.sql("SELECT count() FROM {record}")
    assert str(info.value).startswith("{record} is not a table; the tables are {")
    with pytest.raises(dmi.ServerError) as info:
        store.sql("SELECT no_such_column FROM {records} WHERE hook = '{x}'")
    assert "is not a table" not in str(info.value) and info.value.code != 62


def test_verify_reports_progress_and_totals(store):
    ticks = []

    class Bar:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def update(self, n):
            ticks.append(n)

    report = store.verify(progress=lambda total: ticks.append(("total", total)) or Bar())
    total = sum(m.records for m in store.models())
    assert report.ok and report.records_checked == total and ticks[0] == ("total", total)
    assert sum(t for t in ticks[1:]) == total
    with pytest.raises(dmi.RecordNotFoundError):
        store.verify(model_id="nope")


def test_open_resolves_home_catalog_and_packs(store, monkeypatch, tmp_path):
    home = store.home
    monkeypatch.setenv("DMI_HOME", home)
    monkeypatch.delenv("DMI_CATALOG", raising=False)
    monkeypatch.setenv("DMI_PACKS", str(tmp_path / "elsewhere"))
    with dmi.open() as opened:  # the same chDB directory: shares the process's connection
        assert opened.home == home
        assert opened.catalog_uri == store.catalog_uri == f"chdb://{home}/catalog"
        assert opened.packs_uri.endswith(str(tmp_path / "elsewhere"))
    monkeypatch.setenv("DMI_CATALOG", "chdb:///nowhere/else")
    with dmi.open(home=home) as opened:  # an explicit home beats the environment
        assert opened.catalog_uri == store.catalog_uri and opened.packs_uri.endswith(f"{home}/packs")
    assert dmi.default_home() == home
