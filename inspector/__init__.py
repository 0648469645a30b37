"""inspect-model: megatron-core's real GPTModel, built per pipeline stage in a simulated world."""

__version__ = "0.1.0"
