"""Model builders (each returns a ``sections.Network`` of named blocks) and data sources (``models.data``)."""

from . import data
from .attention import build_attention
from .gpt import build_gpt
from .mlp import build_mlp
from .resnet import build_resnet
from .seq2seq import build_seq2seq

__all__ = ["build_resnet", "build_mlp", "build_seq2seq", "build_attention", "build_gpt", "data"]
