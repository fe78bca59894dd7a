"""Sampling defaults from the served model's own generation config (``--generation-config``).

With ``auto`` (the default, as vLLM's ``--generation-config auto``) a request that omits
``temperature`` or ``top_p`` samples with the model's values: ``generation_config.json`` in
an HF model folder, or a GGUF file's ``general.sampling.temp`` / ``general.sampling.top_p``.
A value the model does not state, and every value under ``none``, is OpenAI's default (1.0).
``top_k`` and repetition penalties are not read: the sampler has neither.
Loaded once with the model; the defaults live as long as the ``ServedModel``.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

log = logging.getLogger(__name__)

GenerationConfigMode = Literal["auto", "none"]
GENERATION_CONFIG_MODES: tuple[str, ...] = ("auto", "none")
_GGUF_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p"}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    source: str = "openai"   # where they come from: "openai", or the file that stated them

    def resolve(self, body: BaseModel) -> tuple[float, float]:
        """A request's (temperature, top_p): its own where it sets them, else these."""
        given = body.model_fields_set
        return (body.temperature if "temperature" in given else self.temperature,
                body.top_p if "top_p" in given else self.top_p)


OPENAI_DEFAULTS = SamplingDefaults()


def _valid(name: str, value: object) -> float | None:
    """The value if the OpenAI routes would accept it in a request, else None (logged)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        if (0.0 <= value <= 2.0) if name == "temperature" else (0.0 < value <= 1.0):
            return float(value)
    log.warning("ignoring the model's %s=%r (out of the OpenAI range)", name, value)
    return None


def _stated(model_path: Path) -> tuple[dict[str, object], str] | None:
    """The model's own sampling values and the file they came from; None if it states none."""
    if model_path.suffix == ".gguf":
        from forkserve.backend.torch.gguf_loader import read_gguf  # the weights' parse

        reader = read_gguf(model_path)
        found = {k: reader.fields[key].contents() for k, key in _GGUF_KEYS.items()
                 if key in reader.fields}
        return (found, str(model_path)) if found else None
    path = model_path / "generation_config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return {k: config[k] for k in ("temperature", "top_p") if k in config}, str(path)


def load_sampling_defaults(model_path: str | Path,
                           mode: GenerationConfigMode = "auto") -> SamplingDefaults:
    """The defaults a request that omits ``temperature`` / ``top_p`` samples with."""
    if mode == "none":
        return OPENAI_DEFAULTS
    stated = _stated(Path(model_path))
    if stated is None:
        return OPENAI_DEFAULTS
    values, source = stated
    picked = {k: v for k, v in ((k, _valid(k, v)) for k, v in values.items()) if v is not None}
    if not picked:
        return OPENAI_DEFAULTS
    return SamplingDefaults(**picked, source=source)
