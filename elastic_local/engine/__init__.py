"""Running the resident model: budgets, caches, generation with elastic budget control, chat."""

from .chat import Chat
from .elastic_model import ElasticModel
from .events import CatchUp, Done, Result, Stats, Switch, Token
from .generate import Generation
from .load import load
from .phases import Request
from .stream import Stream
from .tokenizer import Tokenizer

__all__ = ["CatchUp", "Chat", "Done", "ElasticModel", "Generation", "Request", "Result", "Stats", "Stream", "Switch",
           "Token", "Tokenizer", "load"]
