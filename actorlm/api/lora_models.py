"""The LoRA adapters a server serves by name: vLLM's ``OpenAIServingModels``, its LoRA half.

A request picks an adapter through its ``model``: the base model's name (or none) runs the
base model, an adapter's name runs that adapter (a ``LoRARequest``), anything else is a 404.
Adapters come from ``--lora-modules`` at start-up and, when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
is true, from ``POST /v1/load_lora_adapter`` (``lora_routes``). Each load reads the adapter's
directory once (``LoRAChecker``), so a malformed one is refused before any request uses it.

Ids: every load takes the next of a counter that starts at 1, so an id is positive, stable while
its adapter is loaded, and never reused. The engine keys its slots and its prefix cache by id:
an adapter loaded again (after an unload, or in place) gets a new id, and no request of the new
one can meet the old one's weights or KV.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from actorlm.api.errors import ApiError
from actorlm.api.protocol import ModelCard
from actorlm.lora_request import LoRARequest

log = logging.getLogger(__name__)

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(environ=os.environ) -> bool:
    """vLLM's switch for the load and unload routes: "1" or "true", any case."""
    return environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's): the adapter's name, its directory, and the base
    model its card names as ``parent`` (None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_module(text: str) -> LoRAModulePath:
    """``--lora-modules``' value: ``name=path`` or vLLM's JSON
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (an argparse ``type``)."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text}") from None
        known = {"name", "path", "base_model_name"}
        if not isinstance(fields, dict) or not {"name", "path"} <= fields.keys() \
                or fields.keys() - known:
            raise argparse.ArgumentTypeError(
                f'expected {{"name": ..., "path": ..., "base_model_name": ...}} (the last '
                f'optional), got {text}')
        if not all(isinstance(v, str) and v for v in fields.values()):
            raise argparse.ArgumentTypeError(f"name, path and base_model_name must be "
                                             f"non-empty strings: {text}")
        return LoRAModulePath(**fields)
    name, equals, path = text.partition("=")
    if not (name and equals and path):
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
    return LoRAModulePath(name, path)


def check_lora_modules(modules: list[LoRAModulePath], enable_lora: bool) -> None:
    """What ``--lora-modules`` can be refused for before the model loads (reading the
    adapters waits for the model)."""
    if modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = [module.name for module in modules]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"--lora-modules names {', '.join(map(repr, twice))} more than once")


class LoRAModels:
    """name -> ``LoRARequest`` of every adapter loaded, with the checker that reads a directory
    before its adapter is loaded (None: LoRA is off, and a load is refused). The names change
    on the event loop only; reading a directory happens on a thread, under the lock."""

    def __init__(self, checker=None):
        self.checker = checker
        self.loaded: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one load or unload at a time

    def resolve(self, model: str | None, base_model_names: tuple[str, ...]) -> LoRARequest | None:
        """The adapter ``model`` names; None for the base model (by any of its names, or no
        name); a 404 for a name nobody serves (OpenAI's error, vLLM's words)."""
        if model is None or model in base_model_names:
            return None
        lora = self.loaded.get(model)
        if lora is None:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        return lora

    def cards(self, base_model_name: str, created: int) -> list[ModelCard]:
        """An adapter's model card: its directory as ``root``, the base model as ``parent``."""
        return [ModelCard(name, "model", created, "actorlm", lora.lora_path, None,
                          base_model_name) for name, lora in self.loaded.items()]

    def load_static(self, modules: list[LoRAModulePath], served_names: tuple[str, ...]) -> None:
        """``--lora-modules``, before the server takes requests (blocking: it reads each
        directory); the first that cannot be served is a ValueError naming it and why."""
        for module in modules:
            if module.base_model_name not in (None, *served_names):
                raise ValueError(f"--lora-modules: adapter {module.name!r} names "
                                 f"base_model_name {module.base_model_name!r}, but this server "
                                 f"serves {served_names[0]!r}")
            try:
                self._add(self._checked(module.name, module.path, served_names))
            except ApiError as exc:
                raise ValueError(f"--lora-modules: {exc.message}") from None

    async def load(self, name: str, path: str, served_names: tuple[str, ...],
                   inplace: bool = False) -> None:
        """Read the adapter at ``path`` (on a thread) and serve it as ``name``."""
        async with self._lock:
            self._add(await asyncio.to_thread(self._checked, name, path, served_names, inplace))

    async def unload(self, name: str) -> None:
        """Stop serving ``name``. As vLLM's, only the name goes: requests already admitted with
        the adapter run to their end with it (each carries its ``LoRARequest``), and its slot
        on the workers goes to the next adapter that needs one (least recently used first)."""
        async with self._lock:
            if not name:
                raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                               error_type="InvalidUserInput")
            if name not in self.loaded:
                raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
            del self.loaded[name]
            log.info("Removed LoRA adapter: name '%s'", name)

    def _checked(self, name: str, path: str, served_names: tuple[str, ...],
                 inplace: bool = False) -> LoRARequest:
        """The adapter at ``path`` as ``name``, read and checked (blocking). Raises ApiError:
        400 for a request without both, a name taken (unless ``inplace``) or an adapter that
        cannot run, naming what is wrong; 404 for no such directory (vLLM's "No adapter
        found")."""
        if not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           error_type="InvalidUserInput")
        if name in self.loaded and not inplace:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you "
                                f"want to load the adapter in place, set 'load_inplace' to "
                                f"True.", "lora_name", error_type="InvalidUserInput")
        if name in served_names:  # its requests would run the base model
            raise ApiError(400, f"The lora adapter name '{name}' is the served base model's",
                           "lora_name", error_type="InvalidUserInput")
        if self.checker is None:
            raise ApiError(400, f"LoRA adapter '{name}': LoRA is not enabled (--enable-lora)")
        if not Path(path).is_dir():
            raise ApiError(404, f"No adapter found for {path}: no such directory", "lora_path")
        # a fresh id, in place too: the engine keys its slots and cached prefixes by id
        lora = LoRARequest(name, next(self._ids), str(path))
        try:
            self.checker.check(lora)
        except ValueError as exc:  # LoRAAdapterError: what is wrong, by file and key
            raise ApiError(400, str(exc), "lora_path") from None
        return lora

    def _add(self, lora: LoRARequest) -> None:
        self.loaded[lora.lora_name] = lora
        log.info("Loaded new LoRA adapter: name '%s', path '%s' (lora_int_id %d)",
                 lora.lora_name, lora.lora_path, lora.lora_int_id)
