"""Models: anything that turns chat messages into text, held by the supervisor's gateway;
and what their calls cost (prices)."""

from brood.models.base import CallableModel, Completion, Model, resolve_model
from brood.models.openai import OpenAIModel
from brood.models.prices import Price
from brood.models.scripted import ScriptedModel

__all__ = [
    "CallableModel",
    "Completion",
    "Model",
    "OpenAIModel",
    "Price",
    "ScriptedModel",
    "resolve_model",
]
