"""Loading a trained run for prediction: which parameters, and the errors that say why not."""

import pytest

from configs import default
from detector.errors import ConfigError
from detector.serving.predictor import load_predictor


def test_raw_params_from_the_best_checkpoint_of_an_ema_run_is_a_config_error(tmp_path):
    config = default.get_config()
    config.optimizer.ema_decay = 0.999
    with pytest.raises(ConfigError, match="--raw_params with --checkpoint=best"):
        load_predictor(config, str(tmp_path), "best", raw_params=True)
