"""MXFP4 checkpoints: dequantization against a per-element decoder, blocks read by slice, byte counts, errors.

The tensors are quantized here, from the documented format (e8m0 scale per 32 values, e2m1 codes,
two per byte, low nibble first), independently of raymoe's decoder.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from raymoe.checkpoint import CheckpointReader, CheckpointWriter
from raymoe.checkpoint.mxfp4 import E2M1_VALUES, dequantize_mxfp4
from raymoe.models.common.hub_layout import HubLayout, Mxfp4, Transpose

LAYOUT: HubLayout = {"w": Mxfp4("w_blocks", "w_scales")}
E, R, G = 4, 6, 3  # w [4, 6, 96]


def decode_slowly(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One value at a time, straight from the format description; float64."""
    *lead, groups, width = blocks.shape
    out = torch.empty(*lead, groups * 2 * width, dtype=torch.float64)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in out.shape)).reshape(-1, out.dim()).tolist():
        *row, col = index
        byte = int(blocks[(*row, col // 32, (col % 32) // 2)])
        nibble = byte & 0xF if col % 2 == 0 else byte >> 4
        out[tuple(index)] = E2M1_VALUES[nibble] * 2.0 ** (int(scales[(*row, col // 32)]) - 127)
    return out


def save_mxfp4(directory, blocks, scales, **extra):
    save_file({"w_blocks": blocks, "w_scales": scales, **extra}, directory / "model.safetensors")
    return directory


def test_the_quantizer_and_the_slow_decoder_agree_on_exact_mxfp4_weights(quantize_mxfp4, exact_mxfp4_weights):
    weights = exact_mxfp4_weights((3, 64))
    blocks, scales = quantize_mxfp4(weights)
    assert blocks.shape == (3, 2, 16) and scales.shape == (3, 2)
    assert torch.equal(decode_slowly(blocks, scales), weights.double())


def test_known_bytes_decode_low_nibble_first():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x72  # low 2 (+1.0), high 7 (+6.0)
    blocks[0, 0, 1] = 0x9F  # low 15 (-6.0), high 9 (-0.5)
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2 ** 1
    out = dequantize_mxfp4(blocks, scales)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 32)
    assert out[0, :4].tolist() == [2.0, 12.0, -12.0, -1.0]
    assert not out[0, 4:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_reproduces_exact_mxfp4_weights(dtype, quantize_mxfp4, exact_mxfp4_weights):
    weights = exact_mxfp4_weights((E, R, G * 32), seed=1)
    blocks, scales = quantize_mxfp4(weights)
    out = dequantize_mxfp4(blocks, scales, dtype=dtype)
    assert out.dtype == dtype and out.shape == weights.shape
    assert torch.equal(out.double(), weights.double())
    assert torch.equal(out.double(), decode_slowly(blocks, scales))


def test_dequantize_random_weights_within_half_a_step(quantize_mxfp4):
    weights = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)) * 0.02
    blocks, scales = quantize_mxfp4(weights)
    out = dequantize_mxfp4(blocks, scales, dtype=torch.float32)
    assert torch.equal(out.double(), decode_slowly(blocks, scales))
    # e2m1 steps are 0.5 below 2, 1 up to 4 and 2 up to 6 (times the scale): half a step is <= max(scale, |x|) / 4
    scale = torch.exp2(scales.double() - 127).repeat_interleave(32, dim=-1)
    assert ((out.double() - weights.double()).abs() <= torch.maximum(scale, weights.double().abs()) / 4).all()
    assert torch.equal(out.to(torch.bfloat16), dequantize_mxfp4(blocks, scales))  # exact in bf16 too


def test_extreme_scales():
    blocks = torch.zeros(3, 1, 16, dtype=torch.uint8)
    blocks[:, 0, 0] = 0x31  # +0.5, +1.5
    scales = torch.tensor([[0], [254], [255]], dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        out = dequantize_mxfp4(blocks, scales, dtype=dtype).double()
        assert out[0, :2].tolist() == [2.0**-128, 1.5 * 2.0**-127]
        assert out[1, :2].tolist() == [2.0**126, 1.5 * 2.0**127]
        assert out[2].isnan().all()  # e8m0 255 is NaN


def test_dequantize_refuses_bad_inputs():
    blocks, scales = torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"must be uint8, got torch\.int8 and torch\.uint8"):
        dequantize_mxfp4(blocks.to(torch.int8), scales)
    with pytest.raises(ValueError, match=r"blocks \(2, 3, 15\) and scales \(2, 3\) do not fit"):
        dequantize_mxfp4(blocks[..., :15], scales)
    with pytest.raises(ValueError, match=r"blocks \(2, 3, 16\) and scales \(2, 2\) do not fit"):
        dequantize_mxfp4(blocks, scales[:, :2])


@pytest.fixture
def checkpoint(tmp_path, quantize_mxfp4, exact_mxfp4_weights):
    weights = exact_mxfp4_weights((E, R, G * 32), seed=3)
    blocks, scales = quantize_mxfp4(weights)
    return save_mxfp4(tmp_path, blocks, scales), weights, dequantize_mxfp4(blocks, scales)


@pytest.mark.parametrize(
    "index",
    [
        (slice(1, 3),),  # experts 1..2 (an EP shard)
        (slice(None), slice(2, 5)),  # rows 2..4 of every expert (a TP row shard)
        (slice(None), slice(None), slice(32, 64)),  # one whole 32-value block of columns
        (slice(1, 4), slice(0, 3), slice(5, 70)),  # columns not aligned to 32, across three blocks
        (slice(None), slice(5, 6), slice(33, 34)),  # one column
        (slice(0, 2), slice(None), slice(50, 90)),  # starting past the middle of a block
        (slice(-1, None), slice(None), slice(64, None)),
        (slice(2, 2),),  # empty
    ],
)
def test_block_of_mxfp4_equals_slice_of_whole(checkpoint, index):
    directory, weights, whole = checkpoint
    with CheckpointReader(directory, LAYOUT) as reader:
        assert reader.shape("w") == (E, R, G * 32) and reader.dtype("w") == torch.bfloat16
        assert torch.equal(reader.read("w"), whole) and torch.equal(whole.double(), weights.double())
        block = reader.read("w", index)
    assert block.dtype == torch.bfloat16
    assert torch.equal(block, whole[index])


def test_transposed_mxfp4(checkpoint):
    directory, _, whole = checkpoint
    with CheckpointReader(directory, {"t": Transpose(Mxfp4("w_blocks", "w_scales"))}) as reader:
        assert reader.shape("t") == (E, G * 32, R)
        index = (slice(1, 3), slice(50, 70), slice(1, 4))
        assert torch.equal(reader.read("t", index), whole.transpose(-2, -1)[index])


def test_a_block_reads_only_its_groups_and_scales(checkpoint, monkeypatch):
    directory, _, _ = checkpoint
    with CheckpointReader(directory, LAYOUT) as reader:
        assert reader.bytes_read == 0
        reads = []
        real_read = reader.files.read
        monkeypatch.setattr(
            reader.files, "read", lambda key, block: reads.append((key, block)) or real_read(key, block)
        )
        reader.read("w", (slice(1, 3), slice(2, 5), slice(40, 70)))  # columns 40..69: groups 1 and 2
        assert reads == [
            ("w_blocks", ((1, 3), (2, 5), (1, 3), (0, 16))),
            ("w_scales", ((1, 3), (2, 5), (1, 3))),
        ]
        first = 2 * 3 * 2 * 16 + 2 * 3 * 2  # uint8 bytes of those blocks and scales
        assert reader.bytes_read == first
        reader.read("w")
        assert reader.bytes_read == first + E * R * G * 17  # cumulative
        reader.read("w", (slice(0, 0),))  # empty: nothing read
        assert reader.bytes_read == first + E * R * G * 17


def test_check_names_bad_mxfp4_tensors(tmp_path):
    b, s = torch.zeros(E, R, G, 16, dtype=torch.uint8), torch.zeros(E, R, G, dtype=torch.uint8)
    cases = [
        (b.float(), s, "wrong dtype (1): w: MXFP4 tensor w_blocks is stored as F32, expected U8"),
        (b, s.to(torch.int8), "wrong dtype (1): w: MXFP4 tensor w_scales is stored as I8, expected U8"),
        (b[..., :8], s, "wrong shape (1): w: MXFP4 blocks w_blocks are (4, 6, 3, 8), expected [..., R, G, 16]"),
        (b, s[:, :5], "wrong shape (1): w: MXFP4 scales w_scales are (4, 5, 3), expected (4, 6, 3)"),
        (b[:, :, :2], s[:, :, :2], "wrong shape (1): w: checkpoint (4, 6, 64), model (4, 6, 96)"),
        (b, None, "missing (1): w_scales"),
    ]
    for i, (blocks, scales, expected) in enumerate(cases):
        tensors = {"w_blocks": blocks} if scales is None else {"w_blocks": blocks, "w_scales": scales}
        directory = tmp_path / str(i)
        directory.mkdir()
        save_file({key: tensor.contiguous() for key, tensor in tensors.items()}, directory / "model.safetensors")
        with CheckpointReader(directory, LAYOUT) as reader, pytest.raises(ValueError) as info:
            reader.check({"w": (E, R, G * 32)}, "Toy")
        assert "does not match Toy" in str(info.value) and expected in str(info.value), (expected, str(info.value))


def test_good_checkpoint_passes_check(checkpoint):
    directory, _, _ = checkpoint
    with CheckpointReader(directory, LAYOUT) as reader:
        reader.check({"w": (E, R, G * 32)}, "Toy")


def test_the_writer_refuses_mxfp4(tmp_path):
    writer = CheckpointWriter(tmp_path, layout=LAYOUT)
    with pytest.raises(ValueError, match="'w_blocks'/'w_scales': raymoe does not write MXFP4 tensors"):
        writer.write_parameter("w", torch.zeros(E, R, G * 32))
    writer.abort()
    assert not list(tmp_path.glob("model*.safetensors"))


def test_decoding_in_chunks_gives_the_whole_decode(monkeypatch, quantize_mxfp4):
    """A large tensor is decoded a few rows at a time (bounded temporaries): the same values as in one go."""
    import raymoe.models.common.mxfp4 as mxfp4

    blocks, scales = quantize_mxfp4(torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(0)))
    whole = dequantize_mxfp4(blocks, scales, dtype=torch.float32)
    monkeypatch.setattr(mxfp4, "CHUNK_WEIGHTS", 2 * 128)  # two rows of 128 weights a chunk: 8 chunks, the last short
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales, dtype=torch.float32), whole, rtol=0, atol=0)
