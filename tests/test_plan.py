"""Skip plans: round trip, and every invalid plan explained."""

import json

import pytest

from selfspec.errors import SelfSpecError
from selfspec.runtime.plan import (
    DraftPolicy,
    ModelIdentity,
    build_plan,
    load_plan,
    parse_layer_list,
)

ID = ModelIdentity(name="m", architecture="qwen2", num_layers=4, fingerprint="abcd")


def write(tmp_path, data):
    path = tmp_path / "plan.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def valid():
    return build_plan(ID, [1], [2], DraftPolicy(max_draft_tokens=4)).to_dict()


def test_round_trip_and_first_skipped_sublayer(tmp_path):
    plan = build_plan(ID, [2], [1], DraftPolicy(max_draft_tokens=5, confidence_threshold=0.3))
    plan.save(tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json")
    assert again.to_dict() == plan.to_dict()
    assert again.first_skipped_sublayer() == 3  # layer 1's MLP comes before layer 2's attention
    assert build_plan(ID).first_skipped_sublayer() == 8
    assert not list(tmp_path.glob(".p.json.*")), "no temp files left behind"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda d: d.update(skip_attention=[7]),
            r"'skip_attention' names layer\(s\) \[7\] but the model has layers 0..3",
        ),
        (lambda d: d.update(skip_mlp=["x"]), "'skip_mlp' must be a list of layer indices"),
        (
            lambda d: d.update(skip_attention=[0, 1, 2, 3], skip_mlp=[0, 1, 2, 3]),
            "skips every sublayer",
        ),
        (lambda d: d.update(format_version=99), "unknown plan format_version 99"),
        (
            lambda d: d["policy"].update(max_draft_tokens=0),
            "max_draft_tokens' must be an integer in 1..64",
        ),
        (
            lambda d: d["policy"].update(confidence_threshold=1.5),
            r"confidence_threshold' must be in \[0, 1\)",
        ),
        (lambda d: d["policy"].update(speed=3), r"unknown field\(s\) \['speed'\]"),
        (lambda d: d.pop("model"), "'model' must be an object"),
    ],
)
def test_invalid_plans_are_explained(tmp_path, mutate, message):
    data = valid()
    mutate(data)
    with pytest.raises(SelfSpecError, match=message):
        load_plan(write(tmp_path, data))


def test_malformed_and_missing(tmp_path):
    with pytest.raises(SelfSpecError, match=r"is not valid JSON \(line 1"):
        load_plan(write(tmp_path, "{not json"))
    with pytest.raises(SelfSpecError, match="does not exist"):
        load_plan(tmp_path / "nope.json")


def test_parse_layer_list():
    assert parse_layer_list("3,5, 7", "--skip-attention") == [3, 5, 7]
    assert parse_layer_list("10-12,14", "--skip-mlp") == [10, 11, 12, 14]
    assert parse_layer_list("", "--skip-mlp") == []
    with pytest.raises(SelfSpecError, match="--skip-mlp: 'x' is not a layer index"):
        parse_layer_list("1,x", "--skip-mlp")
