"""The lossy codecs' fast path against a straightforward reference: the same payload bytes and
the same decoded bytes, for shapes with odd sizes, every float dtype, opaque blocks, zeros,
subnormals, values near the dtype's limit, and blocks that cannot be encoded (infinite or
NaN values: no payload, the caller stores them raw).

The reference follows the documented format (`tiers/codecs/scaled.py`, `quant.py`) in the
plainest torch: the block in float32, `amin`/`amax` per group, scales rounded up to bfloat16
(INT8: to nearest after a margin; FP8, INT4: to the next one up; zeros to the next one down),
`round(x / s)` half to even, clamped, codes packed low nibble first; decoding multiplies in
float32 (then adds the zero) and rounds once into the block's dtype.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tiers.codecs import CodecKind, build_codec

LOSSY = [CodecKind.INT8, CodecKind.FP8, CodecKind.K8V4]
UP, TINY = 1 + 2.0**-7, 2.0**-100
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 15.0}


def _formats(kind: CodecKind) -> tuple[str, str]:
    return {CodecKind.INT8: ("int8", "int8"), CodecKind.FP8: ("fp8", "fp8"), CodecKind.K8V4: ("int8", "int4")}[kind]


def _groups(half: torch.Tensor, fmt: str, opaque_group: int | None, key: bool) -> tuple[torch.Tensor, int]:
    """`half` ([layers, tokens, heads, width], float32) viewed in its scale groups, and the
    dimension a scale spans."""
    layers, tokens, heads, width = half.shape
    if opaque_group is not None:
        g = 32 if fmt == "int4" and opaque_group % 32 == 0 else opaque_group
        return half.reshape(layers, tokens * heads, width // g, g), -1
    if key and tokens >= 8:
        return half, 1  # per layer, head and channel over the tokens
    g = 32 if fmt == "int4" else width
    return half.reshape(layers, tokens, heads, width // g, g), -1


def _scales(x: torch.Tensor, dim: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    if fmt == "int4":
        zero = _bf16(lo, up=False)
        return _bf16(((hi - zero.float()) / 15.0).clamp(min=TINY), up=True), zero
    if fmt == "fp8":
        return _bf16((torch.maximum(hi, -lo) / QMAX[fmt]).clamp(min=TINY), up=True), None
    return (torch.maximum(hi, -lo) / QMAX[fmt] * UP).clamp(min=TINY).to(torch.bfloat16), None


def _bf16(v: torch.Tensor, up: bool) -> torch.Tensor:
    """`v` (float32) rounded to bfloat16 towards +inf (`up`) or -inf: the nearest, moved one
    step where it lies on the wrong side."""
    b = v.to(torch.bfloat16)
    wrong = b.float() < v if up else b.float() > v
    step = torch.nextafter(b, torch.full_like(b, float("inf") if up else float("-inf")))
    return torch.where(wrong, step, b)


def reference_encode(kind: CodecKind, block: torch.Tensor, elem: torch.dtype, group: int | None) -> bytes | None:
    """The payload of `block` ([layers, 2, tokens, heads, width] in its dtype, or opaque uint8
    holding `elem`); None if it cannot be encoded."""
    x = block.contiguous().view(elem).float()
    metas, codes = [], []
    for h, fmt in enumerate(_formats(kind)):
        g, dim = _groups(x[:, h], fmt, group, key=h == 0)
        scale, zero = _scales(g, dim, fmt)
        top = scale.float() * QMAX[fmt] + (zero.float().abs() if zero is not None else 0)
        if not float(top.max()) <= torch.finfo(elem).max:
            return None
        y = ((g - zero.float()) if zero is not None else g) / scale.float()
        if fmt == "int8":
            c = torch.round(y).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        elif fmt == "fp8":
            c = y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            q = torch.round(y).clamp(0, 15).to(torch.uint8)
            c = q[..., 0::2] | (q[..., 1::2] << 4)
        metas.append(scale.reshape(-1).view(torch.uint8).numpy().tobytes())
        if zero is not None:
            metas.append(zero.reshape(-1).view(torch.uint8).numpy().tobytes())
        codes.append(c.contiguous().reshape(-1).numpy().tobytes())
    return b"".join(metas + codes)


def reference_decode(kind: CodecKind, payload: bytes, like: torch.Tensor, elem: torch.dtype,
                     group: int | None) -> torch.Tensor:
    """The block `payload` encodes, in `like`'s shape and dtype."""
    x = torch.zeros_like(like).view(elem).float()
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    meta_at, halves = 0, []
    for h, fmt in enumerate(_formats(kind)):
        g, dim = _groups(x[:, h], fmt, group, key=h == 0)
        shape = [1 if i == dim % g.dim() else n for i, n in enumerate(g.shape)]
        n = 1
        for s in shape:
            n *= s
        scale = data[meta_at : meta_at + 2 * n].view(torch.bfloat16).float().view(shape)
        meta_at += 2 * n
        zero = None
        if fmt == "int4":
            zero = data[meta_at : meta_at + 2 * n].view(torch.bfloat16).float().view(shape)
            meta_at += 2 * n
        halves.append((g, fmt, scale, zero))
    code_at, out = meta_at, torch.empty(like.shape, dtype=like.dtype).view(elem)
    for h, (g, fmt, scale, zero) in enumerate(halves):
        n = g.numel() // 2 if fmt == "int4" else g.numel()
        c = data[code_at : code_at + n]
        code_at += n
        if fmt == "int8":
            v = c.view(torch.int8).float().view(g.shape)
        elif fmt == "fp8":
            v = c.view(torch.float8_e4m3fn).float().view(g.shape)
        else:
            v = torch.stack((c & 15, c >> 4), dim=-1).float().view(g.shape)
        v = v * scale
        if zero is not None:
            v = v + zero
        out[:, h] = v.reshape(out[:, h].shape).to(elem)
    return out.view(like.dtype)


def gaussian(shape: tuple[int, ...], dtype: torch.dtype, seed: int, spread: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * spread
    x[:, 0, ..., shape[-1] // 3] *= 30  # an outlier key channel
    return x.to(dtype)


def special(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of both signs, a subnormal group, a constant negative group, huge values and
    exact ties of the rounding (`k + 0.5` steps of a power-of-two scale)."""
    x = gaussian(shape, dtype, seed=5)
    x[0, 0, 0] = 0.0
    x[0, 1, 0] = -0.0
    x[-1, 1, -1] = torch.finfo(dtype).tiny / 4  # subnormal
    x[-1, 0, 0] = -3.25
    x[0, 1, -1, 0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127.0, -127.0, 63.5], dtype=dtype)
    x[-1, 1, 0, -1] = torch.finfo(dtype).max / 1024
    return x


CASES = [
    # (block shape, dtype) for structured blocks: even and odd sizes, keys per channel and per token
    ((3, 2, 16, 2, 64), torch.bfloat16),
    ((3, 2, 16, 2, 64), torch.float16),
    ((2, 2, 16, 1, 64), torch.float32),
    ((1, 2, 9, 3, 96), torch.bfloat16),  # odd tokens and heads, keys per channel
    ((5, 2, 5, 3, 32), torch.float16),  # fewer than 8 tokens: keys per token and head
    ((2, 2, 1, 1, 32), torch.bfloat16),  # one token
]


def check_against_reference(kind: CodecKind, block: torch.Tensor, elem: torch.dtype, group: int | None) -> None:
    """The codec's payload of `block` (left unchanged) is the reference's, and decodes (from
    read-only bytes, as a tier's read buffer) as the reference's does."""
    kw = {} if group is None else {"element_dtype": elem, "group": group}
    codec = build_codec(kind, tuple(block.shape), block.dtype, **kw)  # type: ignore[arg-type]
    before = block.clone()
    payload = codec.encode(block)
    assert torch.equal(block.contiguous().view(torch.uint8), before.contiguous().view(torch.uint8))  # left alone
    expected = reference_encode(kind, block, elem, group)
    assert (payload is None) == (expected is None)
    if payload is None or expected is None:
        return
    assert bytes(payload) == expected
    out = torch.full(tuple(block.shape), 7, dtype=block.dtype)
    codec.decode(memoryview(bytes(payload)), out)
    want = reference_decode(kind, expected, out, elem, group)
    assert torch.equal(out.view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("kind", LOSSY)
@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_fast_path_equals_the_reference(kind: CodecKind, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    for seed in range(2):
        check_against_reference(kind, gaussian(shape, dtype, seed), dtype, None)
    check_against_reference(kind, special(shape, dtype), dtype, None)
    check_against_reference(kind, torch.zeros(shape, dtype=dtype), dtype, None)
    strided = torch.zeros((*shape[:-1], shape[-1] * 2), dtype=dtype)
    strided[..., ::2] = gaussian(shape, dtype, 3)
    check_against_reference(kind, strided[..., ::2], dtype, None)


@pytest.mark.parametrize("kind", LOSSY)
@pytest.mark.parametrize(("elem", "group"), [(torch.bfloat16, 64), (torch.float16, 32), (torch.bfloat16, 128)])
def test_opaque_fast_path_equals_the_reference(kind: CodecKind, elem: torch.dtype, group: int) -> None:
    x = special((2, 2, 3, 1, 128), elem)
    opaque = x.view(torch.uint8)  # [2, 2, 3, 1, 256] page bytes
    check_against_reference(kind, opaque, elem, group)


@pytest.mark.parametrize("kind", LOSSY)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_infinite_nan_and_overflowing_blocks_have_no_payload(kind: CodecKind, dtype: torch.dtype) -> None:
    # The dtype's lowest value, not its largest: in bfloat16 `max / 15` is a bfloat16 value, so
    # an INT4 group holding the largest value is encodable (`15 s + zero` rounds to it).
    for bad in (float("inf"), float("-inf"), float("nan"), -float("nan"), -torch.finfo(dtype).max):
        x = gaussian((2, 2, 16, 1, 64), dtype, seed=1)
        x[1, 1, 3, 0, 7] = bad
        assert reference_encode(kind, x, dtype, None) is None  # the reference agrees
        codec = build_codec(kind, tuple(x.shape), dtype)
        assert codec.encode(x) is None
        x[1, 0, 3, 0, 7] = bad  # in a key group too
        assert codec.encode(x) is None


@pytest.mark.parametrize("kind", LOSSY)
@pytest.mark.parametrize("opaque", [False, True])
def test_blocks_of_any_strides_encode_and_decode_as_contiguous_ones(kind: CodecKind, opaque: bool) -> None:
    """A source or destination whose heads are a slice of a wider tensor (tokens and heads
    cannot merge into one view) codes as its contiguous copy does, never a RuntimeError; a
    payload and a decoded block stay as they are through the thread's next encode and decode
    (nothing returned aliases the per-thread scratch)."""
    wide = special((2, 2, 16, 4, 64), torch.bfloat16)
    other = gaussian((2, 2, 16, 2, 64), torch.bfloat16, seed=5)
    if opaque:
        wide, other = wide.view(torch.uint8), other.view(torch.uint8)
    src = wide[:, :, :, 1:3]
    kw = {"element_dtype": torch.bfloat16} if opaque else {}
    codec = build_codec(kind, tuple(src.shape), src.dtype, **kw)  # type: ignore[arg-type]
    payload = codec.encode(src)
    expected = codec.encode(src.contiguous())
    assert payload is not None and expected is not None and bytes(payload) == bytes(expected)
    want = torch.zeros(src.shape, dtype=src.dtype)
    codec.decode(bytes(expected), want)
    dst_wide = torch.zeros(wide.shape, dtype=wide.dtype)
    dst = dst_wide[:, :, :, 1:3]
    codec.decode(bytes(payload), dst)
    assert torch.equal(dst.contiguous().view(torch.uint8), want.view(torch.uint8))
    assert not dst_wide[:, :, :, 0].any() and not dst_wide[:, :, :, 3].any()  # nothing outside the block written
    kept = bytes(payload)
    codec.decode(bytes(codec.encode(other) or b""), torch.zeros(src.shape, dtype=src.dtype))  # the thread codes on
    assert bytes(payload) == kept
    assert torch.equal(dst.contiguous().view(torch.uint8), want.view(torch.uint8))


def test_threads_encode_the_same_bytes_at_once() -> None:
    """Each thread has its own scratch buffers: concurrent encodes of different blocks give
    each block's own payload."""
    shape = (4, 2, 16, 2, 64)
    codec = build_codec(CodecKind.INT8, shape, torch.bfloat16)
    blocks = [gaussian(shape, torch.bfloat16, seed) for seed in range(4)]
    expected = [bytes(codec.encode(b) or b"") for b in blocks]
    wrong: list[int] = []

    def run(i: int) -> None:
        for _ in range(30):
            if bytes(codec.encode(blocks[i]) or b"") != expected[i]:
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.mark.parametrize(("dtype", "elem"), [(torch.bfloat16, None), (torch.float16, None), (torch.float32, None),
                                             (torch.uint8, torch.bfloat16), (torch.uint8, torch.float32)])
def test_zstd_planes_equal_the_reference_transpose(dtype: torch.dtype, elem: torch.dtype | None) -> None:
    """The lossless codec's byte planes (built and joined with integer shifts) are the plain
    transpose of each element's bytes: frames written before decode the same, and after."""
    zstandard = pytest.importorskip("zstandard")
    shape = (3, 2, 5, 3, 64)
    g = torch.Generator().manual_seed(9)
    block = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if dtype != torch.uint8:
        block = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=g,
                              dtype=torch.uint8).view(dtype)
    width = (elem or dtype).itemsize
    codec = build_codec(CodecKind.ZSTD, shape, dtype, **({} if elem is None else {"element_dtype": elem}))
    raw = block.contiguous().view(torch.uint8).numpy().reshape(-1)
    planes = raw.reshape(-1, width).T.copy()  # byte k of every element in plane k
    payload = codec.encode(block)
    assert payload is not None
    assert zstandard.ZstdDecompressor().decompress(payload) == planes.tobytes()
    out = torch.zeros_like(block)
    codec.decode(zstandard.ZstdCompressor(level=3).compress(planes.tobytes()), out)  # a frame of the reference
    assert torch.equal(out.view(torch.uint8), block.view(torch.uint8))
