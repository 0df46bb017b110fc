"""The KV page protocol between agents (issue 40): framing, bounds and the arrival checks.

    request   u32 length + JSON PageRequest (session, model, the requester's block hashes)
    reply     u32 length + JSON PageLayout, then per page: u32 length + JSON PageFrame and
              the frame's rank slabs (sizes[r] bytes each), then a frame with hash 0 (end)
    mooncake  both sides have a segment (mooncake_transport.py): a frame carries `addr`, not its
              slabs; after a `flush` frame the requester reads the chunk and acks with ACK
    listing   (a drain's push, no prompt to hash) one PageLayout: `hashes`, the session's prefix

The requester derives `hashes` from its own call's prompt under its tenant's scope
(shared/tokenizer.block_hashes), so only pages of that exact prefix can match; the holder
sends only the leading pages that the named session's own host prefix holds. On arrival a
page is kept only while its hash is the next one asked for, its sizes match the layout and
its digest matches its bytes; the first page that fails ends the prefix (the rest is
recomputed: a torn or stale transfer costs time, never a wrong token). Pure: no I/O here.
"""

from __future__ import annotations

import hashlib

import msgspec
from msgspec import Struct

HEADER = 4  # bytes of each length prefix
MAX_JSON = 1 << 20  # a request or frame header larger than this is refused
MAX_PAGES = 1 << 16  # pages one pull may ask for (1M tokens at 16-token pages)


class PageRequest(Struct, frozen=True):
    session_id: str
    model: str
    hashes: list[int]
    max_bytes: int  # the requester's bound: the holder stops before sending more
    segment: str = ""  # the requester's Mooncake segment: "" takes the bytes inline over TCP
    chunk_bytes: int = 0  # its receive slot: no staged chunk is larger
    # A drain's push (no prompt to hash): list the session's own host prefix hashes, no page
    listing: bool = False


class PageLayout(Struct, frozen=True):
    """How each rank slab of a page is laid out (host_pages.LayoutDescriptor's fields)."""

    pages: int  # pages that follow (the holder's count; fewer may arrive)
    ranks: int = 0
    page_size: int = 0
    dtype: str = ""
    shape: list[int] = []
    itemsize: int = 0
    error: str = ""  # the holder refused (one line), no page follows
    segment: str = ""  # the holder's Mooncake segment the slabs are read from ("": inline)
    hashes: list[int] = []  # a listing's answer: the session's restorable prefix, in order


class PageFrame(Struct, frozen=True):
    hash: int  # 0: the end
    sizes: list[int] = []
    digest: str = ""  # blake2b-16 of the slabs' bytes, concatenated
    addr: int = 0  # Mooncake: the slabs' address in the holder's segment, concatenated
    flush: bool = False  # Mooncake: the chunk's last page; the requester reads it, then acks


ACK = b"\x01"  # Mooncake: the requester has read the staged chunk (its slot may be reused)


def frame(obj: Struct) -> bytes:
    data = msgspec.json.encode(obj)
    return len(data).to_bytes(HEADER, "big") + data


def digest(slabs: list[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for s in slabs:
        h.update(s)
    return h.hexdigest()


def slab_bytes(layout: PageLayout) -> int:
    n = layout.itemsize
    for d in layout.shape:
        n *= d
    return n


def check_request(req: PageRequest) -> str:
    """'' or why a request is refused (one line)."""
    if req.listing:
        return "" if not req.hashes else "a listing asks for no hashes"
    if not req.hashes or len(req.hashes) > MAX_PAGES:
        return f"hashes: 1..{MAX_PAGES} expected, got {len(req.hashes)}"
    if req.max_bytes <= 0:
        return "max_bytes must be > 0"
    if req.segment and req.chunk_bytes <= 0:
        return "chunk_bytes must be > 0 with a segment"
    return ""


def page_ok(frame_: PageFrame, want_hash: int, layout: PageLayout, slabs: list[bytes]) -> bool:
    """The arrival check of one page: the next hash asked for, whole slabs, bytes as sent."""
    size = slab_bytes(layout)
    return (frame_.hash == want_hash and len(slabs) == layout.ranks
            and all(len(s) == size for s in slabs) and frame_.digest == digest(slabs))
