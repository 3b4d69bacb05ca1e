"""Identifiers and values at the SQL boundary: the only place either enters SQL text.

Two kinds of names cross into the catalog:

* **SQL identifiers** (database and table names) are spliced into statements, so they are
  validated and then quoted with backticks. A name that could escape its quoting or
  upset a driver is refused: backtick, backslash, ``%`` (clickhouse-driver substitutes
  ``%(name)s`` in the whole statement after the fact), quotes of any kind are *allowed*
  inside backticks except the backtick itself, control / format / separator characters,
  lone surrogates, ``/``, ``.`` and ``..``, leading or trailing whitespace, and more than
  128 characters. Unusual legal names (``my-analytics-db``, ``9lives``, ``défaut``) work.
* **Value identifiers** (model ids, run ids, request ids, hooks, scopes, holders) are only
  ever *values*: they travel as driver parameters (server) or as literals rendered by
  :func:`render_literal` (chDB), never by string building. They are validated only so
  that what is stored reads back verbatim: non-empty, at most 512 characters, valid
  Unicode (no lone surrogates) and no control characters (NUL, newline, ...). Quotes,
  backticks, ``%``, ``../`` and SQL fragments are stored and read back verbatim.

Statements are written once, with pyformat placeholders (``%(name)s``); :func:`bind` is
the single place that renders parameter values into literals, and the chDB backend is its
only caller. The server backend hands the same statement and the same parameters to
clickhouse-driver, whose client-side substitution escapes them.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterator, Mapping

from dmi.storage.errors import InvalidArgumentError, InvalidIdentifierError

__all__ = [
    "MAX_IDENTIFIER_LENGTH",
    "MAX_VALUE_LENGTH",
    "validate_identifier",
    "quote_identifier",
    "validate_value_id",
    "validate_optional_value_id",
    "render_literal",
    "bind",
    "single_statement",
    "no_output_clause",
    "output_clause",
    "utf8_text",
]

MAX_IDENTIFIER_LENGTH = 128
MAX_VALUE_LENGTH = 512

_FORBIDDEN_IDENTIFIER_CHARS = {"`": "backtick", "\\": "backslash", "%": "percent sign", "/": "slash"}
_FORBIDDEN_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp", "Co", "Cn"}


def _describe(name: object) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def _require_text(text: object, what: str, limit: int) -> None:
    """A non-empty str of at most ``limit`` characters, else InvalidIdentifierError."""
    if not isinstance(text, str):
        raise InvalidIdentifierError(f"{what} must be a str, not {type(text).__name__}")
    if not text:
        raise InvalidIdentifierError(f"{what} must not be empty")
    if len(text) > limit:
        raise InvalidIdentifierError(f"{what} {_describe(text)} is {len(text)} characters long; the limit is {limit}")


def validate_identifier(name: object, what: str = "identifier") -> str:
    """Return ``name`` if it is a safe database/table name, else raise InvalidIdentifierError."""
    _require_text(name, what, MAX_IDENTIFIER_LENGTH)
    if name in (".", ".."):
        raise InvalidIdentifierError(f"{what} {name!r} is not a usable name")
    if name != name.strip():
        raise InvalidIdentifierError(f"{what} {_describe(name)} has leading or trailing whitespace")
    for char in name:
        if char in _FORBIDDEN_IDENTIFIER_CHARS:
            raise InvalidIdentifierError(
                f"{what} {_describe(name)} contains a {_FORBIDDEN_IDENTIFIER_CHARS[char]} ({char!r}), "
                "which could escape its quoting; letters, digits, '-', '_' and other printable "
                "characters are fine"
            )
        if unicodedata.category(char) in _FORBIDDEN_CATEGORIES:
            raise InvalidIdentifierError(
                f"{what} {_describe(name)} contains the control or invisible character U+{ord(char):04X}"
            )
    return name


def quote_identifier(name: str, what: str = "identifier") -> str:
    """Validate, then quote with backticks. The only way a name enters SQL text."""
    return f"`{validate_identifier(name, what)}`"


def validate_value_id(value: object, what: str = "id") -> str:
    """Return ``value`` if it can be stored and read back verbatim, else raise."""
    _require_text(value, what, MAX_VALUE_LENGTH)
    for char in value:
        category = unicodedata.category(char)
        if category == "Cc":
            raise InvalidIdentifierError(
                f"{what} {_describe(value)} contains the control character U+{ord(char):04X}"
            )
        if category == "Cs":
            raise InvalidIdentifierError(f"{what} {_describe(value)} is not valid Unicode (lone surrogate)")
    return value


def validate_optional_value_id(value: object, what: str) -> str:
    """Return ``value`` if it is ``""`` (not given) or a value :func:`validate_value_id` accepts.

    For who-did-it fields (``deleted_by``, ``recorded_by``) that default to empty: what is
    given must still be text that is stored and read back verbatim."""
    if isinstance(value, str) and not value:
        return value
    return validate_value_id(value, what)


_STRING_ESCAPES = {"\\": "\\\\", "'": "\\'"}


def _escape_char(char: str) -> str:
    if char in _STRING_ESCAPES:
        return _STRING_ESCAPES[char]
    code = ord(char)
    if code < 0x20 or code == 0x7F:
        return f"\\x{code:02X}"
    return char


def render_literal(value: object) -> str:
    """Render one parameter value as a ClickHouse literal that means exactly ``value``."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidIdentifierError(f"value {_describe(value)} is not valid Unicode") from exc
        return "'" + "".join(_escape_char(c) for c in value) + "'"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(render_literal(v) for v in value)
        if isinstance(value, list):
            return f"[{inner}]"
        if not value:
            raise InvalidArgumentError("an empty tuple has no SQL literal (an IN list needs at least one value)")
        return f"({inner})"
    raise InvalidArgumentError(
        f"cannot pass a {type(value).__name__} as a SQL parameter; use None, bool, int, float, str, "
        "or a list or tuple of them"
    )


_PERCENT = re.compile(r"%\((\w+)\)s|%%|%")


def bind(sql: str, params: Mapping[str, object] | None) -> str:
    """Substitute ``%(name)s`` placeholders with rendered literals (chDB's binding).

    With ``params``, the text follows Python's (and clickhouse-driver's) pyformat rules on
    both backends: ``%(name)s`` is a value, ``%%`` a literal ``%``, and any other ``%`` an
    error. Without ``params`` the text is left as it is. Every binding problem (a missing
    parameter, a stray ``%``, a value with no literal) is an InvalidArgumentError.
    """
    if not params:
        return sql
    if not isinstance(params, Mapping):
        raise InvalidArgumentError(f"SQL parameters must be a dict, not {type(params).__name__}")

    def replace(match: re.Match[str]) -> str:
        text, name = match.group(0), match.group(1)
        if text == "%%":
            return "%"
        if name is None:
            position = match.start()
            raise InvalidArgumentError(
                f"stray '%' at character {position} of a statement with parameters: write a literal "
                "'%' as '%%', and a value as %(name)s"
            )
        if name not in params:
            raise InvalidArgumentError(f"the statement names the parameter {name!r}, which params does not have")
        return render_literal(params[name])

    return _PERCENT.sub(replace, sql)


_QUOTES = {"'": "'", '"': '"', "`": "`"}


def _skip_quoted(sql: str, start: int) -> int:
    """Index just past the quoted string or identifier opening at ``start``."""
    quote = sql[start]
    i = start + 1
    while i < len(sql):
        char = sql[i]
        if char == "\\":
            i += 2
            continue
        if char == quote:
            if sql[i + 1 : i + 2] == quote:  # a doubled quote stands for itself
                i += 2
                continue
            return i + 1
        i += 1
    return len(sql)


def _skip_comment(sql: str, start: int) -> int:
    """Index just past the comment opening at ``start``, or ``start`` if none opens there."""
    if sql.startswith("--", start) or sql.startswith("#", start):
        end = sql.find("\n", start)
        return len(sql) if end < 0 else end + 1
    if sql.startswith("/*", start):
        end = sql.find("*/", start + 2)
        return len(sql) if end < 0 else end + 2
    return start


_WORD = re.compile(r"\w+")


def _tokens(sql: str) -> Iterator[tuple[int, str]]:
    """Each token of ``sql`` outside comments, as ``(position, text)``: a quoted string or
    identifier whole (quotes included), a word (letters, digits, ``_``), or one other
    character. Whitespace and comments are skipped."""
    i = 0
    while i < len(sql):
        skipped = _skip_comment(sql, i)
        if skipped != i:
            i = skipped
            continue
        char = sql[i]
        if char.isspace():
            i += 1
            continue
        if char in _QUOTES:
            end = _skip_quoted(sql, i)
        else:
            word = _WORD.match(sql, i)
            end = word.end() if word else i + 1
        yield i, sql[i:end]
        i = end


def single_statement(sql: str) -> str:
    """Return ``sql`` if it holds one statement (a trailing ``;`` is fine), else raise.

    Semicolons inside strings, quoted identifiers and comments do not count. Used for user
    SQL (:meth:`dmi.catalog.Catalog.sql`): chDB would otherwise run every statement and
    return only the last result, the server would refuse with a syntax error. Text with no
    statement at all (empty, blank, only comments or ``;``) is refused too: chDB answered it
    with an empty table, as if a query had matched nothing, the server with a syntax error.
    """
    end_of_first, statement = None, False
    for position, token in _tokens(sql):
        if token == ";":
            end_of_first = position if end_of_first is None else end_of_first
        elif end_of_first is not None:
            raise InvalidArgumentError(
                "one statement per call: the text holds a second statement after the ';' at character "
                f"{end_of_first}; run each statement in its own call"
            )
        else:
            statement = True
    if not statement:
        raise InvalidArgumentError(
            f"one statement per call: the text {_describe(sql)} holds no statement (it is empty, blank, "
            "or only comments and ';'); pass the query to run"
        )
    return sql


def _is_name(token: str) -> bool:
    """Whether ``token`` is a bare word starting with a letter or ``_``, or a quoted identifier."""
    return token[0] in '"`' or token[0].isalpha() or token[0] == "_"


def no_output_clause(sql: str) -> str:
    """Return ``sql`` if it has neither ``INTO OUTFILE`` nor a ``FORMAT`` clause (see
    :func:`output_clause`), else raise.

    User SQL must only read and must answer in the Arrow format DMI reads back. chDB runs
    ``INTO OUTFILE`` even under ``readonly=1``, so it would write (or ``TRUNCATE``) any file
    the process may write, a sealed pack included; ``FORMAT`` replaces the Arrow result
    with text DMI cannot read.
    """
    clause = output_clause(sql)
    if clause == "INTO OUTFILE":
        raise InvalidArgumentError(
            "sql() is read-only: INTO OUTFILE is refused (chDB would write the file even under "
            "readonly=1); take the returned Arrow table and write it yourself"
        )
    if clause is not None:
        raise InvalidArgumentError(
            f"sql() returns an Arrow table: a FORMAT clause ({clause}) is refused; "
            "convert the returned table instead (table.to_pandas(), pyarrow.csv.write_csv, ...)"
        )
    return sql


#: Keywords that follow an expression (a clause, an operator, a sort order, an alias's ``AS``).
#: After ``format`` they make it a column or alias (``SELECT format FROM t``, ``WHERE format IN
#: (...)``), never a FORMAT clause: no ClickHouse output format has one of these names
#: (``tests/test_where_format_column.py`` checks them against ``system.formats``).
_KEYWORDS_AFTER_AN_EXPRESSION = frozenset({
    "FROM", "WHERE", "PREWHERE", "GROUP", "ORDER", "HAVING", "LIMIT", "OFFSET", "SETTINGS", "UNION",
    "EXCEPT", "INTERSECT", "JOIN", "INNER", "LEFT", "RIGHT", "FULL", "CROSS", "ARRAY", "GLOBAL", "ON",
    "USING", "WINDOW", "QUALIFY", "AND", "OR", "NOT", "IN", "IS", "LIKE", "ILIKE", "BETWEEN", "AS", "ASC",
    "DESC", "NULLS", "COLLATE", "THEN", "ELSE", "END", "WHEN",
})


def output_clause(sql: str) -> str | None:
    """The first output clause of ``sql``, at any depth (a subquery's too): ``"INTO OUTFILE"``,
    ``"FORMAT <name>"``, or ``None``. Keywords count only outside strings, quoted identifiers
    and comments; ``format(...)`` (the function) and a column or alias named ``format`` (after
    ``AS`` or ``.``, or followed by a keyword such as ``FROM``, ``AND``, ``IN``) are no clause."""
    tokens = [token for _, token in _tokens(sql)]
    for i, token in enumerate(tokens):
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        previous = tokens[i - 1].upper() if i else ""
        if token.upper() == "INTO" and following.upper() == "OUTFILE":
            return "INTO OUTFILE"
        if token.upper() == "FORMAT" and _is_format_name(following) and previous not in ("AS", "."):
            return f"FORMAT {following}"
    return None


def _is_format_name(token: str) -> bool:
    """Whether ``token``, after ``FORMAT``, names an output format: a name that is not a
    keyword which follows an expression (those make ``format`` a column)."""
    return bool(token) and _is_name(token) and token.upper() not in _KEYWORDS_AFTER_AN_EXPRESSION


def utf8_text(text: str, what: str) -> str:
    """Return ``text`` if it encodes as UTF-8 (no lone surrogates), else InvalidArgumentError:
    SQL text reaches ClickHouse as UTF-8, and the drivers refuse such text with their own errors."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{what} is not valid Unicode (a lone surrogate at character {exc.start})"
        ) from exc
    return text
