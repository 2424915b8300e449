"""How rank 0 cuts the hub tensors into buckets (``raymoe.rank.weight_stream.buckets_of``), in one process."""

from __future__ import annotations

import torch

from raymoe.rank.weight_stream import buckets_of


def tensors(*numels: int) -> list[tuple[str, torch.Tensor]]:
    """float32 tensors of ``numels`` elements (4 bytes each), views of one storage as split fused experts are."""
    storage = torch.arange(sum(numels), dtype=torch.float32)
    return [(f"t{i}", part) for i, part in enumerate(storage.split(list(numels)))]


def sizes(buckets) -> list[list[int]]:
    return [[tensor.numel() * 4 for _, tensor in bucket] for bucket in buckets]


def test_a_bucket_closes_when_full_or_before_the_tensor_that_would_overflow_it():
    assert sizes(buckets_of(iter(tensors(2, 2, 3, 3, 1)), 16)) == [[8, 8], [12], [12, 4]]
    assert sizes(buckets_of(iter(tensors(1, 1, 1)), 1000)) == [[4, 4, 4]]
    assert sizes(buckets_of(iter([]), 16)) == []


def test_a_tensor_larger_than_a_bucket_is_a_bucket_alone():
    assert sizes(buckets_of(iter(tensors(1, 10, 1)), 16)) == [[4], [40], [4]]
    assert sizes(buckets_of(iter(tensors(3, 2)), 1)) == [[12], [8]]


def test_buckets_hold_cpu_copies_with_storage_of_their_own():
    """A view would pickle its whole storage (the fused parameter), and on a one-rank world alias the live weight."""
    source = tensors(3, 5)
    out = [item for bucket in buckets_of(iter(source), 1) for item in bucket]
    for (name, original), (got_name, got) in zip(source, out, strict=True):
        assert name == got_name and torch.equal(got, original) and got.device.type == "cpu"
        assert got.untyped_storage().nbytes() == got.numel() * 4
        assert got.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()


def test_buckets_are_cut_lazily():
    """Rank 0 gathers a parameter only when the bucket being filled needs it: the walk's pace is the buckets'."""
    pulled = []

    def walk():
        for name, tensor in tensors(2, 2, 2, 2):
            pulled.append(name)
            yield name, tensor

    buckets = buckets_of(walk(), 16)
    assert len(next(buckets)) == 2 and pulled == ["t0", "t1"]
    assert len(next(buckets)) == 2 and pulled == ["t0", "t1", "t2", "t3"]
