"""The Python API: load a model once, generate many times, with a plan or any drafter.

from selfspec import Engine
engine = Engine.load("qwen2.5-coder-1.5b")
result = engine.generate("def fib(n):", drafter=engine.self_drafter(), on_text=print)
print(result.stats.mean_accepted_length)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from selfspec.drafters import AdaptiveDrafter, Drafter, ModelDrafter, SelfSkipDrafter
from selfspec.drafters.heads import DraftHeads, HeadDrafter
from selfspec.drafters.recycled import WIDTH, RecycledDrafts
from selfspec.errors import SelfSpecError
from selfspec.loading.fingerprint import same_weights_as
from selfspec.loading.models import DEFAULT_MODEL, LoadedModel, check_same_tokenizer, load_model
from selfspec.loading.sources import KNOWN_MODELS, gguf_source, has_gguf_source
from selfspec.memory import return_freed_memory
from selfspec.paths import find_default_plan, find_heads
from selfspec.runtime.decode import DecodeConfig, DecodeStats, generate_ids
from selfspec.runtime.plan import DraftPolicy, SkipPlan, build_plan, check_plan_matches, load_plan
from selfspec.runtime.runner import ModelRunner
from selfspec.runtime.sampling import Sampling
from selfspec.speed.modes import GRAPH_MODES, numerics_note, relaid_types

if TYPE_CHECKING:
    from selfspec.training.history import LearnedTable


def make_runner(loaded: LoadedModel) -> ModelRunner:
    """The runner for a loaded model: on CUDA, fixed-shape passes (replayed as CUDA graphs in the
    graph modes); elsewhere the ordinary runner."""
    if loaded.device.type == "cuda":
        from selfspec.runtime.cuda_graphs import StaticRunner

        graphs = loaded.speed in GRAPH_MODES
        return StaticRunner(loaded, graphs=graphs, compile=loaded.speed == "cuda-compiled")
    return ModelRunner(loaded)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    stats: DecodeStats
    speed_mode: str = "torch"
    device_type: str = "cpu"
    relaid: tuple[str, ...] = ()  # the file's weight types held as Q8_0 (gguf-q8)

    @property
    def numerics_note(self) -> str | None:
        """How the arithmetic that produced the tokens differs from transformers' own; None: it does
        not."""
        return numerics_note(self.speed_mode, self.device_type, self.relaid)

    @property
    def numerics(self) -> str:
        """What arithmetic produced the tokens: the model's own, or how it differs."""
        return self.numerics_note or "the model's own"

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "speed_mode": self.speed_mode,
            "numerics": self.numerics,
            **self.stats.to_dict(),
        }


class TextStream:
    """Turns batches of token ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer, on_text: Callable[[str], None]):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.tokens: list[int] = []
        self.printed = 0

    def __call__(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return
        if len(text) > self.printed:
            self.on_text(text[self.printed :])
            self.printed = len(text)


class Engine:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.relaid = relaid_types(loaded.model)
        self.tokenizer = loaded.tokenizer
        self.runner = make_runner(loaded)
        self.identity = self.runner.adapter.identity(loaded.name)

    @classmethod
    def load(
        cls,
        model: str = DEFAULT_MODEL,
        device: str = "cpu",
        dtype=None,
        speed: str = "auto",
        max_memory: dict | None = None,
    ) -> Engine:
        """``speed``: weight layout and kernels (see ``selfspec.speed.modes``); "auto" picks the
        fastest that runs. ``max_memory``: spread the model over devices, e.g. ``{0: "10GiB", "cpu":
        "30GiB"}`` (sizes in bytes or as text; the rest goes to disk; see
        ``selfspec.loading.placement``)."""
        if max_memory is not None:
            from selfspec.loading.placement import check_max_memory

            max_memory = check_max_memory(max_memory)
            speed = "torch" if speed == "auto" else speed
        return cls(
            load_model(model, device=device, dtype=dtype, speed=speed, max_memory=max_memory)
        )

    # -- plans and drafters -----------------------------------------------------------------
    def default_plan(self) -> SkipPlan | None:
        """The user's searched plan for this model and speed mode, else the one shipped with
        selfspec (a mode without its own borrows the closest: see ``selfspec.paths``)."""
        path = find_default_plan(self.loaded.key, self.loaded.speed)
        return self.load_plan(path) if path is not None else None

    def load_plan(self, path) -> SkipPlan:
        plan = load_plan(path)
        check_plan_matches(plan, self.identity, source=str(path))
        return plan

    def make_plan(
        self,
        skip_attention=(),
        skip_mlp=(),
        policy: DraftPolicy | None = None,
        provenance: dict | None = None,
    ) -> SkipPlan:
        return build_plan(self.identity, skip_attention, skip_mlp, policy, provenance)

    def self_drafter(
        self,
        plan: SkipPlan | None = None,
        layer_skip: bool = True,
        heads: bool | str | DraftHeads = True,
        recycled: bool = True,
        trees: bool = False,
        head_trees: bool = False,
    ) -> AdaptiveDrafter:
        """The default drafter: context n-gram drafts, draft heads (``heads``: the model's own if
        True, a file's, loaded ones, or none if False), recycled drafts (the model's own earlier
        predictions; none if ``recycled`` is False) and layer-skip drafts with ``plan`` (default:
        the model's plan, if it has one) where they pay, chosen round by round from measured
        costs. ``layer_skip=False``: no layer-skip drafts; ``trees=True``: recycled drafts may
        branch where the loop verifies trees (kernel modes, greedy or sampled; measured not to
        pay on the CPUs in docs/performance.md, hence off); ``head_trees=True``: head drafts may
        (likewise off). Elsewhere drafts stay chains. Works without any plan or heads."""
        skipper = None
        if layer_skip:
            plan = plan or self.default_plan()
            skipper = self.layer_skip_drafter(plan) if plan is not None else None
        head_drafter = self._head_drafter(heads) if heads else None
        recycler = RecycledDrafts(self.runner, width=WIDTH if trees else 1) if recycled else None
        drafter = AdaptiveDrafter(
            self.runner.head_rows,
            skipper,
            heads=head_drafter,
            recycled=recycler,
            trees=trees,
            head_trees=head_trees,
        )
        return_freed_memory()  # what building the drafters freed
        return drafter

    def learned_table(self) -> LearnedTable:
        """Where ``--learn`` keeps this model's table of recycled drafts between runs:
        ``resume(drafter)`` before generating, ``save(drafter)`` after."""
        from selfspec.training.history import LearnedTable

        return LearnedTable.for_model(self.loaded.key, self.loaded.model.config.vocab_size)

    def _head_drafter(self, heads: bool | str | DraftHeads) -> HeadDrafter | None:
        found = self.resolve_heads(heads)
        return HeadDrafter(self.runner, found, self.eos_ids()) if found else None

    def default_heads(self) -> DraftHeads | None:
        """The draft heads trained for this model (``selfspec train-heads``), if any; else, for a
        GGUF file that holds a bundled model's weights quantized another way, that model's
        (``selfspec.loading.fingerprint``)."""
        path = find_heads(self.loaded.key)
        if path is not None:
            return self.load_heads(path)
        donor = self.weights_of
        path = find_heads(donor) if donor is not None else None
        if path is None:
            return None
        heads = self.load_heads(path)
        heads.borrowed_from = donor
        return heads

    @cached_property
    def weights_of(self) -> str | None:
        """The bundled model whose weights this model's GGUF file holds, if another file."""
        loaded = self.loaded
        if loaded.name in KNOWN_MODELS or not has_gguf_source(loaded.name, loaded.path):
            return None
        return same_weights_as(gguf_source(loaded.name, loaded.path))

    def resolve_heads(self, heads: bool | str | DraftHeads) -> DraftHeads | None:
        """Draft heads as ``self_drafter`` takes them: True (the model's own, if any), a file,
        loaded heads, or False (none)."""
        if isinstance(heads, DraftHeads):
            return heads
        if heads is True:
            return self.default_heads()
        return self.load_heads(heads) if heads else None

    def load_heads(self, path) -> DraftHeads:
        return DraftHeads.load(path, hidden_size=self.loaded.model.config.hidden_size)

    def layer_skip_drafter(self, plan: SkipPlan | None = None) -> SelfSkipDrafter:
        """The target drafting for itself with ``plan``'s sublayers skipped, every round."""
        plan = plan or self.default_plan()
        if plan is None:
            name = self.loaded.name
            raise SelfSpecError(
                f"no skip plan for {name}: pass one, or run `selfspec search --model {name}`."
            )
        check_plan_matches(plan, self.identity)
        return SelfSkipDrafter(self.runner, plan, stop_ids=self.eos_ids())

    def model_drafter(self, draft: str | LoadedModel | Engine) -> ModelDrafter:
        if isinstance(draft, Engine):
            draft = draft.loaded
        if isinstance(draft, str):
            draft = load_model(
                draft,
                device=str(self.loaded.device),
                dtype=self.loaded.dtype,
                speed=self.loaded.speed,
            )
        check_same_tokenizer(self.loaded.name, self.tokenizer, draft.name, draft.tokenizer)
        return ModelDrafter(make_runner(draft))

    # -- generation ---------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            raise SelfSpecError(
                f"the prompt must be text (str) or a list of token ids, got {type(prompt).__name__}"
            )
        if not prompt or not prompt.strip():
            raise SelfSpecError("the prompt is empty: give some text to continue.")
        if chat:
            return self.encode_messages([{"role": "user", "content": prompt}])
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not ids:  # only characters this tokenizer drops (control characters, say)
            raise SelfSpecError("the prompt is empty once tokenized: give some text to continue.")
        return ids

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """A conversation ([{"role": ..., "content": ...}, ...]) through the model's chat
        template, ready for the assistant's turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise SelfSpecError(f"{self.loaded.name} has no chat template; drop --chat.")
        return list(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )

    def eos_ids(self) -> tuple[int, ...]:
        ids = set()
        for source in (self.loaded.model.generation_config, self.loaded.model.config):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def decode_config(self, source: Drafter | SkipPlan | None = None, **overrides) -> DecodeConfig:
        """Decode settings: defaults, then what the drafter brings (a layer-skip plan's draft
        policy; a plan given directly counts as its layer-skip drafter), then explicit overrides."""
        config = DecodeConfig(eos_token_ids=self.eos_ids())
        if isinstance(source, SkipPlan):
            source = SelfSkipDrafter(self.runner, source)
        for key, value in (source.policy_defaults() if source is not None else {}).items():
            setattr(config, key, value)
        for key, value in overrides.items():
            if value is not None:
                setattr(config, key, value)
        return config

    def generate(
        self,
        prompt: str | list[int],
        drafter: Drafter | None = None,
        *,
        max_new_tokens: int = 128,
        sampling: Sampling | None = None,
        seed: int | None = None,
        chat: bool = False,
        stop_strings: tuple[str, ...] = (),
        max_draft_tokens: int | None = None,
        on_text: Callable[[str], None] | None = None,
        config: DecodeConfig | None = None,
    ) -> GenerationResult:
        prompt_ids = list(prompt) if isinstance(prompt, list) else self.encode(prompt, chat=chat)
        config = config or self.decode_config(
            drafter,
            max_new_tokens=max_new_tokens,
            sampling=sampling or Sampling(),
            seed=seed,
            stop_strings=tuple(stop_strings),
            max_draft_tokens=max_draft_tokens,
        )
        stream = TextStream(self.tokenizer, on_text) if on_text else None
        ids, stats = generate_ids(
            self.runner, prompt_ids, config, drafter, self.tokenizer, on_tokens=stream
        )
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return GenerationResult(
            text,
            ids,
            len(prompt_ids),
            stats,
            self.loaded.speed,
            self.loaded.device.type,
            self.relaid,
        )
