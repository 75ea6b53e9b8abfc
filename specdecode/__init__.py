"""specdecode: lossless speculative decoding. Public API: `LLM`, `SamplingParams`, `StructuredOutput`."""

from specdecode.config import SamplingParams, SpecConfig, SpecDecodeError, StructuredOutput

__all__ = ["LLM", "SamplingParams", "SpecConfig", "SpecDecodeError", "StructuredOutput"]


def __getattr__(name: str):  # keep `import specdecode` light: the engine pulls in torch models
    if name == "LLM":
        from specdecode.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
