"""The learning-rate schedule: linear warmup, cosine decay to a floor, checked values."""

import itertools
import math

import pytest

from raymoe.driver.schedule import WarmupCosine


def test_warmup_then_cosine_to_the_floor():
    schedule = WarmupCosine(peak_lr=1.0, total_steps=12, warmup_steps=2, min_lr_ratio=0.1)
    lrs = [schedule.lr_at(step) for step in range(14)]
    assert lrs[:3] == [0.5, 1.0, 1.0]  # warmup reaches the peak, decay starts from it
    assert all(a > b for a, b in itertools.pairwise(lrs[2:12]))  # strictly falling
    assert math.isclose(lrs[11], 0.1) and lrs[12] == lrs[13] == pytest.approx(0.1)
    assert math.isclose(lrs[2 + 9 // 2], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    assert WarmupCosine(2.0, total_steps=1).lr_at(0) == 2.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"peak_lr": 0.0}, r"lr=0.0 must be a number > 0"),
        ({"total_steps": 0}, r"steps=0 must be an int >= 1"),
        ({"warmup_steps": 11}, r"warmup_steps=11 must be an int in \[0, steps=10\]"),
        ({"min_lr_ratio": 2}, r"min_lr_ratio=2 must be in \[0, 1\]"),
    ],
)
def test_schedule_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmupCosine(**{"peak_lr": 1e-3, "total_steps": 10, **kwargs})
