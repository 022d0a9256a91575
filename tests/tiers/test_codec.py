"""Block codecs on their own: lossless round trips are bit-exact, lossy ones stay within their
stated per-element bound, malformed payloads are `CorruptRecordError`, bad settings are one
`ConfigError` naming the value."""

from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch

from tiers.codecs import CODECS, CodecKind, Int8Config, build_codec, codec_config, codec_of_id, parse_codec
from tiers.codecs.scaled import ScaledCodec
from tiers.errors import ConfigError, CorruptRecordError

SHAPE = (3, 2, 16, 2, 64)  # layers, K/V, tokens, heads, head_dim
LOSSY = [k for k in CodecKind if k.lossy]
FLOATS = [torch.bfloat16, torch.float16, torch.float32]


def kv(shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Gaussian KV with one outlier key channel per head, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2
    x[:, 0, :, :, 3] *= 30
    return x.to(dtype)


def round_trip(kind: CodecKind, x: torch.Tensor, **kw: object) -> tuple[torch.Tensor, bytes]:
    codec = build_codec(kind, tuple(x.shape), x.dtype, **kw)  # type: ignore[arg-type]
    payload = codec.encode(x)
    assert payload is not None
    out = torch.full_like(x, 7) if x.dtype.is_floating_point else torch.zeros_like(x)
    codec.decode(memoryview(bytes(payload)), out)  # read-only, as a tier's read buffer
    return out, bytes(payload)


def test_ids_are_stable() -> None:
    # Written in records: changing one makes old records decode as another codec.
    assert {k.label: k.value for k in CodecKind} == {"none": 0, "zstd": 1, "int8": 2, "fp8": 3, "k8v4": 4}
    assert [k.label for k in CodecKind if k.lossy] == ["int8", "fp8", "k8v4"]
    assert codec_of_id(3) is CodecKind.FP8 and codec_of_id(99) is None


def test_parse_codec() -> None:
    assert parse_codec("INT8") is CodecKind.INT8 and parse_codec(CodecKind.ZSTD) is CodecKind.ZSTD
    with pytest.raises(ConfigError, match=r"disk_codec must be one of \['none', 'zstd', 'int8', 'fp8', 'k8v4'\], "
                                          r"got 'int3'"):
        parse_codec("int3", "disk_codec")
    with pytest.raises(ConfigError, match="got 2"):
        parse_codec(2)


@pytest.mark.parametrize("dtype", [*FLOATS, torch.uint8])
@pytest.mark.parametrize("kind", [CodecKind.NONE, CodecKind.ZSTD])
def test_lossless_is_bit_exact(kind: CodecKind, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, SHAPE, generator=g, dtype=torch.uint8)
    x = x.view(torch.uint8).reshape(*SHAPE[:-1], -1).view(dtype) if dtype.itemsize == 1 else \
        torch.randint(0, 256, (*SHAPE[:-1], SHAPE[-1] * dtype.itemsize), generator=g, dtype=torch.uint8).view(dtype)
    if dtype.is_floating_point:  # every bit pattern, NaN and infinities included
        x.view(torch.uint8).view(-1)[: 4 * dtype.itemsize] = torch.tensor([0xFF] * dtype.itemsize * 4,
                                                                          dtype=torch.uint8)
    out, _ = round_trip(kind, x)
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))


def test_zstd_packs_float_kv() -> None:
    x = kv()
    _, payload = round_trip(CodecKind.ZSTD, x)
    assert len(payload) < 0.85 * x.numel() * x.element_size()  # the exponent plane compresses


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kind", LOSSY)
def test_lossy_within_bound(kind: CodecKind, dtype: torch.dtype) -> None:
    codec = build_codec(kind, SHAPE, dtype)
    assert isinstance(codec, ScaledCodec)
    for seed in range(3):
        x = kv(dtype=dtype, seed=seed)
        x[0, 1, 0, 0] = 0  # an all-zero value group
        before = x.clone()
        out, payload = round_trip(kind, x)
        assert torch.equal(x, before)  # encoding leaves the source alone
        assert len(payload) == codec.payload_bytes
        err = (out.float() - x.float()).abs()
        bound = codec.error_bound(x)
        assert bool((err <= bound).all()), float((err / bound).max())
        assert float((err / bound).max()) > 0.3  # the bound is not vacuous
        assert torch.equal(out[0, 1, 0, 0], torch.zeros_like(out[0, 1, 0, 0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", LOSSY)
def test_decoded_kv_encoded_again_settles_within_the_reencoded_bound(kind: CodecKind, dtype: torch.dtype) -> None:
    """A block decoded and encoded again, 16 times over (a block promoted from a lossy tier and
    demoted back, again and again): its payload stops changing within 10 round trips, so its
    error against the original stops growing, and stays within `reencoded_error_bound`
    (`REENCODE_FACTOR` one-pass bounds); another block's KV is far outside it. Before, FP8's
    and INT4's scales grew a step each round trip, every decoded value with them."""
    for seed, mag in enumerate((0.01, 1.0, 50.0)):
        x = kv(dtype=torch.float32, seed=seed) * mag
        x[:, :, 5, 1, 7] *= 20  # an outlier token
        x = (x + mag * (seed - 1)).to(dtype)  # groups off centre: INT4's zeros far from 0
        codec = build_codec(kind, SHAPE, dtype)
        assert isinstance(codec, ScaledCodec)
        bound = codec.reencoded_error_bound(x)
        y, payloads = x, []
        for _ in range(16):
            y, payload = round_trip(kind, y)
            payloads.append(payload)
            err = (y.float() - x.float()).abs()
            assert bool((err <= bound).all()), float((err / codec.error_bound(x)).max())
        assert payloads[9:] == [payloads[9]] * 7, "decoded KV still changes when encoded again"
        other = kv(dtype=torch.float32, seed=seed + 10) * mag + mag * (seed - 1)
        assert float(((other - x.float()).abs() > bound).float().mean()) > 0.5


def test_lossy_sizes_and_precision_order() -> None:
    x = kv()
    raw = x.numel() * 2
    sizes = {k: len(round_trip(k, x)[1]) for k in LOSSY}
    # keys: 1 byte + a 2-byte scale per 16 tokens; values: 1 byte + 2 bytes per 64 (int8) or
    # half a byte + 4 bytes per 32 (4-bit)
    assert sizes[CodecKind.INT8] == sizes[CodecKind.FP8] == raw // 2 * (1 + 2 / 16) / 2 + raw // 2 * (1 + 2 / 64) / 2
    assert sizes[CodecKind.K8V4] == raw // 4 * (1 + 2 / 16) + raw // 4 * (0.5 + 4 / 32)
    errs = {k: float((round_trip(k, x)[0].float() - x.float())[:, 1].abs().mean()) for k in LOSSY}
    assert errs[CodecKind.INT8] < errs[CodecKind.K8V4]  # values at 4 bits lose more than at 8


def test_keys_scaled_per_channel() -> None:
    # An outlier channel must not swamp the other channels of its head.
    x = kv(dtype=torch.float32)
    out, _ = round_trip(CodecKind.INT8, x)
    normal = (out - x)[:, 0, :, :, 4:].abs().max()
    assert float(normal) < float(x[:, 0, :, :, 4:].abs().max()) / 200


def test_short_blocks_scale_keys_per_token() -> None:
    shape = (2, 2, 4, 2, 16)
    codec = build_codec(CodecKind.INT8, shape, torch.float16)
    x = kv(shape, torch.float16)
    out, payload = round_trip(CodecKind.INT8, x)
    assert len(payload) == x.numel() + 2 * 2 * 2 * 4 * 2  # one scale per token and head, both halves
    assert bool(((out.float() - x.float()).abs() <= codec.error_bound(x)).all())  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", LOSSY)
def test_opaque_blocks_quantized_as_their_element_dtype(kind: CodecKind) -> None:
    x = kv(dtype=torch.bfloat16)
    opaque = x.view(torch.uint8).reshape(SHAPE[0], 2, SHAPE[2], 1, -1)
    codec = build_codec(kind, tuple(opaque.shape), torch.uint8, element_dtype=torch.bfloat16, group=64)
    out, payload = round_trip(kind, opaque, element_dtype=torch.bfloat16, group=64)
    err = (out.view(torch.bfloat16).float() - opaque.view(torch.bfloat16).float()).abs()
    assert bool((err <= codec.error_bound(opaque).view(err.shape)).all())  # type: ignore[attr-defined]
    assert len(payload) < opaque.numel() * (0.6 if kind is CodecKind.K8V4 else 0.55)


def test_strided_and_staged_destinations() -> None:
    x = kv()
    for kind in CodecKind:
        codec = build_codec(kind, SHAPE, torch.bfloat16)
        payload = codec.encode(x)
        assert payload is not None
        big = torch.zeros((SHAPE[0], 2, SHAPE[2], SHAPE[3], SHAPE[4] * 2), dtype=torch.bfloat16)
        dst = big[..., ::2]  # no contiguous byte view
        codec.decode(payload, dst)
        ref = torch.empty_like(x)
        codec.decode(payload, ref)
        assert torch.equal(dst, ref) and torch.equal(big[..., 1::2], torch.zeros_like(dst))
        src = torch.zeros_like(big)
        src[..., ::2] = x
        assert bytes(codec.encode(src[..., ::2]) or b"") == bytes(payload)  # strided sources too


@pytest.mark.parametrize("kind", LOSSY)
def test_non_finite_blocks_are_not_encoded(kind: CodecKind) -> None:
    codec = build_codec(kind, SHAPE, torch.float16)
    for bad in (float("inf"), float("nan"), 65504.0):  # the last rounds past float16 once scaled
        x = kv(dtype=torch.float16)
        x[1, 1, 2, 0, 5] = bad
        assert codec.encode(x) is None  # the caller stores it raw


@pytest.mark.parametrize("kind", [k for k in CodecKind if k is not CodecKind.NONE])
def test_malformed_payloads_raise(kind: CodecKind) -> None:
    x = kv()
    codec = build_codec(kind, SHAPE, torch.bfloat16)
    payload = bytearray(codec.encode(x) or b"")
    out = torch.empty_like(x)
    with pytest.raises(CorruptRecordError):
        codec.decode(payload[:-1], out)
    if kind.lossy:
        with pytest.raises(CorruptRecordError):
            codec.decode(payload + b"\0", out)
        for scale in (b"\0\0", b"\x80\x7f"):  # 0 and +inf in bfloat16
            damaged = bytearray(payload)
            damaged[0:2] = scale
            with pytest.raises(CorruptRecordError, match="scale that is not finite and positive"):
                codec.decode(damaged, out)
    else:
        with pytest.raises(CorruptRecordError, match="zstd"):
            codec.decode(bytes(len(payload)), out)


def test_zstd_frame_of_another_size_is_refused_before_decoding() -> None:
    import zstandard

    codec = build_codec(CodecKind.ZSTD, SHAPE, torch.bfloat16)
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 24))
    with pytest.raises(CorruptRecordError, match=f"decodes to {1 << 24} bytes, expected a block of"):
        codec.decode(bomb, torch.empty(SHAPE, dtype=torch.bfloat16))


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"quantizes float32, float16 or bfloat16 KV, not torch\.uint8; give the "
                                          r"KV's element dtype"):
        build_codec(CodecKind.INT8, (2, 2, 4, 1, 64), torch.uint8)
    with pytest.raises(ConfigError, match=r"not torch\.float8_e4m3fn"):
        build_codec(CodecKind.FP8, (2, 2, 4, 1, 64), torch.uint8, element_dtype=torch.float8_e4m3fn)
    with pytest.raises(ConfigError, match="a key row of 32 elements does not split into groups of 48"):
        build_codec(CodecKind.INT8, (2, 2, 4, 1, 64), torch.uint8, element_dtype=torch.float16, group=48)
    with pytest.raises(ConfigError, match="only opaque uint8 ones"):
        build_codec(CodecKind.INT8, SHAPE, torch.float16, element_dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="even number for 4-bit values"):
        build_codec(CodecKind.K8V4, (2, 2, 16, 1, 7), torch.float16)


def test_missing_zstandard_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    with pytest.raises(ConfigError,
                       match=r"the zstd codec needs the zstandard package: pip install 'kvstrata\[codec\]'"):
        build_codec(CodecKind.ZSTD, SHAPE, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(CodecKind))
def test_device_blocks_encode_and_decode_on_the_device(kind: CodecKind) -> None:
    x = kv()
    codec = build_codec(kind, SHAPE, torch.bfloat16)
    on_host = codec.encode(x)
    on_device = codec.encode(x.cuda())
    assert on_host is not None and on_device is not None
    out = torch.empty(SHAPE, dtype=torch.bfloat16, device="cuda")
    codec.decode(bytes(on_device), out)
    host_out = torch.empty_like(x)
    codec.decode(bytes(on_host), host_out)
    if kind.lossy:
        assert isinstance(codec, ScaledCodec)
        assert bool(((out.cpu().float() - x.float()).abs() <= codec.error_bound(x)).all())
    else:
        assert bytes(on_device) == bytes(on_host)
        assert torch.equal(out.cpu().view(torch.uint8), x.view(torch.uint8))


def test_each_codec_is_registered_with_a_config_of_its_own() -> None:
    assert {k.label for k in CodecKind} <= set(CODECS.names())  # (with any a test registered from outside)
    for kind in CodecKind:
        config = codec_config(kind.label.upper())
        assert config.kind is kind and type(config) is CODECS.get(kind.label)
    assert codec_config({"type": "int8"}) == Int8Config() and codec_config(CodecKind.FP8).lossy
    with pytest.raises(ConfigError, match=r"^w='lz4' is not a registered codec"):
        codec_config("lz4", "w")
    with pytest.raises(ConfigError, match=r"^w: codec 'zstd' has no field 'level'"):
        codec_config({"type": "zstd", "level": 3}, "w")


def test_a_codec_outside_kvstrata_defines_a_kind_of_its_own() -> None:
    kind = CodecKind.define("test_kind_200", 200, lossy=True)
    assert CodecKind.define("test_kind_200", 200, lossy=True) is kind and CodecKind(200) is kind
    assert codec_of_id(200) is kind and parse_codec("test_kind_200") is kind and kind not in list(CodecKind)
    assert repr(kind) == "CodecKind('test_kind_200', 200)" and repr(CodecKind.INT8) == "CodecKind.INT8"
    assert pickle.loads(pickle.dumps(kind)) is kind and copy.deepcopy(CodecKind.K8V4) is CodecKind.K8V4
    with pytest.raises(ConfigError, match=r"codec id 200 is the test_kind_200 codec's already"):
        CodecKind.define("other_kind", 200, lossy=False)
    with pytest.raises(ConfigError, match=r"the codec label 'test_kind_200' has id 200 already"):
        CodecKind.define("test_kind_200", 201, lossy=True)
    for bad_id in (4, 127, 256, True):  # kvstrata's own ids, or none a record's byte holds
        with pytest.raises(ConfigError, match=r"takes an id in \[128, 255\]"):
            CodecKind.define("another", bad_id, lossy=False)
    with pytest.raises(ConfigError, match="a lower-case identifier"):
        CodecKind.define("Bad Name", 202, lossy=False)
    with pytest.raises(ValueError, match="202 is not a known codec id"):
        CodecKind(202)
