"""`selfspec models --check`: what a GGUF file or model folder holds and where it loads, read from
its header (files written by gguf's writer, tests/tiny_gguf.py; no tokenizer needed)."""

import json
import subprocess
import sys

import pytest
from tiny_gguf import _linears, _norms, write_tiny

from selfspec.loading.check import check_model_file


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2"])
def test_a_file_read_exactly_loads_in_every_mode(tmp_path, family):
    report = check_model_file(write_tiny(tmp_path / "m.gguf", "IQ4_XS", None, family))
    assert report.loads and report.problem is None
    assert report.types == {"IQ4_XS": len(_linears(family, 512)), "F32": len(_norms(family))}
    assert set(report.modes.values()) <= {"yes", "yes (float32 copy)"}


def test_a_type_without_tiles_is_laid_out_as_q8_0_in_gguf_q8_and_refused_in_gguf(tmp_path):
    report = check_model_file(write_tiny(tmp_path / "m.gguf", "BF16", None))
    assert report.modes["gguf-q8"] == "yes (BF16 laid out as Q8_0)"
    assert report.modes["gguf"] == "no (BF16 not read exactly)"


@pytest.mark.parametrize("type_name", ["Q5_K", "Q5_1", "Q2_K"])
def test_a_type_with_gguf_q8_tiles_only_is_read_there_and_refused_in_gguf(tmp_path, type_name):
    report = check_model_file(write_tiny(tmp_path / "m.gguf", type_name, None))
    assert report.modes["gguf-q8"] == "yes"
    assert report.modes["gguf"] == f"no ({type_name} not read exactly)"


def test_an_architecture_without_an_adapter_loads_nowhere(tmp_path):
    path = write_tiny(tmp_path / "m.gguf", "Q8_0", None)
    data = path.read_bytes().replace(b"llama", b"bloom", 1)  # general.architecture's value
    path.write_bytes(data)
    report = check_model_file(path)
    assert not report.loads
    assert "no adapter for model type 'bloom'" in report.problem


def test_the_command_prints_json_and_fails_when_a_file_does_not_load(tmp_path):
    good = write_tiny(tmp_path / "good.gguf", "Q4_0", None)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "selfspec.cli",
            "models",
            "--check",
            str(good),
            str(folder),
            "--json",
        ],
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    reports = json.loads(done.stdout)
    assert [r["loads"] for r in reports] == [True, False]
    assert reports[0]["types"]["Q4_0"] == len(_linears("llama", 512))
