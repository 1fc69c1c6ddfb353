"""Pooling models (embeddings, classifiers): ``PoolingParams`` (a request's, vLLM's shape) and
``PoolerConfig`` (the model's).

A model runs as a pooling model (vLLM's ``--runner pooling``) when asked (``runner="pooling"``,
``convert="embed"``, the older ``task="embed"``) or when its checkpoint is a bare decoder
(``architectures`` ``Qwen3Model``, ``LlamaModel``, ...: no LM head). Its requests prefill their
prompt and finish; what they return is the final hidden states pooled into one vector: the
last token's (``LAST``, the default for a decoder, as vLLM's), the mean over the prompt
(``MEAN``) or the first token's (``CLS``), L2-normalized unless the model or the request says
otherwise. A sentence-transformers directory says how in its ``modules.json``: the pooling
module's ``config.json`` names the mode, a ``Normalize`` module asks for the normalization; a
GGUF file in ``{arch}.pooling_type`` (``gguf_metadata.pooling_type``).
``--pooler-config`` overrides both, as vLLM's does.

A model trained for Matryoshka representations (``is_matryoshka`` or ``matryoshka_dimensions``
in its config) may be asked for fewer ``dimensions``: the first ones, then normalized.

A ``...ForSequenceClassification`` checkpoint (a reward model, a classifier, a cross-encoder)
pools too, and classifies: its score head on the last token's state, then a softmax over its
labels (a sigmoid for one). Each pooling model does one task; a request names the one it
expects (``PoolingParams.task``).
"""

from __future__ import annotations

import json
import logging
import pathlib

import msgspec

from actorlm.json_flags import json_object
from actorlm.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# what an embedding request carries for sampling: nothing is sampled, its prompt is pooled
NOTHING_SAMPLED = SamplingParams(max_tokens=1)

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
TASKS = ("embed", "classify")  # what a pooling model does: a vector, or class probabilities
_CLASSIFIER = "ForSequenceClassification"  # a score head over the last token's state
# sentence-transformers' pooling modes -> ours (the others are refused by name): its files name
# a mode as "pooling_mode": "lasttoken" (v6) or as "pooling_mode_lasttoken": true (before)
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "mean_tokens": "MEAN", "cls": "CLS",
             "cls_token": "CLS"}
# its modules by class name (the module path moved between versions); any other would change
# the vector, so it is refused rather than left out
_ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
# a Dense module's activation (torch's class) -> ours
_ST_ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh", "ReLU": "relu", "GELU": "gelu",
                   "Sigmoid": "sigmoid"}


class Projection(msgspec.Struct, frozen=True):
    """A sentence-transformers ``Dense`` module after pooling (LaBSE's, distiluse's):
    ``act(vector @ weight.T + bias)``, its weights in ``directory``."""

    directory: str
    in_features: int
    out_features: int
    activation: str  # one of _ST_ACTIVATIONS' values
    bias: bool = True


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request's pooling (vLLM's ``PoolingParams``). ``task``: what the caller expects
    (embed, classify; None: the model's); ``dimensions``: keep the first this many (Matryoshka
    models only); ``normalize``: None is the model's choice; ``use_activation``: a
    classifier's probabilities (softmax, or a sigmoid for one label) or, False, its logits."""

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task: one of {', '.join(TASKS)}, got {self.task!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation: must be true or false, got "
                             f"{self.use_activation!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions: must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize: must be true or false, got {self.normalize!r}")


class PoolerConfig(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a pooling model turns a prompt's hidden states into its embedding. As a flag
    (``--pooler-config``) a field left None is the model's to say; resolved
    (``pooler_config``), every field is set."""

    pooling_type: str | None = None
    normalize: bool | None = None
    # embed, or classify (a ...ForSequenceClassification checkpoint's score head on the
    # pooled state); set by the model, not the flag
    task: str | None = None
    # the dimensions a request may ask for: None: only the model's own; () any (a model
    # that says is_matryoshka without listing them)
    matryoshka_dimensions: tuple[int, ...] | None = None
    # the model's sentence-transformers Dense modules after pooling, in order
    projections: tuple[Projection, ...] = ()

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"--pooler-config: pooling_type {self.pooling_type!r} is not "
                             f"implemented; one of {', '.join(POOLING_TYPES)}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"--pooler-config: normalize must be true or false, got "
                             f"{self.normalize!r}")

    def check(self, params: PoolingParams, hidden_size: int) -> None:
        """Refuse a request's parameters this model cannot honour (before it enters)."""
        if params.task is not None and params.task != self.task:
            raise ValueError(f"task: this pooling model does {self.task}, not {params.task} "
                             f"(a ...{_CLASSIFIER} checkpoint classifies, any other embeds)")
        if self.task == "classify" and (params.dimensions is not None
                                        or params.normalize is not None):
            raise ValueError("dimensions and normalize apply to embeddings, not to a "
                             "classifier's probabilities")
        dims = params.dimensions
        if dims is None:
            return
        if self.matryoshka_dimensions is None:
            raise ValueError("dimensions: the model does not support matryoshka "
                             "representation, changing output dimensions will lead to poor "
                             "results")
        if self.matryoshka_dimensions and dims not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions: the model only supports "
                             f"{list(self.matryoshka_dimensions)} for matryoshka "
                             f"representation, got {dims}")
        size = self.projections[-1].out_features if self.projections else hidden_size
        if dims > size:
            raise ValueError(f"dimensions: at most the model's {size}, got {dims}")

    def normalizes(self, params: PoolingParams) -> bool:
        """Whether a request's embedding is L2-normalized."""
        return bool(self.normalize) if params.normalize is None else params.normalize


_OVERRIDES = ("pooling_type", "normalize")  # what --pooler-config may set


def parse_pooler_config(value) -> PoolerConfig | None:
    """``--pooler-config`` as given (JSON text, a dict, a PoolerConfig or None)."""
    if value is None or isinstance(value, PoolerConfig):
        return value
    value = json_object(value, "--pooler-config")
    if unknown := sorted(set(value) - set(_OVERRIDES)):
        raise ValueError(f"--pooler-config: {', '.join(unknown)} not implemented; it may set "
                         f"{', '.join(_OVERRIDES)}")
    if isinstance(value.get("pooling_type"), str):
        value = {**value, "pooling_type": value["pooling_type"].upper()}
    return PoolerConfig(**value)


def wants_pooling(runner: str, convert: str, task: str | None, hf_config) -> bool:
    """Whether the model runs as a pooling model (vLLM's rules for ``--runner auto``: a
    checkpoint of a bare ``...Model`` has no LM head to generate with, a classifier's has its
    score head instead; and a GGUF file that says how it pools is an embedding model's)."""
    if task is not None:
        log.warning("task=%r is deprecated in vLLM; runner=%r is its new name", task,
                    "pooling" if task == "embed" else "generate")
    if runner == "pooling" or convert in TASKS or task == "embed":
        return True
    if runner == "generate" or task == "generate":
        return False
    if getattr(hf_config, "gguf_pooling_type", None):
        return True
    architecture = _architecture(hf_config)
    return architecture.endswith(("Model", _CLASSIFIER)) and \
        not architecture.endswith(("ForCausalLM", "LMHeadModel"))


def _architecture(hf_config) -> str:
    return (getattr(hf_config, "architectures", None) or [""])[0]


def check_runner_flags(runner: str, convert: str, task: str | None) -> None:
    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of {', '.join(RUNNERS)}; got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"--convert must be one of {', '.join(CONVERTS)}; got {convert!r}")
    if task not in (None, "auto", "generate", "embed"):
        raise ValueError(f"--task {task!r} is not implemented; generate or embed (vLLM's "
                         f"--runner generate / --runner pooling)")
    if runner == "generate" and (convert in TASKS or task == "embed"):
        raise ValueError(f"--runner generate contradicts --convert {convert} / --task {task}")


def pooler_config(path: pathlib.Path, hf_config, flag: PoolerConfig | None,
                  convert: str = "auto", default_pooling: str = "LAST") -> PoolerConfig:
    """The model's pooling: the defaults (``default_pooling``, normalized), then its
    sentence-transformers files, then what ``flag`` (``--pooler-config``) sets. A
    ``...ForSequenceClassification`` checkpoint classifies (its last token's state, as
    transformers pools it, through its score head); ``convert`` must agree."""
    task = "classify" if _architecture(hf_config).endswith(_CLASSIFIER) else "embed"
    if convert in TASKS and convert != task:
        raise ValueError(f"--convert {convert}: this checkpoint is a "
                         f"{_architecture(hf_config) or 'model'}, which can only {task} here "
                         f"(a classifier needs its ...{_CLASSIFIER} score head)")
    fields: dict = {"pooling_type": getattr(hf_config, "gguf_pooling_type", None) or
                    default_pooling,
                    "normalize": task == "embed", "task": task}
    # (llama.cpp normalizes a GGUF model's embeddings by default)
    fields.update(_sentence_transformers(path))
    if flag is not None:  # (a field it leaves None is the model's to say)
        fields.update({k: v for k, v in msgspec.structs.asdict(flag).items() if v is not None})
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        fields["matryoshka_dimensions"] = tuple(int(d) for d in dims)
    elif getattr(hf_config, "is_matryoshka", False):
        fields["matryoshka_dimensions"] = ()
    return PoolerConfig(**fields)


def _sentence_transformers(path: pathlib.Path) -> dict:
    """What a sentence-transformers ``modules.json`` says of pooling and normalizing."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return {}
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"cannot read {str(modules_file)!r}: {e!r}") from e
    if unknown := [t for t in kinds if t not in _ST_MODULES]:
        raise ValueError(f"{str(modules_file)!r}: module(s) {unknown} are not implemented "
                         f"(they would change the embedding)")
    # (Dense modules between the pooling and the normalizing, as sentence-transformers orders
    # them; one before the pooling would project every token's state)
    pooling = kinds.index("Pooling") if "Pooling" in kinds else len(kinds)
    normalize = kinds.index("Normalize") if "Normalize" in kinds else len(kinds)
    if any(kind == "Dense" and not pooling < i < normalize for i, kind in enumerate(kinds)):
        raise ValueError(f"{str(modules_file)!r}: a Dense module is implemented after the "
                         f"pooling and before the normalizing, not in the order {kinds}")
    found: dict = {"normalize": "Normalize" in kinds}
    projections = []
    for module, kind in zip(modules, kinds):
        directory = path / module.get("path", "")
        if kind == "Pooling":
            found["pooling_type"] = _pooling_mode(directory / "config.json")
        elif kind == "Dense":
            projections.append(_projection(directory))
    if projections:
        found["projections"] = tuple(projections)
    return found


def _projection(directory: pathlib.Path) -> Projection:
    """A Dense module's projection, from its ``config.json``."""
    config_file = directory / "config.json"
    try:
        config = json.loads(config_file.read_text())
        activation = str(config.get("activation_function", "Tanh")).rsplit(".", 1)[-1]
        in_features, out_features = int(config["in_features"]), int(config["out_features"])
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"cannot read {str(config_file)!r}: {e!r}") from e
    if activation not in _ST_ACTIVATIONS:
        raise ValueError(f"{str(config_file)!r}: activation {activation} is not implemented; "
                         f"one of {', '.join(_ST_ACTIVATIONS)}")
    for field, implemented in (("use_residual", False),
                               ("module_input_name", "sentence_embedding")):
        if config.get(field, implemented) != implemented:
            raise ValueError(f"{str(config_file)!r}: {field}={config[field]!r} is not "
                             f"implemented ({implemented!r})")
    return Projection(str(directory), in_features, out_features, _ST_ACTIVATIONS[activation],
                      bool(config.get("bias", True)))


def _pooling_mode(config_file: pathlib.Path) -> str:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {str(config_file)!r}: {e!r}") from e
    modes = config.get("pooling_mode")
    modes = [modes] if isinstance(modes, str) else list(modes or ()) + \
        [key.removeprefix("pooling_mode_") for key, on in config.items()
         if key.startswith("pooling_mode_") and on is True]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{str(config_file)!r}: pooling {modes} is not implemented; one of "
                         f"lasttoken, mean, cls")
    if config.get("include_prompt", True) is not True:
        raise ValueError(f"{str(config_file)!r}: include_prompt false is not implemented")
    return _ST_MODES[modes[0]]
