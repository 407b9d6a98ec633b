"""`selfspec search`: the speed model's replay of the decode loop, studies that resume, clear
errors, and a short real search whose plan is valid and lossless."""

import json

import pytest

from selfspec.errors import SelfSpecError
from selfspec.search import SearchConfig, search_plan
from selfspec.search.cost_model import CostModel, non_decreasing
from selfspec.search.simulate import SimResult, simulate
from selfspec.search.space import params_for, plan_args
from selfspec.search.storage import redact

# ----------------------------------------------------------------------------- the simulation


def flat_verify(calls=None, seconds=1.0):
    def verify(rows, tail):
        if calls is not None:
            calls.append((rows, tail))
        return seconds

    return verify


def run_sim(agree, conf, max_draft=4, threshold=0.0, adaptive=False, draft=0.1, calls=None):
    return simulate(
        agree,
        conf,
        max_draft=max_draft,
        threshold=threshold,
        adaptive=adaptive,
        draft_step_cost=draft,
        verify_cost=flat_verify(calls),
        plain_step_cost=1.0,
    )


def test_all_agree_gives_max_draft_plus_one_tokens_per_round():
    n = 20  # 21-token continuation: c_0 from prefill, 20 left, 4 rounds of 4 drafts + 1
    r = run_sim([True] * n, [1.0] * n, max_draft=4)
    assert (r.tokens, r.rounds, r.drafted, r.accepted, r.draft_steps) == (20, 4, 16, 16, 16)
    assert r.mean_accepted_length == 5.0 and r.acceptance_rate == 1.0
    assert r.seconds == pytest.approx(4 * (4 * 0.1 + 1.0))
    assert r.speedup == pytest.approx(20 / 5.6)


def test_room_left_limits_the_last_round():
    r = run_sim([True] * 7, [1.0] * 7, max_draft=4)  # 7 to emit: 5, then room 2 -> 1 draft + 1
    assert (r.tokens, r.rounds, r.drafted) == (7, 2, 5)


def test_first_disagreement_ends_acceptance():
    # round 1 from c_0 drafts 4, accepts 2 (row 2 disagrees) -> 3 tokens; round 2 has room 2: 1
    # draft, accepted
    r = run_sim([True, True, False, True, True], [1.0] * 5, max_draft=4)
    assert (r.rounds, r.drafted, r.accepted, r.tokens) == (2, 5, 3, 5)
    assert r.acceptance_rate == pytest.approx(3 / 5) and r.mean_accepted_length == pytest.approx(
        2.5
    )
    none = run_sim([False] * 10, [1.0] * 10, max_draft=3)
    assert none.accepted == 0 and none.tokens == none.rounds == 10


def test_threshold_stops_drafting_but_the_step_is_paid():
    calls = []
    r = run_sim([True] * 6, [0.2] * 6, max_draft=4, threshold=0.5, draft=0.1, calls=calls)
    assert (r.tokens, r.rounds, r.drafted, r.accepted) == (6, 6, 0, 0)
    assert r.draft_steps == 5  # the last round has no room to draft, so no step
    # a stopped draft step still hands its hidden state to the verify pass (tail 0), the last round
    # does not
    assert calls == [(1, 0)] * 5 + [(1, 1)]
    assert r.seconds == pytest.approx(5 * 0.1 + 6 * 1.0)
    assert r.speedup < 1.0


def test_threshold_cuts_a_draft_midway():
    conf = [0.9, 0.9, 0.1, 0.9] * 4
    calls = []
    r = run_sim([True] * 16, conf, max_draft=4, threshold=0.5, calls=calls)
    # round 1 from c_0: drafts rows 0,1, stops at row 2 (3 steps) -> 3 tokens, verify over 3 rows,
    # no tail
    assert calls[0] == (3, 0)
    assert r.draft_steps >= r.drafted + 1


def test_adaptive_threshold_rises_after_rejections():
    n = 12
    fixed = run_sim([False] * n, [0.62] * n, max_draft=1, threshold=0.5, adaptive=False)
    adaptive = run_sim([False] * n, [0.62] * n, max_draft=1, threshold=0.5, adaptive=True)
    assert fixed.drafted == n - 1  # every round but the last drafts, and is rejected
    # ema 0.8 -> 0.56 -> ...: the threshold climbs 0.55, 0.60, 0.65; at 0.65 > 0.62 drafting stops
    # for good
    assert adaptive.drafted == 3
    assert adaptive.accepted == fixed.accepted == 0


def test_sim_results_add_up():
    a = SimResult(3, 1, 2, 2, 2, 1.5, 3.0)
    b = SimResult(1, 1, 0, 0, 1, 1.1, 1.0)
    s = a + b
    assert (s.tokens, s.rounds, s.seconds, s.plain_seconds) == (4, 2, pytest.approx(2.6), 4.0)


def test_cost_model():
    costs = CostModel(
        full_step=1.0,
        base_step=0.1,
        attention=0.2,
        mlp=0.25,
        num_layers=2,
        verify_sizes=[1, 2, 4],
        verify=[1.0, 1.2, 1.6],
        verify_base=[0.1, 0.1, 0.2],
    )
    assert costs.draft_step(2, 2) == pytest.approx(1.0)
    assert costs.draft_step(1, 2) == pytest.approx(0.8)
    assert costs.verify_cost(3, 1) == pytest.approx(1.4)  # interpolated
    assert costs.verify_cost(6, 1) == pytest.approx(2.0)  # extrapolated
    assert costs.prefix_fraction(0) == 0.0 and costs.prefix_fraction(4) == pytest.approx(1.0)
    assert costs.prefix_fraction(1) == pytest.approx(0.2 / 0.9)
    # resuming at sublayer 2 of 4 with every row covered by the draft: only half the stack runs
    f = costs.prefix_fraction(2)
    assert costs.verify_cost(2, 0, f) == pytest.approx(0.1 + 0.5 * 1.1)
    assert costs.verify_cost(2, 1, f) == pytest.approx(0.1 + 0.5 * 1.1 + 0.5 * 0.9)
    assert CostModel.from_dict(costs.to_dict()) == costs


def test_helpers():
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert redact("postgresql://me:secret@db/optuna") == "postgresql://me:***@db/optuna"
    assert redact("sqlite:///a/b.db") == "sqlite:///a/b.db"
    params = params_for(4, [1, 3], [2], max_draft=20, threshold=0.33, adaptive=False)
    sa, sm, policy = plan_args(params, 4)
    assert (sa, sm) == ([1, 3], [2])
    assert policy == {
        "max_draft_tokens": 10,
        "confidence_threshold": 0.35,
        "adaptive_threshold": False,
        "draft_vocab": None,
    }
    assert plan_args(params_for(4, draft_vocab=32768), 4)[2]["draft_vocab"] == 32768


# ------------------------------------------------------------------------------- user errors


def cli(argv, capsys):
    from selfspec.cli import main

    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "url, message",
    [
        ("bogus://nowhere", "cannot open Optuna storage 'bogus://nowhere'"),
        ("not a url", "is not a storage URL"),
        ("sqlite:////no/such/folder/study.db", "folder /no/such/folder does not exist"),
        (
            "postgresql://me:secret@127.0.0.1:1/optuna",
            "cannot open Optuna storage 'postgresql://me:***@127.0.0.1:1/optuna'",
        ),
    ],
)
def test_bad_storage_url_is_a_clear_error(url, message, tmp_path, capsys):
    code, err = cli(
        [
            "search",
            "--model",
            "smollm2-135m",
            "--storage",
            url,
            "--out",
            str(tmp_path / "plan.json"),
        ],
        capsys,
    )
    assert code == 2
    assert err.startswith("error: ") and message in err
    assert "secret" not in err and "Traceback" not in err


def test_bad_storage_url_from_the_api(tiny_llama, tmp_path):
    with pytest.raises(SelfSpecError, match="cannot open Optuna storage 'bogus://x'"):
        config = SearchConfig(["t1 t2 t3"], storage="bogus://x", out=tmp_path / "plan.json")
        search_plan(tiny_llama, config, log=None)


def test_empty_prompts_file(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    code, err = cli(
        ["search", "--prompts", str(path), "--out", str(tmp_path / "plan.json")], capsys
    )
    assert code == 2 and f"prompts file {path} holds no prompts" in err


def test_prompts_file_of_the_wrong_shape(tmp_path, capsys):
    path = tmp_path / "wrong.jsonl"
    path.write_text(json.dumps({"question": "What is 2+2?"}) + "\n")
    code, err = cli(
        ["search", "--prompts", str(path), "--out", str(tmp_path / "plan.json")], capsys
    )
    assert code == 2
    assert "line 1: no prompt found" in err and "'turns'" in err and "'prompt'" in err
    path.write_text("[1, 2]\n")
    code, err = cli(
        ["search", "--prompts", str(path), "--out", str(tmp_path / "plan.json")], capsys
    )
    assert code == 2 and "expected a JSON object with 'turns' or 'prompt'" in err


def test_bad_numbers(tmp_path, capsys):
    code, err = cli(["search", "--trials", "0", "--out", str(tmp_path / "p.json")], capsys)
    assert code == 2 and "--trials must be at least 1" in err
    code, err = cli(["search", "--tokens", "2", "--out", str(tmp_path / "p.json")], capsys)
    assert code == 2 and "--tokens must be at least 4" in err


# ------------------------------------------------------------------- studies on a tiny model

TINY_PROMPTS = [
    "t5 t9 t11 t3 t7 t8 t20 t31 t4",
    "t40 t41 t42 t43 t44 t45",
    "t12 t13 t60 t61 t30 t9 t9 t10",
]


def tiny_search(engine, tmp_path, callbacks=(), **kwargs):
    kwargs.setdefault("tokens", 12)
    kwargs.setdefault("confirm", 0)
    kwargs.setdefault("cost_repeats", 1)
    kwargs.setdefault("progress", False)
    config = SearchConfig(TINY_PROMPTS, out=tmp_path / "plan.json", **kwargs)
    return search_plan(engine, config, callbacks=callbacks, log=None)


def study_trials(tmp_path, name):
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'study.db'}").trials


def test_rerunning_resumes_the_study(tiny_llama, tmp_path):
    first = tiny_search(tiny_llama, tmp_path, trials=3)
    assert first.trials == 3 and len(study_trials(tmp_path, first.study_name)) == 3
    second = tiny_search(tiny_llama, tmp_path, trials=5)
    assert second.study_name == first.study_name
    assert second.trials == 5 and len(study_trials(tmp_path, first.study_name)) == 5
    third = tiny_search(tiny_llama, tmp_path, trials=4)  # already has more: runs nothing
    assert third.trials == 5 and len(study_trials(tmp_path, first.study_name)) == 5
    # the continuations and the cost model were computed once, beside the plan and in the study
    assert len(list(tmp_path.glob("calibration-*.json"))) == 1
    assert (tmp_path / "report.md").is_file() and (tmp_path / "importance.png").is_file()
    assert third.costs == first.costs


def test_other_settings_in_the_same_study_are_refused(tiny_llama, tmp_path):
    first = tiny_search(tiny_llama, tmp_path, trials=1)
    with pytest.raises(SelfSpecError, match="was made for other settings"):
        tiny_search(tiny_llama, tmp_path, trials=2, tokens=10, study_name=first.study_name)
    # without --study, other settings get a study of their own
    other = tiny_search(tiny_llama, tmp_path, trials=1, tokens=10)
    assert other.study_name != first.study_name


def test_ctrl_c_stops_cleanly_and_writes_the_best_plan(tiny_llama, tmp_path):
    from selfspec.runtime.plan import load_plan

    def interrupt(study, trial):
        if trial.number == 1:
            raise KeyboardInterrupt

    result = tiny_search(tiny_llama, tmp_path, trials=10, confirm=2, callbacks=[interrupt])
    assert result.interrupted and result.trials == 2
    plan = load_plan(tmp_path / "plan.json")
    assert plan.provenance["interrupted"] is True and plan.provenance["measured_speedup"] is None
    assert plan.provenance["trials"] == 2


def test_out_holding_another_models_plan_is_refused(tiny_llama, tmp_path):
    from selfspec.runtime.plan import ModelIdentity, build_plan

    other = build_plan(ModelIdentity("other", "llama", 4, "0" * 16), [1], [])
    other.save(tmp_path / "plan.json")
    with pytest.raises(SelfSpecError, match="already holds a plan"):
        tiny_search(tiny_llama, tmp_path, trials=1)


def test_current_plan_is_a_warm_start(tiny_llama, tmp_path):
    plan = tiny_llama.make_plan([2], [1])
    plan.save(tmp_path / "plan.json")
    result = tiny_search(
        tiny_llama, tmp_path, trials=2
    )  # the plan may be pruned; trial 1 skips nothing
    first = study_trials(tmp_path, result.study_name)[0]
    assert plan_args(first.params, 4)[:2] == ([2], [1])


# ------------------------------------------------------------------------- real models (slow)


@pytest.mark.slow
def test_speed_model_replays_the_decode_loop_exactly(smollm2):
    """Skipping only the last layer leaves every cached key/value exact, so the teacher-forced draft
    is the real draft and the replay must match real decoding round for round."""
    from selfspec.prompts import load_prompts
    from selfspec.runtime.plan import DraftPolicy
    from selfspec.search.calibration import CalibrationItem
    from selfspec.search.speedmodel import SpeedModel

    engine = smollm2
    L = engine.identity.num_layers
    prompt = load_prompts("spec-bench:coding", limit=1)[0]
    ids = engine.encode(prompt.text, chat=True)
    tokens = 24
    plain = engine.generate(ids, None, max_new_tokens=tokens)
    costs = CostModel(1.0, 0.1, 0.01, 0.02, L, [1, 12], [1.0, 2.0], [0.1, 0.5])
    model = SpeedModel(engine, [CalibrationItem("0", "coding", ids, plain.token_ids)], costs)
    agree, _ = model.draft_predictions(0, [], [])
    assert all(agree)  # nothing skipped: the draft is the model
    for policy in (
        DraftPolicy(4, 0.0, False),
        DraftPolicy(7, 0.0, False),
        # a draft head over the first 64 ids, the stop tokens and the ids the context has used
        # by each position: the replay scores the ids the drafter scores there
        DraftPolicy(4, 0.0, False, draft_vocab=64),
        DraftPolicy(5, 0.6, True),
    ):
        plan = engine.make_plan([L - 1], [L - 1], policy)
        ev = model.evaluate(
            plan.skip_attention,
            plan.skip_mlp,
            policy.max_draft_tokens,
            policy.confidence_threshold,
            policy.adaptive_threshold,
            draft_vocab=policy.draft_vocab or 0,
        )
        config = engine.decode_config(plan, max_new_tokens=tokens, fallback=False)
        real = engine.generate(ids, engine.layer_skip_drafter(plan), config=config)
        assert real.token_ids == plain.token_ids
        s = real.stats
        if policy.confidence_threshold == 0 and not policy.adaptive_threshold:
            assert (ev.sim.rounds, ev.sim.drafted, ev.sim.accepted) == (
                s.target_passes,
                s.drafted,
                s.accepted,
            )
        else:
            # After a rejected draft token the real draft continues from its own token, whose
            # confidence the teacher-forced pass cannot know: with a threshold the replay is
            # close, not exact.
            assert (
                abs(ev.sim.rounds - s.target_passes) <= 2 and abs(ev.sim.drafted - s.drafted) <= 3
            )


@pytest.mark.slow
def test_short_search_writes_a_valid_lossless_plan(smollm2, tmp_path):
    from selfspec.prompts import load_prompts
    from selfspec.runtime.plan import load_plan

    out = tmp_path / "smol" / "plan.json"
    config = SearchConfig(
        "spec-bench:coding",
        limit=1,
        trials=4,
        tokens=16,
        out=out,
        confirm=1,
        cost_repeats=2,
        seed=1,
        progress=False,
        how="pytest",
    )
    result = search_plan(smollm2, config, log=None)
    assert result.plan_path == out and result.trials == 4
    plan = load_plan(out)
    assert plan.to_dict() == result.plan.to_dict()
    prov = plan.provenance
    for key in (
        "how",
        "date",
        "device",
        "dtype",
        "trials",
        "predicted_speedup",
        "measured_speedup",
        "mean_accepted_length",
        "acceptance_rate",
        "prompts",
    ):
        assert key in prov, key
    assert prov["trials"] == 4 and prov["dtype"] == "float32" and prov["how"] == "pytest"
    assert prov["measured_speedup"] is not None and prov["measured_speedup"] > 0
    assert result.confirmations and result.confirmations[0]["identical_output"]
    assert result.confirmations[0]["fallback"] is False and prov["measured_with_fallback"] is False
    assert (out.parent / "report.md").is_file() and (out.parent / "importance.png").is_file()
    assert "## Top trials" in (out.parent / "report.md").read_text()

    drafter = smollm2.layer_skip_drafter(smollm2.load_plan(out))
    prompt = load_prompts("spec-bench:math", limit=1)[0]
    ids = smollm2.encode(prompt.text, chat=True)
    plain = smollm2.generate(ids, None, max_new_tokens=32)
    spec = smollm2.generate(ids, drafter, max_new_tokens=32)
    assert spec.token_ids == plain.token_ids
