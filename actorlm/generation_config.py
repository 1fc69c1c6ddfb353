"""The model's sampling defaults: vLLM's ``--generation-config auto|vllm|<dir>``.

``auto`` (the default) reads the model directory's ``generation_config.json`` (for a GGUF file:
the directory the engine resolved it to), ``<dir>`` the one in that folder, ``vllm`` none. As in
vLLM, only what the file sets apart from transformers' ``GenerationConfig`` defaults counts
(``to_diff_dict``), and of that only the sampling fields: ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as the default
``max_tokens``. They replace SamplingParams' defaults for every request that leaves the field
out; a request's own value always wins. A model directory without the file falls back to its
``config.json`` (``GenerationConfig.from_model_config``), as vLLM does. vLLM's
``--override-generation-config`` (JSON, the file's names) sets sampling fields over what was
read (over nothing, with ``vllm``); a field it cannot set is refused by name.
"""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass, field

from actorlm.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# the file's name -> SamplingParams' (vLLM's ``get_diff_sampling_param``)
SAMPLING_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                   "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "max_new_tokens": "max_tokens"}
_INT_FIELDS = ("top_k", "max_new_tokens")
SETTINGS = ("auto", "vllm")  # or a directory
_HINT = "fix the file, or pass --generation-config vllm to ignore it"
OVERRIDE_FLAG = "--override-generation-config"


@dataclass(frozen=True)
class SamplingDefaults:
    """What requests get for the sampling fields they leave out."""

    values: dict = field(default_factory=dict)  # SamplingParams field -> value
    source: str | None = None  # the file they were read from
    setting: str = "auto"

    def get(self, name: str, default):
        return self.values.get(name, default)

    def sampling_params(self) -> SamplingParams:
        """vLLM's ``LLM.get_default_sampling_params()``."""
        return SamplingParams(**self.values)

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.setting == "vllm" and not self.values:
            return "sampling defaults: vLLM's (--generation-config vllm)"
        if self.values:
            shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
            hint = "" if self.setting == "vllm" else "; --generation-config vllm ignores the file"
            return (f"sampling defaults: {shown} from {self.source} (a request's own fields "
                    f"win{hint})")
        if self.source is None:
            return "sampling defaults: vLLM's (the model has no generation config)"
        return f"sampling defaults: vLLM's ({self.source} sets no sampling field)"


def check_setting(setting) -> None:
    """``--generation-config``: auto, vllm, or a directory with a generation_config.json."""
    if not isinstance(setting, str) or not setting:
        raise ValueError(f"--generation-config must be auto, vllm or a directory, got {setting!r}")
    if setting in SETTINGS:
        return
    folder = pathlib.Path(setting).expanduser()
    if not (folder / FILE_NAME).is_file():
        raise ValueError(f"--generation-config: {setting!r} is not auto, vllm or a directory "
                         f"holding a {FILE_NAME}")


def check_overrides(overrides: dict | None) -> dict | None:
    """``--override-generation-config``'s fields, each one a sampling default can take; a
    ValueError naming the first that is not."""
    for name, value in (overrides or {}).items():
        if name not in SAMPLING_FIELDS:
            raise ValueError(f"{OVERRIDE_FLAG}: {name!r} is not a sampling field it can set "
                             f"(one of {', '.join(SAMPLING_FIELDS)})")
        _checked(OVERRIDE_FLAG, name, SAMPLING_FIELDS[name], value, "fix the flag")
    return overrides or None


def load_sampling_defaults(setting: str, model_dir=None, hf_config=None,
                           overrides: dict | None = None) -> SamplingDefaults:
    """The defaults ``setting`` asks for, read from ``model_dir`` (auto) or from the directory
    ``setting`` names, then ``overrides`` (``--override-generation-config``) set over them; a
    ValueError naming the file and the field for one that makes no sense."""
    read = _read_sampling_defaults(setting, model_dir, hf_config)
    if not check_overrides(overrides):
        return read
    source = OVERRIDE_FLAG if read.source is None or not read.values else \
        f"{read.source} and {OVERRIDE_FLAG}"
    return dataclasses.replace(read, values={**read.values, **{
        SAMPLING_FIELDS[name]: value for name, value in overrides.items()}}, source=source)


def _read_sampling_defaults(setting: str, model_dir, hf_config) -> SamplingDefaults:
    check_setting(setting)
    if setting == "vllm":
        return SamplingDefaults(setting=setting)
    folder = pathlib.Path(setting).expanduser() if setting != "auto" else \
        pathlib.Path(model_dir) if model_dir is not None else None
    if folder is None:  # an engine built from prebuilt parts: no model directory
        return SamplingDefaults(setting=setting)
    path = folder / FILE_NAME
    from transformers import GenerationConfig

    if path.is_file():
        try:
            diff = GenerationConfig.from_pretrained(folder, local_files_only=True).to_diff_dict()
        except (OSError, ValueError, TypeError) as exc:  # transformers checks a few fields
            raise ValueError(f"--generation-config: cannot read {path}: {exc} ({_HINT})") \
                from None
    elif hf_config is not None:
        path = folder / "config.json"
        diff = GenerationConfig.from_model_config(hf_config).to_diff_dict()
    else:
        return SamplingDefaults(setting=setting)
    values = {}
    for name, ours in SAMPLING_FIELDS.items():
        value = diff.get(name)
        if value is None:
            continue
        values[ours] = _checked(path, name, ours, value)
    return SamplingDefaults(values, str(path), setting)


def _checked(path, name: str, ours: str, value, hint: str = _HINT):
    kinds = (int,) if name in _INT_FIELDS else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if name in _INT_FIELDS else "a number"
        raise ValueError(f"{path}: {name} must be {kind}, got {value!r} ({hint})")
    try:
        SamplingParams(**{ours: value})
    except ValueError as exc:  # "field: why" in SamplingParams' words
        why = str(exc).split(": ", 1)[-1]
        raise ValueError(f"{path}: {name} {why} ({hint})") from None
    return value
