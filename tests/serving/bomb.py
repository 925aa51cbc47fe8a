"""A decompression bomb for tests: a valid compressed stream of many zero bytes."""

from __future__ import annotations

import zlib


def zero_bomb(total: int, algorithm: str) -> bytes:
    """A valid gzip / zlib stream of ``total`` zero bytes, built in about a second.

    After a full flush the compressor's state is reset, so every further 16 MiB block of zeros
    compresses to the same bytes: the stream is the header, that segment repeated, the final
    block and a trailer (CRC-32 or Adler-32 of the zeros, and for gzip the size mod 2**32).
    """
    block = bytes(16 << 20)
    n = total // len(block)
    wbits = 31 if algorithm == "gzip" else 15
    comp = zlib.compressobj(9, zlib.DEFLATED, wbits)
    head = comp.compress(block) + comp.flush(zlib.Z_FULL_FLUSH)
    segment = comp.compress(block) + comp.flush(zlib.Z_FULL_FLUSH)
    tail = comp.flush()[: -8 if algorithm == "gzip" else -4]  # the final block, no trailer
    if algorithm == "gzip":
        crc = 0
        for _ in range(n):
            crc = zlib.crc32(block, crc)
        trailer = crc.to_bytes(4, "little") + (total % (1 << 32)).to_bytes(4, "little")
    else:
        adler = 1
        for _ in range(n):
            adler = zlib.adler32(block, adler)
        trailer = adler.to_bytes(4, "big")
    return head + segment * (n - 1) + tail + trailer
