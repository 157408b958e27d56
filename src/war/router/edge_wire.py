"""Bytes on the wire for ``war.router.edge``: HTTP/1.1 response heads and bodies.

Knows: status lines with their reason phrases (499: a client that closed its
request), the ``date`` header (formatted once a second), ``connection: close`` on
a connection's last answer, JSON answers with their length, chunked body framing,
and how a request target splits into path and query. Does not know connections,
parsing or what a request means.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import httptools
import orjson

from war.api import APIError, error_body

_REASONS = {s.value: s.phrase for s in HTTPStatus} | {499: "Client Closed Request"}
_date_cache: tuple[int, bytes] = (0, b"")


def date_header() -> bytes:
    """The ``date`` header's value for now (formatted once a second)."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, formatdate(now, usegmt=True).encode())
    return _date_cache[1]


def head(status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
    """A response's status line and headers (``date`` added; ``connection: close``
    unless ``keep_alive``), up to the blank line."""
    lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, "Unknown").encode()),
             b"date: " + date_header()]
    lines += [name + b": " + value for name, value in headers]
    if not keep_alive:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


_OK_DATE = b"HTTP/1.1 200 OK\r\ndate: "
_JSON_LENGTH = b"\r\ncontent-type: application/json\r\ncontent-length: "


def json_response(status: int, body: bytes, keep_alive: bool,
                  extra: Mapping[str, str] | None = None) -> bytes:
    """A whole response with a JSON ``body`` (and ``extra`` headers)."""
    if status == 200 and not extra:  # every routed answer: the bytes ``head`` would make
        return b"".join((_OK_DATE, date_header(), _JSON_LENGTH, b"%d" % len(body),
                         b"\r\n\r\n" if keep_alive else b"\r\nconnection: close\r\n\r\n",
                         body))
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if extra:
        headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
    return head(status, headers, keep_alive) + body


def error_json(status: int, message: str) -> bytes:
    """The API's error body (``war.api.error_body``) for what the server answers on its
    own: malformed requests, bodies over the limit, an app that failed."""
    return orjson.dumps(error_body(APIError(status, message)))


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (nothing for no data: an empty chunk
    would end the body)."""
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


LAST_CHUNK = b"0\r\n\r\n"


def split_target(url: bytes) -> tuple[bytes, bytes]:
    """(path, query) of a request target (an absolute URL's path too)."""
    if not url:
        return b"/", b""
    if url[0:1] == b"/" and b"?" not in url and b"#" not in url:
        return url, b""  # the common case, without a parse
    parsed = httptools.parse_url(url)
    return parsed.path or b"/", parsed.query or b""


def address(peer: Any) -> tuple[str, int] | None:
    """(host, port) of a socket address (IPv6 ones have four fields)."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        return (str(peer[0]), int(peer[1]))
    return None


__all__ = ["LAST_CHUNK", "address", "chunk", "date_header", "error_json", "head",
           "json_response", "split_target"]
