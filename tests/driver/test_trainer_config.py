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
        (
            {"report_to": "tensorbord"},
            r"report_to='tensorbord' names unknown tracker\(s\) tensorbord; allowed: tensorboard, mlflow, wandb, "
            r"trackio, all, none",
        ),
        ({"report_to": ["wandb", 3]}, r"report_to=\['wandb', 3\] must be a str or a list of str"),
        ({"report_to": ["none", "wandb"]}, r"report_to=\['none', 'wandb'\]: 'none' and 'all' stand alone"),
        ({"run_name": ""}, r"run_name='' must be None or a non-empty str"),
        ({"logging_dir": 3}, r"logging_dir=3 must be None or a directory path"),
    ],
)
def test_trainer_config_rejects_bad_values(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(output_dir=tmp_path, **kwargs)
    assert TrainerConfig(output_dir=tmp_path, steps=25).schedule().warmup_steps == 2  # default: a tenth


def test_report_to_is_normalised_to_the_tracker_names(tmp_path):
    from raymoe.driver.trackers.names import TRACKERS, installed

    assert TrainerConfig(output_dir=tmp_path).report_to == ()  # default "none"
    assert TrainerConfig(output_dir=tmp_path, report_to="none").trackers == ()
    assert TrainerConfig(output_dir=tmp_path, report_to=[]).trackers == ()
    assert TrainerConfig(output_dir=tmp_path, report_to="all").trackers == tuple(n for n in TRACKERS if installed(n))
    if installed("tensorboard") and installed("mlflow"):
        config = TrainerConfig(output_dir=tmp_path, report_to=["mlflow", "tensorboard", "mlflow"])
        assert config.report_to == ("mlflow", "tensorboard")  # each once, in the order given
