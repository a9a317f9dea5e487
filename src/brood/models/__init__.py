"""Models: anything that turns chat messages into text (worker side; builds its own client)."""

from brood.models.base import CallableModel, Completion, Model, resolve_model
from brood.models.openai import OpenAIModel
from brood.models.scripted import ScriptedModel

__all__ = ["CallableModel", "Completion", "Model", "OpenAIModel", "ScriptedModel", "resolve_model"]
