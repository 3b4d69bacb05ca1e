"""A request's token strings and prompt text, read back (``Store.tokens``).

Capture keeps them as records of their own when it knows the tokenizer (``token_text``
beside each ``token_ids`` record, ``prompt_text`` once per request; the format is in
``storage/_strings.py``). Here they are read back, in token order, with the ids and the
phase of every position, without torch: ``dmi show`` prints them in well under a second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dmi._values import PhaseSpan, _AsDict, decode_start
from dmi.storage import decode_strings
from dmi.storage.errors import PackCorruptError
from dmi.storage.records import PROMPT_TEXT, TOKEN_TEXT, RecordEntry

__all__ = ["RequestTokens", "read_tokens", "display_token", "token_lines", "SHOWN_TOKENS", "SHOWN_PROMPT_CHARS"]


@dataclass(frozen=True, slots=True)
class RequestTokens(_AsDict):
    """One request's tokens as text: what ``Store.tokens`` returns.

    ``tokens[i]`` is ``tokenizer.convert_ids_to_tokens`` of ``token_ids[i]``, the token at
    position ``positions[i]`` of the request (``None`` for an id the tokenizer has no string
    for); ``phases[i]`` says whether the model saw it in the ``"prefill"``, a ``"decode"``
    step or a scoring ``"forward"``. The positions are those capture stored (the prompt's
    real tokens, then one per captured decode step), so they line up with a read's token
    axis. ``prompt_text``: the captured prompt ids decoded (special tokens skipped): the
    whole prompt, or the part a schedule's ``last_tokens``/``positions`` keeps; ``None`` when
    the prefill was not captured (e.g. a decode-only schedule).
    """

    model_id: str
    run_id: str
    request_id: str
    prompt_text: str | None
    positions: tuple[int, ...]
    token_ids: tuple[int, ...]
    tokens: tuple[str | None, ...]
    phases: tuple[str, ...]

    @property
    def spans(self) -> tuple[PhaseSpan, ...]:
        """The phases as spans of indices into ``tokens`` (as ``RequestContents.phases``)."""
        spans: list[PhaseSpan] = []
        for i, phase in enumerate(self.phases):
            if spans and spans[-1].phase == phase:
                spans[-1] = PhaseSpan(phase, spans[-1].start, i + 1)
            else:
                spans.append(PhaseSpan(phase, i, i + 1))
        return tuple(spans)

    @property
    def decode_start(self) -> int | None:
        """The index in ``tokens`` of the first decode token; ``None`` without decode steps."""
        return decode_start(self.spans)

    def at(self, position: int) -> str | None:
        """The string of the token at request position ``position``. Raises ``KeyError``
        when that position was not captured."""
        try:
            return self.tokens[self.positions.index(position)]
        except ValueError:
            raise KeyError(f"position {position} was not captured (positions "
                           f"{self.positions[0]}-{self.positions[-1]})" if self.positions else
                           f"position {position}: no tokens were captured") from None


def read_tokens(entries: list[RecordEntry], read: Callable[[list[RecordEntry]], list[Any]], *,
                model_id: str, run_id: str, request_id: str) -> RequestTokens | None:
    """The tokens of one request from its ``token_ids``/``token_text``/``prompt_text``
    records (of one run); ``None`` when it holds no ``token_text`` (no tokenizer at capture).
    ``read`` gives the entries' payloads: tensors, or their decoded bytes (``uint8`` arrays,
    :func:`dmi.reader.read_raw_records`). Raises ``PackCorruptError`` when the strings do
    not line up with the ids."""
    rank = min((e.meta.key.shard_rank for e in entries), default=0)  # tensor-parallel ranks hold copies
    by_hook: dict[str, list[RecordEntry]] = {}
    for e in sorted(entries, key=lambda e: e.meta.key.start_token):
        if e.meta.key.shard_rank == rank:
            by_hook.setdefault(e.meta.key.hook, []).append(e)
    texts = by_hook.get(TOKEN_TEXT, [])
    if not texts:
        return None
    ids = by_hook.get("token_ids", [])
    prompts = by_hook.get(PROMPT_TEXT, [])
    if [_span(e) for e in ids] != [_span(e) for e in texts]:
        raise PackCorruptError(f"request {request_id!r}: its token strings cover tokens {[_span(e) for e in texts]} "
                               f"but its token ids {[_span(e) for e in ids]}")
    payloads = read([*ids, *texts, *prompts])
    positions, token_ids, tokens, phases = [], [], [], []
    for entry, id_payload, text in zip(ids, payloads, payloads[len(ids):]):
        key = entry.meta.key
        strings = decode_strings(text, key.describe())
        if len(strings) != key.n_tokens:
            raise PackCorruptError(f"{key.describe()}: {len(strings)} token strings for {key.n_tokens} tokens")
        positions.extend(range(key.start_token, key.start_token + key.n_tokens))
        token_ids.extend(np.asarray(id_payload).view(entry.meta.dtype).reshape(-1).tolist())
        tokens.extend(strings)
        phases.extend([key.phase] * key.n_tokens)
    prompt = decode_strings(payloads[-1], prompts[-1].meta.key.describe())[0] if prompts else None
    return RequestTokens(model_id, run_id, request_id, prompt, tuple(positions), tuple(token_ids), tuple(tokens),
                         tuple(phases))


def _span(entry: RecordEntry) -> tuple[int, int]:
    return entry.meta.key.start_token, entry.meta.key.n_tokens


def display_token(token: str | None) -> str:
    """A token as one printable label: control characters and whitespace other than a plain
    space escaped (``'\\n'``), ``None`` shown as ``'<?>'``."""
    if token is None:
        return "<?>"
    return "".join(c if c == " " or c.isprintable() else repr(c)[1:-1] for c in token)


SHOWN_TOKENS = 48
"""``dmi show`` prints at most this many token strings per phase: the first ones and the last few."""
SHOWN_PROMPT_CHARS = 300
"""``dmi show`` cuts the prompt text after this many characters (saying how many more there are)."""


def token_lines(tokens: RequestTokens, width: int = 100) -> list[str]:
    """What ``dmi show`` prints: the prompt text, then each phase's token strings (quoted,
    escaped, cut to ``SHOWN_TOKENS`` per phase), wrapped to ``width`` columns."""
    import textwrap

    lines = []
    if tokens.prompt_text is not None:
        prompt = tokens.prompt_text
        cut = len(prompt) - SHOWN_PROMPT_CHARS
        text = repr(prompt[:SHOWN_PROMPT_CHARS]) + (f" ... ({cut} more characters)" if cut > 0 else "")
        lines += textwrap.wrap("prompt text: " + text, width, subsequent_indent="  ")
    for span in tokens.spans:
        quoted = ["<?>" if t is None else repr(t) for t in tokens.tokens[span.start:span.stop]]
        if len(quoted) > SHOWN_TOKENS:
            tail = SHOWN_TOKENS // 6
            quoted = [*quoted[:SHOWN_TOKENS - tail], f"... ({len(quoted) - SHOWN_TOKENS} more) ...", *quoted[-tail:]]
        first, last = tokens.positions[span.start], tokens.positions[span.stop - 1]
        lines += _wrap(f"{span.phase} tokens {first}-{last}:", quoted, width)
    return lines


def _wrap(head: str, pieces: list[str], width: int) -> list[str]:
    """``head`` then ``pieces`` separated by spaces, over lines of ``width`` columns (a piece is
    never split: it may hold spaces of its own); continuation lines indented by two."""
    lines, line = [], head
    for piece in pieces:
        if len(line) + 1 + len(piece) > width and line.strip():
            lines.append(line)
            line = "  " + piece
        else:
            line += " " + piece
    return [*lines, line]
