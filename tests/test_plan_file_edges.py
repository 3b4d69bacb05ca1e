"""Plan files a newcomer or an adversary might write: bytes that are not UTF-8, numbers past
64 bits, a ring larger than any address space. Each is one ``PlanError`` at its field, and
``dmi capture --plan`` turns it into one ``dmi: error:`` line, exit 2, with nothing stored."""

from __future__ import annotations

import contextlib
import io

import pytest

from dmi._plan_file import load_plan, parse_plan
from dmi.cli import main
from dmi.storage.errors import PlanError

MAX = (1 << 63) - 1


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_a_plan_that_is_not_utf8_is_a_plan_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"version: 1\nmodel: tiny-llama\nmodel_id: caf\xe9\n")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert str(info.value) == f"{path}: (file): not UTF-8 text: byte 0xe9 on line 3 cannot be read; save the plan as UTF-8"
    assert info.value.field == "(file)"


def test_capture_with_a_plan_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"version: 1\n\xff\n")
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--plan", str(path), "--prompt", "hi", "--home", str(home))
    assert (rc, out, err) == (2, "", f"dmi: error: {path}: (file): not UTF-8 text: byte 0xff on line 2 cannot "
                                     "be read; save the plan as UTF-8\n")
    assert not home.exists()


@pytest.mark.parametrize(("text", "message"), [
    ("ring: {slot_bytes: 9223372036854775808}",
     "ring.slot_bytes: must be at most 9223372036854775807 (a 64-bit integer); got 9223372036854775808"),
    ("decode_chunk_steps: 99999999999999999999",
     "decode_chunk_steps: must be at most 9223372036854775807 (a 64-bit integer); got 99999999999999999999"),
    ("schedule: {warmup: 9223372036854775808}",
     "schedule.warmup: must be at most 9223372036854775807 (a 64-bit integer); got 9223372036854775808"),
    ("ring: {slots: 99999999999999999}",
     "ring: 99999999999999999 slots of 33554432 bytes is 3355443199999999966445568 bytes of host memory, "
     "past 9223372036854775807 (a 64-bit size); lower ring.slots or ring.slot_bytes"),
])
def test_numbers_past_64_bits_are_refused_at_their_field(text, message):
    with pytest.raises(PlanError) as info:
        parse_plan(f"version: 1\n{text}\n", source="p.yaml")
    assert str(info.value) == f"p.yaml: {message}"


def test_the_largest_64_bit_numbers_are_still_read():
    plan = parse_plan(f"version: 1\nschedule: {{warmup: {MAX}}}\ndecode_chunk_steps: {MAX}\n"
                      f"ring: {{slots: 1, slot_bytes: {MAX}}}\n")
    assert (plan.schedule.warmup, plan.decode_chunk_steps, plan.ring.slots, plan.ring.slot_bytes) == (MAX, MAX, 1, MAX)


def test_a_huge_version_still_says_which_version_is_read():
    with pytest.raises(PlanError) as info:
        parse_plan("version: 99999999999999999999\n", source="p.yaml")
    assert str(info.value) == ("p.yaml: version: plan version 99999999999999999999 is not readable by this DMI, "
                               "which reads version 1")


def test_a_huge_plan_number_through_the_cli_stores_nothing(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nmodel: tiny-llama\nring: {slot_bytes: 99999999999999999999999}\n")
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--plan", str(path), "--prompt", "hi", "--home", str(home))
    assert (rc, out, err) == (2, "", f"dmi: error: {path}: ring.slot_bytes: must be at most 9223372036854775807 "
                                     "(a 64-bit integer); got 99999999999999999999999\n")
    assert not home.exists()
