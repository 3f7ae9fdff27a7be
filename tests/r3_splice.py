"""Documents built to break the R3 splice (`app.domain.wire.r3text`), for its callers'
tests: the gateway's `parse_reply` (SGLang replies) and the server's `loads_turn`
(turn bodies). Each is the document with one change around or in its base64 R3
text: spacing, the key earlier, elsewhere, twice or inside a string, a text that
is not canonical base64, broken JSON, and the markers spelled in the document.
"""

from __future__ import annotations

from app.domain.wire.r3text import MARKERS

KEY = b'"routed_experts": "'


def splice_breakers(doc: bytes, r3: bytes, first: bytes, before: bytes,
                    after: bytes) -> list[bytes]:
    """`doc` (JSON with `", "` and `": "` separators) holding the base64 text `r3` once;
    `first`: the document's opening up to its first key's name (`{"id"`); `before`: a
    key of the R3's choice ahead of `meta_info`; `after`: a key of `meta_info` after
    `routed_experts`."""
    opening = first[1:]
    return [
        doc,
        doc.replace(b'": ', b'":').replace(b", ", b","),  # compact
        doc.replace(KEY, b'"routed_experts":\n\t "'),
        doc.replace(before, b'"routed_experts": "AAAAAAAA", ' + before),  # an earlier one
        doc.replace(first, b'{"routed_experts": "AAAAAAAA", ' + opening),
        doc.replace(first, b'{"x\\"routed_experts": "AAAAAAAA", ' + opening),  # in a key
        doc.replace(first, b'{"c": "a\\n\\"routed_experts\\": \\"AAAA\\"", ' + opening),
        doc.replace(KEY, b'"routed_experts": "AAAAAAAA", "routed_experts": "'),  # twice
        doc.replace(after, b'"routed_experts": "AAAAAAAA", ' + after),
        doc.replace(KEY, b'"a": "x"routed_experts": "'),  # after a closing quote
        doc.replace(KEY, b'"routed_experts": "x'),  # not base64 from the start
        doc.replace(KEY, b'"routed_experts": NaN, "b": "'),
        doc.replace(r3, r3[:-1]),  # truncated
        doc.replace(r3, b"AAAAAR=="),  # non-zero trailing bits
        doc.replace(r3, b"AAAAAAA="),  # not whole int32s
        doc.replace(r3, b""),
        doc[:-2],
        # The marker itself, spelled with an escape where the payload belongs, and a
        # payload elsewhere: the marker found there is not the spliced string.
        doc.replace(r3, b"\\u0074" + MARKERS[0][1:]).replace(
            first, b'{"z": {"routed_experts": "AAAAAAAA"}, ' + opening),
        doc.replace(r3, MARKERS[0]).replace(
            first, b'{"z": {"routed_experts": "AAAAAAAA"}, ' + opening),
        b'"routed_experts": "AAAA"', b'{"routed_experts": "AAAA"',
    ]
