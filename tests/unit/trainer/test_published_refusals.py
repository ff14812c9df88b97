"""Published configs the trainer refuses (`tests.real_size_configs.REFUSED`): `register`'s check
(`check_model_fits`, config.json only, no torch) and `art-mega plan` refuse each with its one
sentence (plan: exit code 2, that sentence on stderr, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_mega.errors import UserError
from art_mega.launch.cli import main
from art_mega.trainer.model_builder import check_model_fits
from tests.real_size_configs import REFUSED


def _model_dir(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name", list(REFUSED))
def test_register_refuses_in_one_sentence(name: str, tmp_path: Path) -> None:
    config, sentence = REFUSED[name]
    with pytest.raises(UserError) as caught:
        check_model_fits(_model_dir(tmp_path, config), 8, ep=8)
    assert str(caught.value) == sentence


@pytest.mark.parametrize("name", ["Moonlight-16B-A3B", "gemma-4-E2B"])
def test_plan_refuses_with_exit_2(name: str, tmp_path: Path, capsys) -> None:
    config, sentence = REFUSED[name]
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(_model_dir(tmp_path, config)), "--gpu", "H100-80GB", "--tp", "8"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert err.strip() == f"art-mega: error: {sentence}" and "Traceback" not in out + err
