"""``fsdp_reshard_after_forward``: the choice on the driver, and the rule each rank applies (raymoe.spec.reshard)."""

import pytest

from raymoe import DistributedConfig
from raymoe.spec.reshard import KEEP_SHARE, keeps_every_unit, keeps_last_layer


def test_auto_keeps_every_unit_up_to_its_share_of_the_free_memory():
    assert keeps_every_unit("auto", gathered_bytes=100, free_bytes=100 * KEEP_SHARE)
    assert not keeps_every_unit("auto", gathered_bytes=100, free_bytes=100 * KEEP_SHARE - 1)
    assert keeps_last_layer("auto")


@pytest.mark.parametrize("free", [0, 10**15])
def test_always_and_never_do_not_look_at_memory(free):
    assert not keeps_every_unit("always", 100, free) and not keeps_last_layer("always")
    assert keeps_every_unit("never", 100, free) and not keeps_last_layer("never")


def test_the_default_is_auto_and_anything_else_is_one_clear_error():
    assert DistributedConfig(fsdp_size=2).fsdp_reshard_after_forward == "auto"
    with pytest.raises(ValueError, match=r"fsdp_reshard_after_forward='sometimes'.*'auto', 'always' or 'never'"):
        DistributedConfig(fsdp_size=2, fsdp_reshard_after_forward="sometimes")
