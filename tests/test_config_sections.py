"""A config file whose section is not a JSON object, with or without a --set into it: one line
naming the section, exit 2 (never a traceback)."""

from __future__ import annotations

import json

import pytest

from stablejax.training.config import ConfigError, load_config, load_run_file


@pytest.mark.parametrize("content", ['{"train": 5}', '{"model": null}', '{"train": [1, 2]}',
                                     '{"stability": "on"}', "[1, 2]", '"a string"'])
@pytest.mark.parametrize("overrides", [[], ["train.steps=3"], ["stability.zclip.alpha=0.9"]])
def test_a_section_that_is_not_an_object_is_one_line(tmp_path, content, overrides):
  path = tmp_path / "config.json"
  path.write_text(content)
  with pytest.raises(ConfigError) as e:
    load_config(path, overrides)
  message = str(e.value)
  assert "\n" not in message and str(path) in message and "object" in message
  section = next(iter(json.loads(content)), None) if content.startswith("{") else None
  assert section is None or repr(section) in message
  with pytest.raises(ConfigError):  # a run's own config.json, read back by the programs
    load_run_file(path, overrides)


def test_a_set_through_a_value_that_is_not_an_object_names_it():
  with pytest.raises(ConfigError, match=r"--set train.steps: train is 5 in the config, not a "
                                        r"JSON object"):
    load_config(None, ["train=5", "train.steps=3"])


def test_the_program_says_it_in_one_line_and_exits_2(tmp_path, capsys):
  from stablejax.cli.train import main
  path = tmp_path / "config.json"
  path.write_text('{"train": 5}')
  assert main(["--config", str(path), "--set", "train.steps=3", "--out",
               str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and "section 'train' is 5" in err[0]
  assert not (tmp_path / "run").exists()
  path.write_bytes(b"\xff\xfe{}")
  assert main(["--config", str(path), "--out", str(tmp_path / "run")]) == 2
  assert "is not UTF-8 text" in capsys.readouterr().err
