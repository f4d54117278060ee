"""A text file as a stream of pieces of about 1 MiB, cut where the pre-tokeniser splits anyway, so that tokenising the
pieces gives the tokens of the whole file.

Details: docs/internals.md#datatextstreampy
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, NamedTuple

from trainmesh.core.logging import get_logger

log = get_logger(__name__)

READ_BYTES = 1 << 20
PIECE_CHARS = 1 << 20
MAX_PIECE_CHARS = 4 << 20
SEARCH_CHARS = 1 << 16  # look for a cut in the tail first: one scan of the whole text is the rare case
_CUT = re.compile(r"(?<=\S)\n(?=\S)")  # Python's \s holds every Unicode White_Space character, as BPE's do


class Piece(NamedTuple):
    """Text to encode: a whole document, or a part of one too big to hold at once."""

    text: str
    starts_document: bool
    source_bytes: int
    """Bytes of the input this piece stands for (the progress bar's unit)."""


def text_pieces(path: Path, stream: IO[bytes], position: Callable[[], int]) -> Iterator[Piece]:
    """The document in `stream` (the file at `path`) as pieces; `position()`: bytes of the file read so far
    (of the compressed file, when `stream` decompresses it)."""
    decoder = _Utf8(path)
    pending, first, done, rough_cuts = "", True, 0, 0
    while block := stream.read(READ_BYTES):
        pending += decoder.decode(block)
        while len(pending) >= PIECE_CHARS:
            cut, clean = _cut(pending)
            if not cut:
                break  # read on: a clean cut may come
            rough_cuts += not clean
            at = position()
            yield Piece(pending[:cut], first, at - done)
            pending, first, done = pending[cut:], False, at
    pending += decoder.decode(b"", final=True)
    if pending or first:  # an empty file is still a document (its separator alone)
        yield Piece(pending, first, position() - done)
    if rough_cuts:
        log.info(
            "%s: %d cut(s) of its text where the tokens may differ from those of the text whole (no newline "
            "between two non-space characters in %d MiB)",
            path,
            rough_cuts,
            MAX_PIECE_CHARS >> 20,
        )


def _cut(text: str) -> tuple[int, bool]:
    """Where a piece of `text` ends and whether the tokens are exact there; (0, True): not yet (read on)."""
    tail = max(0, len(text) - SEARCH_CHARS)
    clean = _last_clean_cut(text, tail) or (_last_clean_cut(text, 0) if tail else 0)
    if clean:
        return clean, True
    if len(text) < MAX_PIECE_CHARS:
        return 0, True
    return (text.rfind("\n") + 1) or len(text), False


def _last_clean_cut(text: str, start: int) -> int:
    """The position after the last newline between two non-space characters from `start` on; 0: none."""
    last = 0
    for match in _CUT.finditer(text, start):
        last = match.end()
    return last


class _Utf8:
    """Incremental UTF-8 decoding: strict until the first bad byte, which is warned about once, then with
    U+FFFD for each bad byte (as the whole file decoded with errors="replace")."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.consumed = 0

    def decode(self, block: bytes, final: bool = False) -> str:
        buffered, flags = self.decoder.getstate()
        try:
            text = self.decoder.decode(block, final)
        except UnicodeDecodeError as e:
            at = self.consumed - len(buffered) + e.start
            log.warning(
                "%s is not valid UTF-8 (first at byte %d of %d: %s); its undecodable bytes are replaced by "
                "U+FFFD. Convert it to UTF-8 to train on its exact text.",
                self.path,
                at,
                self.path.stat().st_size,
                e.reason,
            )
            self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
            self.decoder.setstate((buffered, flags))
            text = self.decoder.decode(block, final)
        self.consumed += len(block)
        return text
