"""Drafters: anything that proposes the next few tokens, behind one small interface (``base``).

- ``AdaptiveDrafter`` (the default, ``self_speculative``): context n-gram drafts where the text
  repeats, layer-skip drafts with a plan where they pay, plain steps otherwise, round by round
  from measured costs.
- ``SelfSkipDrafter`` (``layer_skip``): the target with a plan's sublayers skipped.
- ``HeadDrafter`` (``heads``): small trained heads on the last verify pass's final hidden state.
- ``ModelDrafter`` (``dual_model``): a separate, smaller model of the same family.

A new drafter is a new class here, never a new loop.
"""

from selfspec.drafters.adaptive import AdaptiveDrafter
from selfspec.drafters.base import Draft, Drafter, DraftRequest, DraftSettings, RoundOutcome
from selfspec.drafters.heads import DraftHeads, HeadDrafter
from selfspec.drafters.layerskip import SelfSkipDrafter
from selfspec.drafters.model import ModelDrafter

__all__ = [
    "AdaptiveDrafter",
    "Draft",
    "DraftRequest",
    "DraftSettings",
    "DraftHeads",
    "Drafter",
    "HeadDrafter",
    "ModelDrafter",
    "RoundOutcome",
    "SelfSkipDrafter",
]
