"""The patch formats (:class:`PatchFormat`, named once) and the payload encodings of format 2:
changed-entry bitmasks and optional zstd (numpy only).

Used by both sides of :mod:`mergestream.patches` (apply) and :mod:`mergestream.patches.build`
(build); ``zstandard`` is imported only when a payload is compressed.

Bitmask (``sparse.mask/<name>``, ``U8``, shape ``[ceil(numel / 8)]``)
    Bit ``i % 8`` (least significant first, numpy's ``bitorder="little"``) of byte ``i // 8`` is set
    when flat C-order entry ``i`` changed; padding bits of the last byte are zero. The changed
    entries' new values follow in ``sparse.values/<name>`` in ascending index order. Cost per
    tensor: ``numel/8 + nnz·itemsize`` bytes, against ``nnz·(4 + itemsize)`` for the index list of
    format 1 and ``numel·itemsize`` dense: for bf16 the mask wins above ~2 % density and stays
    below dense up to ~94 % (1/16 byte of mask per entry vs 2 bytes of value).

zstd (``zstd/<payload name>``, ``U8``, shape ``[compressed bytes]``)
    A payload (dense, mask, indices or values) compressed with Zstandard as one frame; the
    uncompressed dtype and shape are recorded in the metadata key ``compressed`` as
    ``{payload name: [dtype, shape]}``. Kept only when smaller than the raw payload.
"""

from __future__ import annotations

import enum

import numpy as np

from ..io.st import DTYPE_SIZES, FormatError, Header, TensorEntry, load_json

MASK = "sparse.mask/"
ZSTD = "zstd/"


class PatchFormat(enum.IntEnum):
    """The patch formats, named once: the number an operator chooses (``--format``, the config's
    ``patch_format``) and, as :attr:`tag`, the ``patch_format`` metadata a patch file carries."""

    INDEX_LISTS = 1  #: dense or index/value payloads; every agent applies it
    BITMASKS = 2  #: adds changed-entry bitmasks and zstd payloads (this module)

    @property
    def tag(self) -> str:
        """The ``patch_format`` metadata value, e.g. ``"mergestream-patch/2"``."""
        return f"mergestream-patch/{self.value}"

    @classmethod
    def of_tag(cls, tag: object) -> PatchFormat | None:
        """The format whose :attr:`tag` is ``tag``; None for anything else (not a patch we know)."""
        return next((f for f in cls if f.tag == tag), None)


#: the format numbers, ascending (config ``Literal``, CLI choices)
FORMAT_NUMBERS: tuple[int, ...] = tuple(f.value for f in PatchFormat)


def mask_bytes(numel: int) -> int:
    """Bytes of the bitmask of a tensor of ``numel`` entries."""
    return (numel + 7) // 8


def encode_mask(changed: np.ndarray) -> np.ndarray:
    """Pack a flat boolean array (True = changed) into the bitmask bytes (``uint8``)."""
    return np.packbits(changed, bitorder="little")


def decode_mask(packed: np.ndarray, numel: int, where: str) -> np.ndarray:
    """The flat boolean "changed" array of ``numel`` entries from bitmask bytes.

    Raises:
        FormatError: wrong length, or padding bits set.
    """
    packed = packed.view(np.uint8)
    if packed.size != mask_bytes(numel):
        raise FormatError(f"{where}: bitmask has {packed.size} bytes, {mask_bytes(numel)} expected")
    bits = np.unpackbits(packed, bitorder="little")
    if bits[numel:].any():
        raise FormatError(f"{where}: bitmask padding bits are set")
    return bits[:numel].view(bool)


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise FormatError("this patch is zstd-compressed and the `zstandard` package is not installed "
                          "(pip install zstandard)") from None
    return zstandard


def compress(data: memoryview | bytes, level: int = 3) -> bytes:
    """One Zstandard frame of ``data`` (with its content size recorded)."""
    return _zstd().ZstdCompressor(level=level, write_content_size=True).compress(bytes(data))


def decompress(data: memoryview | bytes, nbytes: int, where: str) -> np.ndarray:
    """Decompress one frame that must hold exactly ``nbytes`` bytes; returns writable ``uint8``.

    Raises:
        FormatError: not a valid frame, or a different size.
    """
    zstd = _zstd()
    try:
        out = zstd.ZstdDecompressor().decompress(bytes(data), max_output_size=nbytes)
    except zstd.ZstdError as exc:
        raise FormatError(f"{where}: corrupt zstd payload ({exc})") from None
    if len(out) != nbytes:
        raise FormatError(f"{where}: zstd payload holds {len(out)} bytes, {nbytes} expected")
    return np.frombuffer(bytearray(out), np.uint8)


def logical_entries(hdr: Header, format_1: bool, where: str) -> tuple[list[TensorEntry], dict[str, TensorEntry]]:
    """A patch's payload entries with each ``zstd/`` entry replaced by its uncompressed payload
    (dtype and shape from metadata ``compressed``; ``offset`` -1: read it through the stored entry),
    and ``{payload name: stored zstd entry}``.

    Raises:
        FormatError: a format 1 patch holding format 2 entries, a compressed entry without a valid
        dtype/shape, or a payload stored both raw and compressed.
    """
    stored = [e for e in hdr.entries if e.name.startswith(ZSTD)]
    if format_1 and (stored or any(e.name.startswith(MASK) for e in hdr.entries)):
        raise FormatError(f"{where}: format 1 patch holds format 2 entries")
    shapes = load_json(hdr.metadata.get("compressed", "{}"), f"{where}: metadata 'compressed'", error=FormatError)
    out = [e for e in hdr.entries if not e.name.startswith(ZSTD)]
    compressed: dict[str, TensorEntry] = {}
    for e in stored:
        name = e.name[len(ZSTD):]
        spec = shapes.get(name) if isinstance(shapes, dict) else None
        if e.dtype != "U8" or not (isinstance(spec, list) and len(spec) == 2 and spec[0] in DTYPE_SIZES
                                   and isinstance(spec[1], list) and all(type(d) is int and d >= 0 for d in spec[1])):
            raise FormatError(f"{where}: compressed entry {e.name!r} has no valid uncompressed dtype/shape")
        numel = 1
        for d in spec[1]:
            numel *= d
        out.append(TensorEntry(name, spec[0], tuple(spec[1]), e.file, -1, numel * DTYPE_SIZES[spec[0]]))
        compressed[name] = e
    if len({e.name for e in out}) != len(out):
        raise FormatError(f"{where}: a payload is stored both raw and compressed")
    return out, compressed
