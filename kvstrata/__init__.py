"""kvstrata: an LLM serving cluster built around the KV cache.

The in-process engine (`LLM`, `SamplingParams`) is imported lazily so that the lighter
subpackages (router, cluster CLI helpers) do not pull in torch at import time.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from kvstrata.worker.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvstrata.worker.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")
