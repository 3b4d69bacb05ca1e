"""No traceback from any ``dmi`` command on any user error.

Every subcommand is driven with bad arguments (paths that do not exist, malformed or
out-of-range layers, unknown models, requests, runs and hooks, unwritable outputs, bad
numbers) against a real store holding one small capture. Each must end with exactly one
``dmi: error: ...`` line on stderr, no ``Traceback``, and a non-zero exit status.

The commands run in one subprocess through ``dmi.cli.main`` (a process per command would
cost seconds each); an exception escaping ``main`` is recorded with its traceback, so it
fails the test instead of the batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli import _BATCH, _env, dmi, parsed

pytestmark = pytest.mark.slow


def _bad_commands(run_id: str, request_id: str, out: Path, prompts: Path) -> dict[str, list[str]]:
    """Each case: a name and an argv that is wrong in exactly one way. ``missing`` lies under
    a regular file, so no directory can be made there, whoever runs the test (root too)."""
    r = request_id
    missing = str(prompts / "sub")
    cap = ["capture", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "1"]
    return {
        "demo_plot_dir": ["demo", "--plot", f"{missing}/demo.png"],
        "capture_model_dir": ["capture", "--model", f"{missing}/model", "--prompt", "hi"],
        "capture_no_prompt": ["capture", "--model", "tiny-llama"],
        "capture_prompts_file": ["capture", "--model", "tiny-llama", "--prompts-file", f"{missing}/p.txt"],
        "capture_prompts_empty": ["capture", "--model", "tiny-llama", "--prompts-file", str(prompts)],
        "capture_layers_past": [*cap, "--layers", "0:99"],
        "capture_layers_text": [*cap, "--layers", "x"],
        "capture_layers_empty": [*cap, "--layers", "3:1"],
        "capture_hook": [*cap, "--hooks", "no_such_hook"],
        "capture_phase": [*cap, "--phases", "sideways"],
        "capture_tokens_negative": [*cap, "--max-new-tokens", "-1"],
        "capture_tokens_text": [*cap, "--max-new-tokens", "many"],
        "capture_batch_zero": [*cap, "--batch-size", "0"],
        "capture_step_stride_zero": [*cap, "--step-stride", "0"],
        "capture_request_stride_zero": [*cap, "--request-stride", "0"],
        "capture_warmup_negative": [*cap, "--warmup", "-1"],
        "capture_model_id": [*cap, "--model-id", "bad\nid"],
        "capture_attn": ["capture", "--model", "tiny-llama", "--prompt", "hi", "--attn-implementation", "sdpa"],
        "models_catalog": ["models", "--catalog", "nosuch://catalog"],
        "models_json_flag": ["models", "--jsn"],
        "requests_model": ["requests", "no-such-model"],
        "requests_run": ["requests", "tiny-llama", "--run", "no-such-run"],
        "show_request": ["show", "tiny-llama", "no-such-request"],
        "show_run": ["show", "tiny-llama", r, "--run", "no-such-run"],
        "get_output_dir": ["get", "tiny-llama", r, "resid_post", "-o", f"{missing}/x.pt"],
        "get_output_dir_safetensors": ["get", "tiny-llama", r, "resid_post", "-o", f"{missing}/x.safetensors"],
        "get_output_dir_npy": ["get", "tiny-llama", r, "token_ids", "-o", f"{missing}/x.npy"],
        "get_output_is_dir": ["get", "tiny-llama", r, "resid_post", "-o", str(out)],
        "get_output_ext": ["get", "tiny-llama", r, "resid_post", "-o", str(out / "x.txt")],
        "get_layers_past": ["get", "tiny-llama", r, "resid_post", "--layers", "2:9", "-o", str(out / "x.pt")],
        "get_layers_text": ["get", "tiny-llama", r, "resid_post", "--layers", "a:b", "-o", str(out / "x.pt")],
        "get_hook": ["get", "tiny-llama", r, "no_such_hook", "-o", str(out / "x.pt")],
        "get_shard_rank": ["get", "tiny-llama", r, "resid_post", "--shard-rank", "5", "-o", str(out / "x.pt")],
        "get_shard_rank_text": ["get", "tiny-llama", r, "resid_post", "--shard-rank", "one", "-o", str(out / "x.pt")],
        "get_model": ["get", "no-such-model", r, "resid_post", "-o", str(out / "x.pt")],
        "get_no_output": ["get", "tiny-llama", r, "resid_post"],
        "sql_bad": ["sql", "SELECT nonsense FROM {records}"],
        "verify_model": ["verify", "--model-id", "no-such-model"],
        "recover_catalog": ["recover", "--catalog", "clickhouse://"],
        "plot_output_dir": ["plot", "tiny-llama", r, "-o", f"{missing}/x.png"],
        "plot_size_text": ["plot", "tiny-llama", r, "--size", "big", "-o", str(out / "x.png")],
        "plot_size_zero": ["plot", "tiny-llama", r, "--size", "0x0", "-o", str(out / "x.png")],
        "plot_hook": ["plot", "tiny-llama", r, "--hook", "no_such_hook", "-o", str(out / "x.png")],
        "plot_layers": ["plot", "tiny-llama", r, "--layers", "9", "-o", str(out / "x.png")],
        "unknown_command": ["frobnicate"],
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    home = tmp_path_factory.mktemp("dmi-home")
    out = tmp_path_factory.mktemp("dmi-out")
    prompts = out / "empty.txt"
    prompts.write_text("\n\n")
    captured = parsed(dmi("capture", "--model", "tiny-llama", "--prompt", "hello", "--max-new-tokens", "2",
                          "--hooks", "resid_post,token_ids", "--json", home=home))
    commands = _bad_commands(captured["run_id"], captured["request_ids"][0], out, prompts)
    argvs = [[*argv, "--home", str(home)] for argv in commands.values()]
    proc = subprocess.run([sys.executable, "-c", _BATCH], input=json.dumps(argvs), capture_output=True,
                          text=True, env=_env(home), timeout=600)
    assert proc.returncode == 0, proc.stderr
    return dict(zip(commands, json.loads(proc.stdout)))


CASES = list(_bad_commands("run", "req", Path("/out"), Path("/p")))


@pytest.mark.parametrize("case", CASES)
def test_a_bad_argument_is_one_error_line(results, case):
    result = results[case]
    assert "Traceback" not in result["stderr"], result["stderr"]
    assert result["rc"] in (1, 2), result
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dmi: error: "), result["stderr"]
