"""Where `k3jax prepare-data` reads documents: text files and folders, JSONL and parquet files,
on local paths or fsspec URLs (`file://`, `memory://`, `gs://` with gcsfs installed).

A source argument expands to a sorted list of source files; each file is a sequence of items
at positions 0, 1, 2, ... (what a resumed prepare skips to):

    text      one document per file (item 0: the file's bytes)
    jsonl     one item per line (`.jsonl`, also `.jsonl.gz` / `.jsonl.zst`): the line's bytes
    parquet   one item per row: the text column's value, read a row group at a time

An item is only read here; it becomes a document or a rejected row in encode.py (in the
worker processes: JSON parsing and UTF-8 decoding are per-item work). A folder's files are
classified by suffix (TEXT_SUFFIXES are text; hidden files and others are skipped); a file
named on the command line with another suffix is read as text.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
from collections.abc import Iterator, Sequence

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from k3jax.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".c", ".h", ".html")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
PARQUET_BATCH_ROWS = 4096  # rows per pyarrow batch inside a row group

# item kinds handed to the workers (encode.py)
FILE_BYTES, JSON_LINE, VALUE = "bytes", "json", "value"


@dataclasses.dataclass(frozen=True)
class SourceFile:
  url: str    # absolute local path, or protocol://path
  kind: str   # text | jsonl | parquet

  def to_dict(self) -> dict:
    return {"url": self.url, "kind": self.kind}


def _kind(path: str, *, named: bool) -> str | None:
  name = posixpath.basename(path).lower()
  if name.endswith(JSONL_SUFFIXES):
    return "jsonl"
  if name.endswith(PARQUET_SUFFIXES):
    return "parquet"
  if name.endswith(TEXT_SUFFIXES) or named:
    return "text"
  return None


def _hidden(relative: str) -> bool:
  return any(part.startswith(".") for part in relative.split("/"))


def expand(sources: Sequence[str]) -> list[SourceFile]:
  """Every source file the arguments name, in order: each argument's files sorted by path."""
  out: list[SourceFile] = []
  for src in sources:
    url = src if "://" in src else os.path.abspath(src)
    fs, path = fsspec.core.url_to_fs(url)
    as_url = fs.unstrip_protocol if "://" in src else (lambda p: p)
    if fs.isfile(path):
      out.append(SourceFile(as_url(path), _kind(path, named=True)))
      continue
    if not fs.isdir(path):
      raise UserError(f"{src}: no such file or folder")
    found = []
    for f in sorted(fs.find(path)):
      relative = posixpath.relpath(f, path)
      kind = None if _hidden(relative) else _kind(f, named=False)
      if kind is not None:
        found.append(SourceFile(as_url(f), kind))
    if not found:
      raise UserError(f"{src}: no text, JSONL or parquet files in this folder")
    out.extend(found)
  return out


def _open(url: str, mode: str = "rb", compression: str | None = None):
  return fsspec.open(url, mode, compression=compression).open()


def check(src: SourceFile, text_field: str) -> None:
  """Refuse, before anything is written, a source no document can come from: a parquet file
  without a text column `text_field`, a JSONL file none of whose rows has it."""
  if src.kind == "parquet":
    _check_parquet(src, text_field)
  elif src.kind == "jsonl":
    _check_jsonl(src, text_field)


def _check_parquet(src: SourceFile, field: str) -> None:
  try:
    with _open(src.url) as f:
      schema = pq.ParquetFile(f).schema_arrow
  except (pa.ArrowInvalid, OSError) as e:
    raise UserError(f"{src.url}: not a parquet file ({e})") from None
  if field not in schema.names:
    raise UserError(f"{src.url}: no column {field!r} (columns: {', '.join(schema.names)}); "
                    "pass --text-field")
  kind = schema.field(field).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
          or pa.types.is_string_view(kind)):
    raise UserError(f"{src.url}: column {field!r} is {kind}, not text")


def _check_jsonl(src: SourceFile, field: str) -> None:
  rows, seen = 0, set()
  with _open(src.url, compression="infer") as f:
    for line in f:
      if not line.strip():
        continue
      rows += 1
      try:
        row = json.loads(line)
      except (ValueError, UnicodeDecodeError):
        continue
      if isinstance(row, dict):
        if isinstance(row.get(field), str):
          return
        seen.update(row)
  if rows:
    fields = ", ".join(sorted(map(str, seen))[:8]) or "none"
    raise UserError(f"{src.url}: no row of its {rows} has a string field {field!r} (fields "
                    f"seen: {fields}); pass --text-field")


def items(src: SourceFile, text_field: str, start: int = 0) -> Iterator[tuple[int, str, object]]:
  """(position, item kind, payload) of the file's items from position `start`."""
  if src.kind == "text":
    if start == 0:
      with _open(src.url) as f:
        yield 0, FILE_BYTES, f.read()
  elif src.kind == "jsonl":
    with _open(src.url, compression="infer") as f:
      for i, line in enumerate(f):
        if i >= start:
          yield i, JSON_LINE, line
  else:
    yield from _parquet_items(src, text_field, start)


def _parquet_items(src: SourceFile, field: str, start: int):
  with _open(src.url) as f:
    pf = pq.ParquetFile(f)
    first, row = 0, 0  # skip whole row groups before `start` by their metadata
    while first < pf.num_row_groups and row + pf.metadata.row_group(first).num_rows <= start:
      row += pf.metadata.row_group(first).num_rows
      first += 1
    for group in range(first, pf.num_row_groups):
      for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group],
                                   columns=[field]):
        for value in batch.column(0).to_pylist():
          if row >= start:
            yield row, VALUE, value
          row += 1


def where(src: SourceFile, position: int) -> dict:
  """An item's place as rejected.jsonl and the messages name it."""
  if src.kind == "jsonl":
    return {"source": src.url, "line": position + 1}
  if src.kind == "parquet":
    return {"source": src.url, "row": position}
  return {"source": src.url}


def describe(place: dict) -> str:
  if "line" in place:
    return f"{place['source']}:{place['line']}"
  if "row" in place:
    return f"{place['source']} row {place['row']}"
  return place["source"]
