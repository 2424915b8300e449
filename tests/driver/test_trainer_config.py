"""TrainerConfig: every field checked when it is built, before any rank is asked."""

import pytest

from raymoe.driver.trainer_config import TrainerConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch_size": 0}, r"TrainerConfig: global_batch_size=0 must be an int >= 1"),
        ({"gradient_accumulation_steps": True}, r"gradient_accumulation_steps=True must be an int >= 1"),
        ({"eval_every": 0}, r"eval_every=0 must be an int >= 1"),
        ({"lr": -1.0}, r"schedule: lr=-1.0 must be a number > 0"),
        ({"save_adapter": 1}, r"save_adapter=1 must be True or False"),
        ({"save_checkpoint": False}, r"save_checkpoint=False and save_adapter=False leave a save nothing to write"),
    ],
)
def test_trainer_config_rejects_bad_values(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(output_dir=tmp_path, **kwargs)
    assert TrainerConfig(output_dir=tmp_path, steps=25).schedule().warmup_steps == 2  # default: a tenth
