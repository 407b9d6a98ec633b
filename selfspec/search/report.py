"""What a search leaves beside its plan: report.md and importance.png."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.figures import figure_png, pyplot
from selfspec.fileio import atomic_write_bytes, atomic_write_text
from selfspec.search.space import param_name, plan_args

if TYPE_CHECKING:
    import optuna

    from selfspec.runtime.plan import SkipPlan
    from selfspec.search.cost_model import CostModel
    from selfspec.search.result import SearchResult

POLICY_PARAMS = ("max_draft_tokens", "confidence_threshold", "adaptive_threshold")


def sublayer_importances(study: optuna.Study, num_layers: int) -> tuple[dict[str, float], str]:
    """Optuna parameter importances (fANOVA, else PED-ANOVA); ({}, reason) when they cannot be
    computed."""
    import optuna

    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if len(complete) < 5:
        return {}, f"only {len(complete)} completed trials (need 5)"
    errors = []
    for name in ("FanovaImportanceEvaluator", "PedAnovaImportanceEvaluator"):
        try:
            evaluator = getattr(optuna.importance, name)()
            return dict(optuna.importance.get_param_importances(study, evaluator=evaluator)), name
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return {}, "; ".join(errors)


def skip_effects(ranked: list, num_layers: int) -> dict[str, float]:
    """Mean predicted speedup of completed trials skipping a sublayer minus that of those keeping
    it."""
    effects = {}
    for kind in ("attn", "mlp"):
        for i in range(num_layers):
            name = param_name(kind, i)
            on = [t.value for t in ranked if t.params.get(name)]
            off = [t.value for t in ranked if not t.params.get(name)]
            if on and off:
                effects[name] = statistics.fmean(on) - statistics.fmean(off)
    return effects


# ---------------------------------------------------------------------------------- the plot


def _bars(ax, layers: list[int], attention: list[float], mlp: list[float]) -> None:
    width = 0.4
    ax.bar([i - width / 2 for i in layers], attention, width, label="attention", color="tab:blue")
    ax.bar([i + width / 2 for i in layers], mlp, width, label="MLP", color="tab:orange")


def _importance_panel(ax, importances: dict[str, float], method: str, layers: list[int]) -> None:
    if importances:
        _bars(
            ax,
            layers,
            [importances.get(param_name("attn", i), 0) for i in layers],
            [importances.get(param_name("mlp", i), 0) for i in layers],
        )
        policy = ", ".join(f"{k} {importances.get(k, 0):.2f}" for k in POLICY_PARAMS)
        evaluator = method.replace("ImportanceEvaluator", "")
        ax.set_title(
            f"skip-flag importance for predicted speedup ({evaluator})\npolicy: {policy}",
            fontsize=9,
        )
        ax.legend(fontsize=8)
    else:
        ax.text(
            0.5,
            0.5,
            f"importances unavailable: {method}",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=8,
            wrap=True,
        )
    ax.set_ylabel("importance")


def _skipped_panel(ax, top: list, plan: SkipPlan, layers: list[int]) -> None:
    def share(kind: str, i: int) -> float:
        return sum(bool(t.params.get(param_name(kind, i))) for t in top) / len(top)

    if top:
        _bars(ax, layers, [share("attn", i) for i in layers], [share("mlp", i) for i in layers])
    for i in plan.skip_attention:
        ax.plot(i - 0.2, 1.05, "v", color="tab:blue")
    for i in plan.skip_mlp:
        ax.plot(i + 0.2, 1.05, "v", color="tab:orange")
    ax.set_ylim(0, 1.15)
    ax.set_ylabel(f"skipped in top {len(top)} trials")
    ax.set_xlabel("layer (triangles: skipped by the written plan)")
    ax.set_xticks(layers)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)


def write_importance_plot(study: optuna.Study, ranked: list, plan: SkipPlan, path: Path) -> Path:
    num_layers = plan.model.num_layers
    importances, method = sublayer_importances(study, num_layers)
    layers = list(range(num_layers))
    fig, axes = pyplot().subplots(2, 1, figsize=(max(8, num_layers * 0.32), 7), sharex=True)
    _importance_panel(axes[0], importances, method, layers)
    _skipped_panel(axes[1], ranked[:10], plan, layers)
    fig.suptitle(f"{plan.model.name}: which sublayers mattered", fontsize=11)
    atomic_write_bytes(path, figure_png(fig))
    return path


# -------------------------------------------------------------------------------- the report


def _layers_text(layers: list[int]) -> str:
    return ",".join(map(str, layers)) if layers else "-"


def _header(result: SearchResult) -> list[str]:
    plan, prov = result.plan, result.plan.provenance
    return [
        f"# selfspec search report: {plan.model.name}",
        "",
        f"- command: `{prov.get('how')}`",
        f"- date: {prov.get('date')}; device: {prov.get('device')}; dtype: {prov.get('dtype')}",
        f"- study: `{result.study_name}` in `{result.storage}`: {result.trials} trials "
        f"({result.completed} complete, {result.pruned} pruned)"
        f"{'; interrupted' if result.interrupted else ''}",
        f"- calibration: {prov.get('prompts')} ({prov.get('prompt_count')} prompts, chat template "
        f"{'on' if prov.get('chat_template') else 'off'}), {prov.get('tokens')} greedy tokens each",
    ]


def _result_section(result: SearchResult) -> list[str]:
    plan, prov = result.plan, result.plan.provenance
    lines = [
        "",
        "## Result",
        "",
        plan.describe(),
        "",
        f"- skip attention: {_layers_text(plan.skip_attention)}",
        f"- skip MLP: {_layers_text(plan.skip_mlp)}",
        f"- predicted speedup (speed model): {result.predicted_speedup:.2f}x, predicted acceptance "
        f"{prov.get('predicted_acceptance_rate')}, predicted mean accepted length "
        f"{prov.get('predicted_mean_accepted_length')}",
    ]
    if result.measured_speedup is None:
        return lines + ["- not confirmed by real generation (--confirm 0 or interrupted)"]
    fallback_note = (
        "with the decode loop's fallback to plain decoding on"
        if prov.get("measured_with_fallback")
        else "fallback to plain decoding off, so this is the plan's own speed"
    )
    lines += [
        f"- measured speedup (real greedy generation, median over prompts, decode phase, "
        f"{fallback_note}): **{result.measured_speedup:.2f}x** "
        f"({prov.get('measured_speedup_end_to_end'):.2f}x end to end with prefill)",
        f"- measured mean accepted length {prov.get('mean_accepted_length'):.2f}, acceptance "
        f"{prov.get('acceptance_rate'):.2f}",
    ]
    if not result.beats_plain:
        lines += [
            "",
            "**No confirmed plan beat plain decoding on this machine.** The fastest one "
            "was written anyway; the decode loop falls back to plain decoding when "
            "speculation is measurably slower.",
        ]
    return lines


def _costs_section(costs: CostModel | None, plan: SkipPlan) -> list[str]:
    if costs is None:
        return []
    L = plan.model.num_layers
    draft = costs.draft_step(
        L - len(plan.skip_attention), L - len(plan.skip_mlp), plan.policy.draft_vocab or 0
    )
    verify = ", ".join(f"k={k}: {v * 1e3:.0f} ms" for k, v in zip(costs.verify_sizes, costs.verify))
    return [
        "",
        "## Cost model (measured once per study)",
        "",
        f"- plain decoding step: {costs.full_step * 1e3:.1f} ms (context {costs.context} tokens)",
        f"- one attention sublayer {costs.attention * 1e3:.2f} ms, one MLP sublayer "
        f"{costs.mlp * 1e3:.2f} ms, embedding+head {costs.base_step * 1e3:.1f} ms",
        f"- output layer over the whole vocabulary: {costs.head * 1e3:.1f} ms of that",
        f"- this plan's draft step: {draft * 1e3:.1f} ms",
        f"- verify pass over k tokens: {verify}",
    ]


def _confirmation_section(confirmations: list[dict]) -> list[str]:
    if not confirmations:
        return []
    fallback = confirmations[0].get("fallback")
    lines = [
        "",
        "## Confirmation (real generation vs plain decoding, interleaved)",
        "",
        "Each candidate and plain decoding generate on every calibration prompt, prompt by "
        "prompt in rotating order; speedup = plain decode seconds / plan decode seconds (prefill "
        "excluded), median over prompts. The speed model predicts speculation throughout; "
        + (
            "here the fallback to plain decoding was on, which lifts plans slower than plain "
            "towards 1.0x."
            if fallback
            else "so is this measurement (fallback off)."
        ),
        "",
        "| trial | predicted | measured (median) | end to end | per prompt | mean accepted | "
        "acceptance | fell back | identical | chosen |",
        "|---:|---:|---:|---:|---|---:|---:|---:|:---:|:---:|",
    ]
    for c in confirmations:
        per_prompt = " ".join(f"{r:.2f}" for r in c["per_prompt_speedup"])
        lines.append(
            f"| {c['trial']} | {c['predicted_speedup']:.2f}x | {c['measured_speedup']:.2f}x | "
            f"{c['measured_speedup_end_to_end']:.2f}x | {per_prompt} | "
            f"{c['mean_accepted_length']:.2f} | {c['acceptance_rate']:.2f} | "
            f"{c['fell_back'] if c.get('fallback') else 'off'} | "
            f"{'yes' if c['identical_output'] else 'NO'} | {'yes' if c.get('chosen') else ''} |"
        )
    return lines


def _top_trials_section(ranked: list, num_layers: int) -> list[str]:
    lines = [
        "",
        "## Top trials (predicted)",
        "",
        "| trial | predicted | acceptance | accepted/round | agreement | attn skipped | "
        "MLP skipped | max draft | threshold | adaptive |",
        "|---:|---:|---:|---:|---:|---|---|---:|---:|:---:|",
    ]
    for t in ranked[:10]:
        sa, sm, pol = plan_args(t.params, num_layers)
        attrs = t.user_attrs
        lines.append(
            f"| {t.number} | {t.value:.2f}x | {attrs.get('acceptance', 0):.2f} | "
            f"{attrs.get('mean_accepted_length', 0):.2f} | {attrs.get('agreement', 0):.2f} | "
            f"{_layers_text(sa)} | {_layers_text(sm)} | {pol['max_draft_tokens']} | "
            f"{pol['confidence_threshold']:g} | {'yes' if pol['adaptive_threshold'] else 'no'} |"
        )
    return lines


def _importance_section(study: optuna.Study, ranked: list, num_layers: int) -> list[str]:
    importances, method = sublayer_importances(study, num_layers)
    lines = ["", "## Which sublayers mattered", ""]
    if importances:
        lines += [
            f"Parameter importance for the predicted speedup ({method}), top 15:",
            "",
            "| parameter | importance |",
            "|---|---:|",
        ]
        lines += [f"| {k} | {v:.3f} |" for k, v in list(importances.items())[:15]]
    else:
        lines.append(f"Optuna importances unavailable ({method}).")
    effects = skip_effects(ranked, num_layers)
    if effects:
        order = sorted(effects.items(), key=lambda kv: kv[1])
        lines += [
            "",
            "Mean predicted speedup of completed trials that skip a sublayer minus those that "
            "keep it (most harmful to skip first, cheapest to skip last):",
            "",
            "- most harmful: " + ", ".join(f"{k} {v:+.2f}" for k, v in order[:6]),
            "- cheapest: " + ", ".join(f"{k} {v:+.2f}" for k, v in order[::-1][:6]),
        ]
    return lines


def write_report_md(study: optuna.Study, ranked: list, result: SearchResult, path: Path) -> Path:
    plan = result.plan
    lines = _header(result) + _result_section(result) + _costs_section(result.costs, plan)
    lines += _confirmation_section(result.confirmations)
    lines += _top_trials_section(ranked, plan.model.num_layers)
    lines += _importance_section(study, ranked, plan.model.num_layers)
    if result.plot_path:
        lines += ["", f"![importance]({result.plot_path.name})"]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
