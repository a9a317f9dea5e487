"""Models: anything that turns chat messages into text (called by the supervisor's model
gateway only; the SDKs of the optional providers are imported when a model is built), and
what their calls cost (prices)."""

from brood.models.anthropic import AnthropicModel
from brood.models.base import CallableModel, Completion, Model, resolve_model
from brood.models.gemini import GeminiModel
from brood.models.openai import OpenAIModel
from brood.models.prices import Price
from brood.models.scripted import ScriptedModel

__all__ = [
    "AnthropicModel",
    "CallableModel",
    "Completion",
    "GeminiModel",
    "Model",
    "OpenAIModel",
    "Price",
    "ScriptedModel",
    "resolve_model",
]
