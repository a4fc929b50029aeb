"""scripts/train.py: a bad config value ends the process with one line; a typo in an option is
Hydra's own message, without a traceback.

The other bad values are tested where they are raised, in this process
(tests/training/test_bad_input.py and the tests of each part); training itself in
tests/training.
"""

from __future__ import annotations

from helpers.scripts import assert_one_error_line, run_script


def test_a_bad_config_value_fails_in_one_line(tmp_path, multi30k_dir, cache_dir) -> None:
    """The layer's error, raised while the model is built, through the script's wrapper.

    The model is built after the data, so the session's cache spares training a tokenizer."""
    result = run_script(
        "train.py",
        "experiment=smoke",
        "logger=csv",
        f"data.local_dir={multi30k_dir}",
        f"paths.log_dir={tmp_path}",
        f"paths.cache_dir={cache_dir}",
        "attention.num_kv_heads=3",
    )
    assert_one_error_line(result, "num_heads (4) must be divisible by num_kv_heads (3)")


def test_a_config_typo_is_hydras_message_without_a_traceback(tmp_path) -> None:
    """Hydra composes before the script's wrapper runs: its own message, no traceback."""
    result = run_script("train.py", "attention=gqx", f"paths.log_dir={tmp_path}")
    assert result.returncode != 0
    assert "Could not find 'attention/gqx'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())  # nothing written
