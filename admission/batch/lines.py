"""A Batch API input file, validated as its bytes arrive, and a file's asked-for life."""

from __future__ import annotations

import json
import struct

from admission.errors import BadRequest

URLS = ("/v1/chat/completions", "/v1/completions")


class Lines:
    """An input file's requests, validated as its bytes arrive: line numbers, unique custom
    ids, the urls used, and the index of each request's (start, end) byte offsets."""

    def __init__(self, max_lines: int) -> None:
        self.max_lines = max_lines
        self.n = 0  # lines read, blank ones included (for messages)
        self.count = 0  # requests
        self.seen: set[str] = set()
        self.urls: set[str] = set()
        self.index = bytearray()
        self.offset = 0  # where `rest` starts in the file
        self.rest = b""

    def feed(self, data: bytes, final: bool = False) -> None:
        buf = self.rest + data
        cut = len(buf) if final else buf.rfind(b"\n") + 1
        blob, self.rest = buf[:cut], buf[cut:]
        start = 0
        while start < len(blob):
            nl = blob.find(b"\n", start)
            end = len(blob) if nl < 0 else nl
            self._line(blob[start:end], self.offset + start, self.offset + end)
            start = end + 1
        self.offset += cut
        if final and not self.count:
            raise BadRequest("file has no requests", code="invalid_file")

    def _line(self, raw: bytes, start: int, end: int) -> None:
        self.n += 1
        n = self.n
        if raw.endswith(b"\r"):
            raw, end = raw[:-1], end - 1
        if not raw.strip():
            return
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise BadRequest(f"line {n}: not UTF-8", code="invalid_file") from None
        except ValueError:
            raise BadRequest(f"line {n}: not JSON", code="invalid_file") from None
        if not isinstance(obj, dict):
            raise BadRequest(f"line {n}: not a JSON object", code="invalid_file")
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > 512:
            raise BadRequest(f"line {n}: custom_id must be a non-empty string", code="invalid_file")
        if cid in self.seen:
            raise BadRequest(f"line {n}: custom_id {cid!r} repeats", code="invalid_file")
        self.seen.add(cid)
        if obj.get("method") != "POST" or obj.get("url") not in URLS:
            raise BadRequest(
                f"line {n}: method must be POST and url one of {', '.join(URLS)}",
                code="invalid_file",
            )
        if not isinstance(obj.get("body"), dict):
            raise BadRequest(f"line {n}: body must be an object", code="invalid_file")
        self.urls.add(obj["url"])
        self.index += struct.pack("<II", start, end)
        self.count += 1
        if self.count > self.max_lines:
            raise BadRequest(
                f"more than {self.max_lines} lines (batch.max_lines)", code="too_many_lines"
            )


def expires_after(fields: dict[str, str], default_s: int) -> int:
    """The life a file asked for (OpenAI's `expires_after[anchor|seconds]`), in seconds."""
    if not fields:
        return default_s
    if fields.get("expires_after[anchor]") != "created_at":
        raise BadRequest("expires_after[anchor] must be 'created_at'", code="invalid_request")
    try:
        seconds = int(fields.get("expires_after[seconds]", ""))
    except ValueError:
        seconds = 0
    if not 3600 <= seconds <= 30 * 86400:
        raise BadRequest(
            "expires_after[seconds] must be between 3600 and 2592000", code="invalid_request"
        )
    return min(seconds, default_s)
