"""Dataset records: read JSONL/CSV/Parquet rows from any fsspec URL, validate them into
typed records, and turn prompts into token ids for generation.

Every problem a user can fix in their data raises `DataError` with a one-line message
that names the file, the line (1-based; for CSV the physical file line counting the
header, for Parquet the 1-based row number) and the fix, because the CLI prints only
that line.
"""

from __future__ import annotations

import csv
import hashlib
import json
import lzma
import re
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

import fsspec
from fsspec.utils import infer_compression
from rlflow.engine.data.conversations import (
    Prompt,
    parse_answer,
    parse_prompt,
    parse_tools,
    parse_turns,
    require_str,
    split_last_assistant,
)
from rlflow.engine.errors import DataError
from rlflow.engine.storage.errors import STORAGE_ERRORS, describe_storage_error

# Extension (after any compression suffix) -> reader kind. ".json" is read as JSON Lines
# because whole-document JSON arrays cannot be streamed or reported line by line.
_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}
_OVERFLOW_POLICIES = ("truncate", "drop")
_HASH_CHUNK = 1 << 20
_OPTIONS = "data.storage_options"  # the config key that holds the data files' credentials
# What a corrupt or truncated compressed file raises while it is read (gzip: OSError or EOFError).
_DECOMPRESS_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)

_SFT_HINT = "SFT rows need 'prompt' and 'response', or 'messages'"
_PREF_HINT = "preference rows need 'prompt', 'chosen' and 'rejected'"
_PROMPT_HINT = "prompt rows need 'prompt': a string or a list of {role, content} messages"
_LONE_CR = re.compile(r"(?<=\r)(?!\n|$)")  # split after a "\r" that does not end the text or start "\r\n"

@dataclass(frozen=True)
class SFTExample:
    """One supervised example: a prompt string or the chat turns before the final
    assistant turn, and the response the model should learn to produce."""

    prompt: Prompt
    response: str
    tools: tuple[dict, ...] = ()  # function schemas the chat template shows (the row's `tools`)
    # A `messages` row: the assistant turns in `prompt` are demonstrations too, which SFT learns
    # with sft.assistant_turns: all. A `prompt` + `response` row's prompt is context only.
    whole_conversation: bool = False


@dataclass(frozen=True)
class PreferencePair:
    """One reward-model example: the same prompt (a string or the conversation so far) with a
    preferred and a rejected answer (the assistant turn that follows)."""

    prompt: Prompt
    chosen: str
    rejected: str


@dataclass(frozen=True)
class PromptRecord:
    """One RL prompt (a string or the conversation so far); `fields` holds every other column
    (e.g. a reference answer) so scoring functions can use it without the loader knowing their names."""

    prompt: Prompt
    fields: dict


@dataclass(frozen=True)
class EncodedPrompts:
    """Token ids of the prompts that survived the length policy.

    `kept_indices[i]` is the position in the input list that `token_ids[i]` came from,
    so callers can keep prompts aligned with their `PromptRecord.fields`.
    """

    token_ids: list[list[int]]
    kept_indices: list[int]
    n_truncated: int
    n_dropped: int


# --------------------------------------------------------------------------- reading


def _one_line(text: object) -> str:
    """Collapse whitespace so library error text cannot break the one-line CLI message."""
    return " ".join(str(text).split())


def _detect_format(url: str) -> tuple[str, str | None]:
    """Return (reader kind, fsspec compression) from the URL's extension."""
    # A query string (signed HTTP URLs) is not part of the file name.
    path = url.split("?", 1)[0] if "://" in url else url
    lower = path.lower()
    compression = infer_compression(lower)
    if compression is not None:
        lower = lower.rsplit(".", 1)[0]
    for ext, kind in _FORMATS.items():
        # Parquet compresses internally and needs random access, so no outer codec.
        if lower.endswith(ext) and not (kind == "parquet" and compression):
            return kind, compression
    supported = ", ".join(_FORMATS)
    raise DataError(
        f"unsupported data file extension: {url}; use one of {supported} "
        "(JSONL and CSV may also be compressed, e.g. .jsonl.gz)"
    )


def _unreadable(url: str, exc: BaseException, storage_options: dict | None) -> DataError:
    """A missing file, bucket or backend, refused credentials, a bad option: one line, no secret."""
    if isinstance(exc, (FileNotFoundError, IsADirectoryError)) and "bucket" not in str(exc).lower():
        return DataError(f"data file not found: {url}; check the path in the config")
    return DataError(f"cannot read data file {url}: {describe_storage_error(url, exc, storage_options, _OPTIONS)}")


@contextmanager
def _open(url: str, storage_options: dict | None, compression: str | None) -> Iterator[BinaryIO]:
    """Open `url` for binary reading, turning storage failures (while opening or reading) into
    a DataError; a DataError raised by the reader passes through."""
    try:
        f = fsspec.open(url, mode="rb", compression=compression, **(storage_options or {})).open()
    except STORAGE_ERRORS as exc:
        raise _unreadable(url, exc, storage_options) from None
    try:
        yield f
    except _DECOMPRESS_ERRORS as exc:  # OSError too: a network drop mid-file
        reason = describe_storage_error(url, exc, storage_options, _OPTIONS)
        hint = f"is it really {compression}-compressed? re-compress it" if compression else "check the file"
        raise DataError(f"{url}: reading failed ({reason}); {hint} and rerun") from None
    finally:
        f.close()  # also closes the raw handle underneath a decompressor


def _decode(url: str, lineno: int, raw: bytes) -> str:
    """One physical line as text; a bad byte is reported by line and byte offset, because
    editors show both and a decoder's offset into a read buffer means nothing to the user."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{url}:{lineno}: byte {e.start + 1} of the line (0x{raw[e.start]:02x}) is not valid UTF-8; "
            "re-save the file as UTF-8"
        ) from None
    return text.lstrip("\ufeff") if lineno == 1 else text  # editors on Windows prepend a byte-order mark


def _iter_jsonl(url: str, f: BinaryIO) -> Iterator[tuple[int, dict]]:
    """Yield (line, object) for each non-blank line; blank lines are allowed as spacing."""
    for lineno, raw in enumerate(f, start=1):
        text = _decode(url, lineno, raw)
        if not text.strip():
            continue
        try:
            row = json.loads(text.rstrip("\r\n"))  # keeps e.colno on this line
        except json.JSONDecodeError as e:
            hint = "write one complete JSON object per line"
            if lineno == 1 and text.lstrip().startswith("["):
                hint = "this looks like a JSON array; JSONL needs one {...} object per line"
            raise DataError(f"{url}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); {hint}") from None
        except (ValueError, RecursionError) as e:  # a 5000-digit number, nesting deeper than Python's stack
            raise DataError(f"{url}:{lineno}: unreadable JSON ({_one_line(e)[:120]}); simplify this line") from None
        if not isinstance(row, dict):
            raise DataError(
                f"{url}:{lineno}: expected a JSON object, got {type(row).__name__}; "
                'write one {"field": value, ...} object per line'
            )
        yield lineno, row


def _csv_lines(url: str, f: BinaryIO) -> Iterator[str]:
    """Physical lines decoded one at a time, terminators kept (what csv expects of newline="").

    A lone "\r" ends a line too, as in universal-newline mode; UTF-8 never has a 0x0A or 0x0D
    byte inside a character, so splitting before decoding is safe."""
    lineno = 0
    for raw in f:
        text = _decode(url, lineno + 1, raw)
        for piece in _LONE_CR.split(text):
            lineno += 1
            yield piece


def _iter_csv(url: str, f: BinaryIO) -> Iterator[tuple[int, dict]]:
    """Yield (line, row) where line is the physical line a record starts on, so quoted
    multi-line cells still point the user at the right place."""
    reader = csv.reader(_csv_lines(url, f))
    header: list[str] | None = None
    end = 0  # last physical line consumed so far
    while True:
        start = end + 1
        try:
            values = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise DataError(f"{url}:{start}: malformed CSV ({_one_line(e)}); check quoting") from None
        end = reader.line_num
        if not values:
            continue
        if header is None:
            header = _check_header(url, start, values)
            continue
        if len(values) != len(header):
            hint = "quote values that contain commas or newlines"
            if end > start:  # the record ran over several lines: most likely a quote never closed
                hint = f"its quoted value runs on to line {end}: check for a missing closing quote"
            raise DataError(f"{url}:{start}: row has {len(values)} fields but the header has {len(header)}; {hint}")
        yield start, dict(zip(header, values))


def _check_header(url: str, lineno: int, header: list[str]) -> list[str]:
    """Reject duplicate column names, which would silently overwrite each other."""
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise DataError(f"{url}:{lineno}: duplicate column {name!r} in the CSV header; rename one of them")
        seen.add(name)
    return header


def _read_parquet(url: str, f: BinaryIO) -> list[tuple[int, dict]]:
    """Read all rows; the "line" is the 1-based row number."""
    import pyarrow as pa  # heavy import, only needed for Parquet
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(f)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # random bytes reach every Arrow error type
        reason = _one_line(e)[:200]
        raise DataError(f"{url} is not a valid Parquet file ({reason}); re-export it or use JSONL/CSV") from None
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:  # a string column whose bytes are not UTF-8: Arrow decodes them only here
        raise DataError(_non_utf8_cell(url, table)) from None
    except pa.ArrowException as e:
        raise DataError(f"{url}: a column cannot be read ({_one_line(e)[:200]}); re-export the file") from None
    return list(enumerate(rows, start=1))


def _non_utf8_cell(url: str, table: Any) -> str:
    """Name the first column (and row) whose text is not UTF-8; searched only once reading failed."""
    fix = "re-export the file with UTF-8 text"
    for position in range(table.num_columns):
        try:
            name = repr(table.schema.field(position).name)
        except UnicodeDecodeError:
            return f"{url}: the name of column {position + 1} is not valid UTF-8; {fix}"
        column = table.column(position)
        for index in range(len(column)):
            try:
                column[index].as_py()
            except UnicodeDecodeError as e:
                where = f"{url}:{index + 1}: column {name}"
                return f"{where} holds bytes that are not valid UTF-8 (byte {e.start + 1}); {fix}"
    return f"{url}: a text column holds bytes that are not valid UTF-8; {fix}"


def read_rows(url: str, storage_options: dict | None = None) -> list[tuple[int, dict]]:
    """Read every record of a JSONL, CSV or Parquet file as (line number, row dict).

    The format comes from the extension; `.gz` and other fsspec codecs are inferred for
    JSONL and CSV. CSV values are always strings.
    """
    kind, compression = _detect_format(url)
    with _open(url, storage_options, compression) as f:
        if kind == "jsonl":
            rows = list(_iter_jsonl(url, f))
        elif kind == "csv":
            rows = list(_iter_csv(url, f))
        else:
            rows = _read_parquet(url, f)
    if not rows:
        raise DataError(f"{url} contains no records; add at least one row or fix the path")
    return rows


# --------------------------------------------------------------------------- records


def _parse_messages(url: str, lineno: int, messages: Any) -> SFTExample:
    """Split a chat transcript into the prompt turns and the final assistant response."""
    where = f"{url}:{lineno}: field 'messages'"
    shape = "a list of at least 2 {role, content} objects ending with the assistant turn"
    history, response = split_last_assistant(where, parse_turns(where, messages, 2, shape))
    return SFTExample(prompt=history, response=response, whole_conversation=True)


def _implicit_prompt_pair(url: str, lineno: int, row: dict) -> PreferencePair:
    """A pair given as two whole conversations that share every turn but the last assistant one."""
    shape = "a list of at least 2 {role, content} objects ending with the assistant turn"
    split = {}
    for key in ("chosen", "rejected"):
        where = f"{url}:{lineno}: field {key!r}"
        split[key] = split_last_assistant(where, parse_turns(where, row[key], 2, shape))
    if split["chosen"][0] != split["rejected"][0]:
        raise DataError(
            f"{url}:{lineno}: 'chosen' and 'rejected' differ before their last assistant turn; "
            "without a 'prompt' field both must continue the same conversation"
        )
    return PreferencePair(prompt=split["chosen"][0], chosen=split["chosen"][1], rejected=split["rejected"][1])


def load_sft_examples(url: str, storage_options: dict | None = None) -> list[SFTExample]:
    """Load SFT examples from rows with `prompt`+`response` strings or a `messages` list, each with
    optional `tools` (function schemas, rendered into the prompt as an episode's prompt is)."""
    examples = []
    for lineno, row in read_rows(url, storage_options):
        if row.get("messages") is not None:
            example = _parse_messages(url, lineno, row["messages"])
        else:
            prompt = parse_prompt(url, lineno, row, _SFT_HINT)
            example = SFTExample(prompt=prompt, response=require_str(url, lineno, row, "response", _SFT_HINT))
        tools = parse_tools(url, lineno, row.get("tools"))
        examples.append(SFTExample(example.prompt, example.response, tools, example.whole_conversation))
    return examples


def load_preference_pairs(url: str, storage_options: dict | None = None) -> list[PreferencePair]:
    """Load reward-model pairs: `prompt` (a string or the conversation so far) with `chosen` and
    `rejected` answers (strings or one assistant message each), or, without `prompt`, `chosen` and
    `rejected` as two whole conversations that differ only in their last assistant turn."""
    pairs = []
    for lineno, row in read_rows(url, storage_options):
        if row.get("prompt") is None and isinstance(row.get("chosen"), list) and isinstance(row.get("rejected"), list):
            pairs.append(_implicit_prompt_pair(url, lineno, row))
            continue
        prompt = parse_prompt(url, lineno, row, _PREF_HINT)
        chosen, rejected = (parse_answer(url, lineno, row, key, _PREF_HINT) for key in ("chosen", "rejected"))
        pairs.append(PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected))
    return pairs


def load_prompts(url: str, storage_options: dict | None = None) -> list[PromptRecord]:
    """Load RL prompts (a string, or the conversation so far as {role, content} turns); every column
    except `prompt` is kept in `fields` for scoring."""
    records = []
    for lineno, row in read_rows(url, storage_options):
        prompt = parse_prompt(url, lineno, row, _PROMPT_HINT)
        fields = {k: v for k, v in row.items() if k != "prompt"}
        records.append(PromptRecord(prompt=prompt, fields=fields))
    return records


# --------------------------------------------------------------------------- tokens


def format_prompt(tokenizer: Any, prompt: Prompt, tools: Sequence[dict] = ()) -> str:
    """Render a prompt as the text the model should continue.

    With a chat template the prompt goes through it with the generation prompt appended
    (a plain string becomes one user turn) and the `tools` schemas as a tool-using episode shows
    them; without one, strings pass through unchanged and chat turns are joined by newlines.
    """
    from rlflow.engine.envs.chat import render_prompt

    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if getattr(tokenizer, "chat_template", None):
        return render_prompt(tokenizer, messages, tools)
    if tools:
        raise DataError(
            "data.sft rows with 'tools' need a chat template: "
            "set data.chat_template: auto, with a tokenizer that has one"
        )
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in messages)


def encode_prompts(tokenizer: Any, prompts: list[str], max_prompt_tokens: int, overflow: str) -> EncodedPrompts:
    """Tokenize already-formatted prompts, then apply_overflow. No special tokens are added:
    templates carry their own."""
    all_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"] if prompts else []
    return apply_overflow(all_ids, max_prompt_tokens, overflow)


def apply_overflow(all_ids: Sequence[Sequence[int]], max_prompt_tokens: int, overflow: str) -> EncodedPrompts:
    """The overflow policy on prompts already tokenized (an episode's first messages among them).

    "truncate" keeps the last `max_prompt_tokens` tokens, because the end of a prompt
    (the question, the generation cue) matters most for what the model says next;
    "drop" leaves the prompt out.
    """
    if overflow not in _OVERFLOW_POLICIES:
        valid = ", ".join(_OVERFLOW_POLICIES)
        raise ValueError(f"unknown overflow policy {overflow!r}; valid: {valid}")
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    token_ids, kept, n_truncated, n_dropped = [], [], 0, 0
    for index, ids in enumerate(all_ids):
        ids = list(ids)
        if len(ids) > max_prompt_tokens:
            if overflow == "drop":
                n_dropped += 1
                continue
            ids = ids[-max_prompt_tokens:]
            n_truncated += 1
        token_ids.append(ids)
        kept.append(index)
    return EncodedPrompts(token_ids=token_ids, kept_indices=kept, n_truncated=n_truncated, n_dropped=n_dropped)


# --------------------------------------------------------------------------- identity


def fingerprint_file(url: str, storage_options: dict | None = None) -> str:
    """SHA-256 hex digest of the file's raw bytes, streamed so large files fit in memory."""
    digest = hashlib.sha256()
    with _open(url, storage_options, compression=None) as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
