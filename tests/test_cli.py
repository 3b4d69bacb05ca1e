"""The ``dmi`` command line end to end, in subprocesses, against temporary stores.

Every process start costs seconds (torch, chDB), so read-only commands run as a batch:
one subprocess parses each argv with ``dmi.cli.main`` and reports, per command, the exit
status and what it wrote to stdout and stderr. The quickstart (``dmi demo``, twice in a
row), ``dmi capture`` and the failure paths that depend on the process (a locked catalog,
an unreachable server, one-line errors on the real stderr) run as ``python -m dmi.cli``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dmi._demo import DEMO_HOOKS, DEMO_NEW_TOKENS, DEMO_PROMPTS, NORMS_QUERY
from dmi._models import byte_tokenizer
from dmi.cli import parse_layers
from tests._ports import free_port
from tests.test_cli_output import png_size

pytestmark = pytest.mark.slow

LAYERS = [0, 1, 2, 3]

_BATCH = r"""
import contextlib, io, json, sys, traceback
from dmi.cli import main
results = []
for argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        except BaseException:
            rc = None
            err.write(traceback.format_exc())
    results.append({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
json.dump(results, sys.stdout)
"""


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


def _env(home: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DMI_CATALOG", "DMI_PACKS", "DMI_HOME")}
    env["DMI_HOME"] = str(home) if home is not None else "/nonexistent-dmi-home"
    return env


def _with_home(args, home: Path | None) -> list[str]:
    return [*args, "--home", str(home)] if home is not None and "--catalog" not in args else list(args)


def dmi(*args: str, home: Path | None = None, stdin: str | None = None, timeout: float = 240) -> Result:
    """``python -m dmi.cli ARGS --home HOME`` in its own process."""
    proc = subprocess.run([sys.executable, "-m", "dmi.cli", *_with_home(args, home)],
                          capture_output=True, text=True, env=_env(home), input=stdin, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def batch(home: Path | None, *commands: list[str] | tuple[str, ...]) -> list[Result]:
    """Run several commands against ``home`` in one subprocess; one ``Result`` each."""
    proc = subprocess.run([sys.executable, "-c", _BATCH], input=json.dumps([_with_home(c, home) for c in commands]),
                          capture_output=True, text=True, env=_env(home), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [Result(r["rc"], r["stdout"], r["stderr"]) for r in json.loads(proc.stdout)]


def parsed(result: Result):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def assert_one_line_error(result: Result, code: int, *needles: str) -> str:
    """Exit ``code``; stderr is exactly one ``dmi: error:`` line containing every needle."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dmi: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def expected_tokens(prompt: str) -> int:
    """Stored tokens of a demo request: real prompt tokens, then one per decode forward."""
    return len(byte_tokenizer()(prompt)["input_ids"]) + DEMO_NEW_TOKENS - 1


@dataclass(frozen=True)
class Demo:
    home: Path
    out: Path
    first: dict
    second: dict
    results: dict[str, Result]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Demo:
    """``dmi demo`` twice into one store, then every read-only command once, in one batch."""
    home = tmp_path_factory.mktemp("dmi-home")
    out = tmp_path_factory.mktemp("dmi-out")
    reports = []
    for _ in range(2):  # the quickstart must survive being run twice in a row
        reports.append(parsed(dmi("demo", "--json", home=home)))
    first, second = reports
    r0, r1, r2 = first["request_ids"][:3]
    commands = {
        "models": ["models", "--json"],
        "requests_run": ["requests", "tiny-llama", "--run", first["run_id"], "--json"],
        "requests_table": ["requests", "tiny-llama"],
        "show": ["show", "tiny-llama", r0, "--json"],
        "show_table": ["show", "tiny-llama", r0],
        "get_safetensors": ["get", "tiny-llama", r0, "resid_post", "-o", str(out / "r.safetensors"), "--json"],
        "get_pt": ["get", "tiny-llama", r0, "resid_post", "-o", str(out / "r.pt"), "--json"],
        "get_layers": ["get", "tiny-llama", r0, "resid_post", "--layers", "1:3", "-o", str(out / "p.pt"), "--json"],
        "get_layers_as_shown": ["get", "tiny-llama", r0, "resid_post", "--layers", "1-2", "-o", str(out / "s.pt"),
                                "--json"],
        "get_token_ids": ["get", "tiny-llama", r0, "token_ids", "-o", str(out / "t.npy"), "--json"],
        "get_r2": ["get", "tiny-llama", r2, "resid_post", "-o", str(out / "r2.pt"), "--json"],
        "get_npy_bf16": ["get", "tiny-llama", r0, "resid_post", "-o", str(out / "x.npy")],
        "get_npy_float32": ["get", "tiny-llama", r0, "resid_post", "--dtype", "float32", "-o", str(out / "f.npy"),
                            "--json"],
        "get_ids_as_float": ["get", "tiny-llama", r0, "token_ids", "--dtype", "float32", "-o", str(out / "i.npy")],
        "sql_norms": ["sql", NORMS_QUERY, "--json"],
        "sql_r2": ["sql", "SELECT layer, sqrt(sum(l2_norm * l2_norm)) AS norm FROM {records} "
                   f"WHERE hook = 'resid_post' AND request_id = '{r2}' GROUP BY layer ORDER BY layer", "--json"],
        "sql_count": ["sql", "SELECT count() AS n FROM {records}"],
        "sql_params": ["sql", "SELECT layer, count() AS n FROM {records} WHERE hook = %(h)s AND request_id = %(r)s "
                       "AND layer IN %(l)s GROUP BY layer ORDER BY layer", "--param", "h=resid_post", "--param",
                       f"r={r2}", "--param", "l=[1,2]", "--json"],
        "sql_literal": ["sql", "SELECT layer, count() AS n FROM {records} WHERE hook = 'resid_post' AND "
                        f"request_id = '{r2}' AND layer IN (1, 2) GROUP BY layer ORDER BY layer", "--json"],
        "sql_param_injection": ["sql", "SELECT count() AS n FROM {records} WHERE hook = %(h)s", "--param",
                                "h=resid_post' OR 1 = 1 OR hook = '", "--json"],
        "sql_bad": ["sql", "SELECT nonsense FROM {records}"],
        "plot": ["plot", "tiny-llama", r1, "--hook", "mlp_out", "-o", str(out / "mlp.png"), "--size", "640x360",
                 "--json"],
        "plot_global": ["plot", "tiny-llama", r1, "--hook", "final_norm", "-o", str(out / "final.png"), "--json"],
        "plot_ids": ["plot", "tiny-llama", r1, "--hook", "token_ids", "-o", str(out / "ids.png")],
        "plot_svg": ["plot", "tiny-llama", r1, "--hook", "resid_post", "-o", str(out / "plot.svg")],
        "verify": ["verify", "--json"],
        "no_model": ["requests", "no-such-model"],
        "no_request": ["show", "tiny-llama", "no-such-request"],
        "group_as_hook": ["get", "tiny-llama", r0, "resid", "-o", str(out / "x.pt")],
        "hook_not_held": ["get", "tiny-llama", r0, "attn_pattern", "-o", str(out / "x.pt")],
        "layer_not_held": ["get", "tiny-llama", r0, "resid_post", "--layers", "7", "-o", str(out / "x.pt")],
        "bad_layers": ["get", "tiny-llama", r0, "resid_post", "--layers", "x", "-o", str(out / "x.pt")],
    }
    results = dict(zip(commands, batch(home, *commands.values())))
    return Demo(home, out, first, second, results)


def test_demo_captures_checks_and_plots(demo):
    first = demo.first
    assert first["bit_exact"] and demo.second["bit_exact"]
    assert first["home"] == str(demo.home)
    assert len(first["request_ids"]) == len(DEMO_PROMPTS)
    assert first["layers"] == LAYERS
    assert set(DEMO_HOOKS.split(",")) == {"tokens", "resid", "attn", "mlp", "logits"}
    # those groups (attn without patterns), in catalogue order
    assert first["hooks"] == ["token_ids", "embed", "resid_pre", "attn_q", "attn_k", "attn_v", "attn_z", "attn_out",
                              "resid_mid", "mlp_post", "mlp_out", "resid_post", "final_norm", "logits"]
    # embed, resid_post of all but the last layer, final_norm: per request
    assert first["checked_tensors"] == len(DEMO_PROMPTS) * (len(LAYERS) + 1)
    assert first["checked_tokens"] == sum(expected_tokens(p) for p in DEMO_PROMPTS)
    assert first["raw_bytes"] > first["stored_bytes"] > 0 and first["pack_bytes"] > first["stored_bytes"]
    assert png_size(first["plot_path"]) == (1200, 500)
    assert first["seconds"] < 60


def test_second_demo_run_appends_a_new_run(demo):
    first, second = demo.first, demo.second
    assert first["run_id"] != second["run_id"]
    assert not set(first["request_ids"]) & set(second["request_ids"])
    [model] = parsed(demo.results["models"])
    assert model["model_id"] == "tiny-llama"
    assert model["runs"] == 2 and model["requests"] == 2 * len(DEMO_PROMPTS)
    assert model["records"] == first["records"] + second["records"]
    assert model["stored_bytes"] == first["stored_bytes"] + second["stored_bytes"]
    assert model["raw_bytes"] == first["raw_bytes"] + second["raw_bytes"]
    assert model["ratio"] == pytest.approx(model["raw_bytes"] / model["stored_bytes"])


def test_requests_lists_one_run(demo):
    rows = parsed(demo.results["requests_run"])
    assert [r["request_id"] for r in rows] == demo.first["request_ids"]
    assert [r["n_tokens"] for r in rows] == [expected_tokens(p) for p in DEMO_PROMPTS]
    assert {r["run_id"] for r in rows} == {demo.first["run_id"]}
    assert sum(r["records"] for r in rows) == demo.first["records"]
    table = demo.results["requests_table"]
    assert table.returncode == 0 and len(table.stdout.strip().splitlines()) == 2 + 2 * len(DEMO_PROMPTS)
    assert max(len(line) for line in table.stdout.splitlines()) <= 100  # fits a terminal
    assert table.stdout.splitlines()[2].split()[3] == str(len(demo.first["hooks"]))  # how many hooks


def test_show_describes_every_hook(demo):
    shown = parsed(demo.results["show"])
    assert (shown["request_id"], shown["run_id"], shown["losses"]) == (demo.first["request_ids"][0],
                                                                       demo.first["run_id"], [])
    rows = {r["hook"]: r for r in shown["hooks"]}
    assert list(rows) == demo.first["hooks"]
    resid = rows["resid_post"]
    assert resid["layers"] == LAYERS and resid["shard_ranks"] == [0]
    assert resid["dtype"] == "bfloat16" and resid["feature_shape"] == [64]
    assert resid["n_tokens"] == expected_tokens(DEMO_PROMPTS[0])
    assert resid["raw_bytes"] == len(LAYERS) * resid["n_tokens"] * 64 * 2
    assert rows["token_ids"]["layers"] == [-1] and rows["token_ids"]["dtype"] == "int64"
    assert rows["attn_q"]["feature_shape"] == [4, 16] and rows["attn_k"]["feature_shape"] == [2, 16]
    table = demo.results["show_table"].stdout.splitlines()
    assert table[0] == f"model tiny-llama  request {demo.first['request_ids'][0]}  run {demo.first['run_id']}"
    [resid_line] = [line for line in table if line.startswith("resid_post ")]
    assert parse_layers(resid_line.split()[1]) == resid["layers"]  # a printed span pastes back as --layers


def test_get_writes_every_format_with_the_same_values(demo):
    n = expected_tokens(DEMO_PROMPTS[0])
    info = parsed(demo.results["get_safetensors"])
    assert info["shape"] == [4, n, 64] and info["dtype"] == "bfloat16"
    assert parsed(demo.results["get_pt"])["shape"] == [4, n, 64]
    from safetensors.torch import load_file

    full = load_file(demo.out / "r.safetensors")["resid_post"]
    assert torch.equal(full, torch.load(demo.out / "r.pt"))
    assert parsed(demo.results["get_layers"])["shape"] == [2, n, 64]
    assert torch.equal(torch.load(demo.out / "p.pt"), full[1:3])
    # the span as `dmi show` prints it (both ends included) reads the same layers
    assert parsed(demo.results["get_layers_as_shown"])["shape"] == [2, n, 64]
    assert torch.equal(torch.load(demo.out / "s.pt"), full[1:3])
    # token ids as .npy: the prompt's real tokens come first, exactly as the tokenizer made them
    assert parsed(demo.results["get_token_ids"])["dtype"] == "int64"
    import numpy as np

    ids = np.load(demo.out / "t.npy")
    prompt_ids = byte_tokenizer()(DEMO_PROMPTS[0])["input_ids"]
    assert ids.shape == (n,) and ids[: len(prompt_ids)].tolist() == prompt_ids
    assert_one_line_error(demo.results["get_npy_bf16"], 2, "numpy cannot hold torch.bfloat16", ".safetensors",
                          "--dtype float32")
    assert not (demo.out / "x.npy").exists()
    # widened on request: float32 holds every bfloat16 value exactly
    assert parsed(demo.results["get_npy_float32"])["dtype"] == "float32"
    widened = torch.from_numpy(np.load(demo.out / "f.npy"))
    assert widened.dtype == torch.float32 and torch.equal(widened, full.float())
    assert torch.equal(widened.bfloat16(), full)
    assert_one_line_error(demo.results["get_ids_as_float"], 2, "token_ids is int64: --dtype casts floating-point "
                          "hooks only")
    assert not (demo.out / "i.npy").exists()


def test_sql_answers_from_statistics_and_they_match_the_payload(demo):
    rows = parsed(demo.results["sql_norms"])
    assert [r["layer"] for r in rows] == LAYERS
    # every layer holds the same records: at least a prefill and a decode record per request and run
    assert len({r["records"] for r in rows}) == 1 and rows[0]["records"] >= 2 * 2 * len(DEMO_PROMPTS)
    # a record's squared L2 norms add up to the tensor's: the index alone gives the exact norm
    tensor = torch.load(demo.out / "r2.pt").double()
    stats = parsed(demo.results["sql_r2"])
    assert [row["layer"] for row in stats] == LAYERS
    for row in stats:
        assert row["norm"] == pytest.approx(torch.linalg.vector_norm(tensor[row["layer"]]).item(), rel=1e-6)
    count = demo.results["sql_count"]
    assert count.stdout.splitlines()[2].strip() == str(demo.first["records"] + demo.second["records"])
    assert_one_line_error(demo.results["sql_bad"], 1, "nonsense")


def test_sql_takes_values_as_params(demo):
    literal = parsed(demo.results["sql_literal"])
    assert [row["layer"] for row in literal] == [1, 2]
    assert parsed(demo.results["sql_params"]) == literal
    assert parsed(demo.results["sql_param_injection"]) == [{"n": 0}]  # a value, never SQL


def test_plot_writes_a_png_of_the_requested_size(demo):
    drawn = parsed(demo.results["plot"])
    assert png_size(demo.out / "mlp.png") == (640, 360)
    assert drawn["width"] == 640 and drawn["height"] == 360
    assert drawn["layers"] == LAYERS and drawn["n_tokens"] == expected_tokens(DEMO_PROMPTS[1])
    assert all(v > 0 for v in drawn["mean_norm_per_layer"])
    final = parsed(demo.results["plot_global"])  # a global hook: one row, labelled -1
    assert final["layers"] == [-1] and final["n_tokens"] == drawn["n_tokens"]
    assert png_size(demo.out / "final.png") == (1200, 500)
    # token ids are not activations: no norm to draw; and the image is a PNG whatever the name says
    assert_one_line_error(demo.results["plot_ids"], 2, "token_ids holds int64 ids, not activations")
    assert_one_line_error(demo.results["plot_svg"], 2, "the plot is a PNG image: name it FILE.png, not ")
    assert not (demo.out / "ids.png").exists() and not (demo.out / "plot.svg").exists()


def test_verify_a_clean_store(demo):
    report = parsed(demo.results["verify"])
    assert report["ok"] and report["problems"] == [] and report["unpublished_packs"] == []
    assert report["records_checked"] == demo.first["records"] + demo.second["records"]
    assert report["bytes_checked"] == demo.first["stored_bytes"] + demo.second["stored_bytes"]


def test_unknown_model_request_hook_and_layers(demo):
    r = demo.results
    assert_one_line_error(r["no_model"], 1, "no model 'no-such-model'", "(models: tiny-llama)")
    assert_one_line_error(r["no_request"], 1, "no request 'no-such-request'", "dmi requests tiny-llama")
    line = assert_one_line_error(r["group_as_hook"], 2, "unknown hook 'resid'", "is a group")
    assert "resid_post" in line and "attn_pattern" in line  # lists the valid hooks
    assert_one_line_error(r["hook_not_held"], 1, "holds no 'attn_pattern' records", "resid_post")
    assert_one_line_error(r["layer_not_held"], 1, "has layers [0, 1, 2, 3]", "layers=[7]")
    assert_one_line_error(r["bad_layers"], 2, "START:STOP")


def test_errors_on_the_real_stderr_are_one_line(demo):
    """Outside the batch: the process's own stderr, exit status and no traceback."""
    assert_one_line_error(dmi("requests", "no-such-model", home=demo.home), 1, "no model 'no-such-model'")


def test_a_closed_pipe_ends_quietly(demo):
    """``dmi sql ... | head``: the reader leaves early; no error line, no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dmi.cli", "sql", "SELECT number FROM system.numbers LIMIT 300000", "--json",
         "--home", str(demo.home)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(demo.home),
    )
    assert proc.stdout.read(10).startswith(b"[")
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert stderr == b""


def test_capture_then_upkeep(tmp_path):
    """``dmi capture``, then ``recover`` of a crashed writer's pack, a flipped byte found by
    ``verify``, and a deleted pack reported as missing."""
    from dmi.storage import PackStore, PackWriter, RecordKey

    home = tmp_path / "home"
    result = parsed(dmi("capture", "--model", "tiny-llama", "--prompt", "hello there", "--hooks", "resid_post",
                        "--max-new-tokens", "2", "--model-id", "t", "--json", home=home))
    assert result["model_id"] == "t" and len(result["request_ids"]) == 1
    # prefill + one decode forward, per layer; and the tokens dmi capture keeps with its tokenizer:
    # token_ids and token_text (prefill, decode), prompt_text
    assert result["records"] == len(LAYERS) * 2 + 5
    [captured] = (home / "packs").glob("*.arrow")
    with PackWriter(PackStore.local(home / "packs")) as writer:  # sealed, never published: a crash
        for layer in (0, 1):
            writer.append(RecordKey("orphan", "run-1", "req-1", "resid_post", layer, 0, 3), torch.ones(3, 8))
    [orphan] = {p.stem for p in (home / "packs").glob("*.arrow")} - {captured.stem}

    requests, before, recovered, again, models, got, target = batch(
        home,
        ["requests", "t", "--json"],
        ["verify", "--json"],
        ["recover", "--json"],
        ["recover", "--json"],
        ["models", "--json"],
        ["get", "orphan", "req-1", "resid_post", "-o", str(tmp_path / "o.pt"), "--json"],
        ["sql", "SELECT pack_id, payload_offset, payload_length, request_id, layer, start_token "
                "FROM {records} WHERE model_id = 't' AND layer = 1 AND phase = 'prefill'", "--json"],
    )
    [row] = parsed(requests)
    assert row["request_id"] == result["request_ids"][0] and row["n_tokens"] == len("hello there") + 1 + 1
    assert row["records"] == result["records"] and row["stored_bytes"] == result["stored_bytes"]
    assert parsed(before)["unpublished_packs"] == [orphan] and parsed(before)["ok"]
    assert parsed(recovered) == {"recovered": [{"pack_id": orphan, "records": 2}], "not_regular_files": []}
    assert parsed(again) == {"recovered": [], "not_regular_files": []}
    assert [m["model_id"] for m in parsed(models)] == ["orphan", "t"]
    assert parsed(got)["shape"] == [2, 3, 8] and torch.equal(torch.load(tmp_path / "o.pt"), torch.ones(2, 3, 8))

    [target] = parsed(target)
    data = bytearray(captured.read_bytes())
    data[target["payload_offset"] + target["payload_length"] // 2] ^= 0xFF
    captured.write_bytes(bytes(data))
    text = dmi("verify", home=home)
    assert_one_line_error(text, 1, "1 bad record in 1 pack")
    [line] = text.stdout.strip().splitlines()[1:]
    assert line.startswith(f"corrupt: pack {captured.stem}")
    assert f"request {target['request_id']} hook resid_post layer 1" in line and "checksum" in line
    as_json, read_bad, read_other = batch(
        home,
        ["verify", "--json"],
        ["get", "t", target["request_id"], "resid_post", "-o", str(tmp_path / "x.pt")],
        ["get", "t", target["request_id"], "resid_post", "--layers", "2", "-o", str(tmp_path / "y.pt"), "--json"],
    )
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and not report["ok"]
    [problem] = report["problems"]
    assert problem["kind"] == "corrupt" and problem["pack_id"] == captured.stem
    assert problem["key"]["layer"] == 1 and problem["key"]["start_token"] == target["start_token"]
    assert_one_line_error(read_bad, 1, "fails its checksum")
    assert parsed(read_other)["shape"][0] == 1  # the other layers still read

    captured.unlink()
    [missing] = batch(home, ["verify"])
    assert_one_line_error(missing, 1, f"{result['records']} bad records in 1 pack")  # none of its records reads
    assert missing.stdout.strip().splitlines()[1].startswith(f"missing: pack {captured.stem}")


def test_capture_refuses_unknown_hooks_and_missing_prompts(tmp_path):
    home = tmp_path / "h"
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "not-a-model").mkdir()
    unknown, no_prompts, blank, unreadable, batch_size, phases, no_model, no_config = batch(
        home,
        ["capture", "--model", "tiny-llama", "--prompt", "x", "--hooks", "resid,bogus"],
        ["capture", "--model", "tiny-llama"],
        ["capture", "--model", "tiny-llama", "--prompts-file", str(tmp_path / "blank.txt")],
        ["capture", "--model", "tiny-llama", "--prompts-file", str(tmp_path / "missing.txt")],
        ["capture", "--model", "tiny-llama", "--prompt", "x", "--batch-size", "0"],
        ["capture", "--model", "tiny-llama", "--prompt", "x", "--phases", "prefill,sideways"],
        ["capture", "--model", str(tmp_path / "nope"), "--prompt", "x"],
        ["capture", "--model", str(tmp_path / "not-a-model"), "--prompt", "x"],
    )
    line = assert_one_line_error(unknown, 2, "'bogus'")
    assert "resid_post" in line
    assert_one_line_error(no_prompts, 2, "no prompts")
    assert_one_line_error(blank, 2, "no prompts")
    assert_one_line_error(unreadable, 2, "cannot read prompts from", "missing.txt")
    assert_one_line_error(batch_size, 2, "--batch-size must be at least 1")
    assert_one_line_error(phases, 2, "sideways")
    assert_one_line_error(no_model, 2, "neither a local model directory nor a built-in model")
    # named for what it is, not for the tokenizer transformers would fail to build first
    assert_one_line_error(no_config, 2, "not-a-model is a directory but not a Hugging Face model directory "
                          "(it holds no config.json)")


def test_capture_from_a_model_directory(tmp_path):
    """A user's own model: a Hugging Face directory, loaded with ``from_pretrained``."""
    from dmi._models import load_model

    loaded = load_model("tiny-llama")
    model_dir = tmp_path / "my-model"
    loaded.model.save_pretrained(model_dir)
    loaded.tokenizer.save_pretrained(model_dir)
    (tmp_path / "prompts.txt").write_text("first prompt\n\nsecond, longer prompt\n")
    common = ["capture", "--model", str(model_dir), "--prompts-file", str(tmp_path / "prompts.txt"),
              "--max-new-tokens", "0", "--json"]
    sdpa, eager, shown = batch(
        tmp_path / "home",
        [*common, "--hooks", "attn_pattern"],
        [*common, "--hooks", "attn_pattern,logits", "--layers", "1", "--attn-implementation", "eager"],
        ["models", "--json"],
    )
    assert_one_line_error(sdpa, 2, "--attn-implementation eager")  # a flag left out: a bad argument
    result = parsed(eager)
    assert result["model_id"] == str(model_dir) and len(result["request_ids"]) == 2  # the default id: its path
    # a scoring pass: one attn_pattern record (layer 1) and one logits record per request, and the
    # tokens dmi capture keeps with the directory's tokenizer: token_ids, token_text, prompt_text
    assert result["records"] == 2 * 2 + 2 * 3
    [model] = parsed(shown)
    assert model["model_id"] == str(model_dir) and model["requests"] == 2 and model["records"] == 10


def test_locked_catalog_is_a_one_line_error(tmp_path):
    """An open store does not lock others out; a unit of catalog work held past the wait does."""
    home = tmp_path / "locked"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, dmi; s = dmi.open(home=sys.argv[1]); print(s.models(), flush=True); "
         "w = s.catalog._backend.session(); w.__enter__(); print('ready', flush=True); sys.stdin.read(); "
         "w.__exit__(None, None, None); s.close()", str(home)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "[]"
        assert holder.stdout.readline().strip() == "ready"
        proc = subprocess.run([sys.executable, "-m", "dmi.cli", "models", "--home", str(home)], capture_output=True,
                              text=True, env={**_env(home), "DMI_CATALOG_LOCK_TIMEOUT": "0.5"}, timeout=240)
        assert_one_line_error(Result(proc.returncode, proc.stdout, proc.stderr), 1, "in use by another process",
                              str(home / "catalog"))
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0
    assert dmi("models", home=home).returncode == 0  # free again once the holder is gone


def test_unreachable_clickhouse_server_is_a_one_line_error(tmp_path):
    port = free_port()  # a loopback port nobody listens on
    result = dmi("models", "--catalog", f"clickhouse://default@127.0.0.1:{port}/dmi", "--packs", str(tmp_path))
    assert_one_line_error(result, 1, f"cannot reach ClickHouse at 127.0.0.1:{port}")
