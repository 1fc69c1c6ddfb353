"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, vLLM's runtime routes.

They exist only while ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true when the app is built (as
vLLM registers them): otherwise they are unknown paths, a 404. A success answers 200 with
vLLM's sentence as plain text; an error has OpenAI's shape (see ``LoRAModels``).
"""

from __future__ import annotations

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response


class LoadLoRAAdapterRequest(Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None  # accepted as vLLM's; the name decides


async def load_lora_adapter(state, request: Request) -> Response:
    state.ready_engine()
    req = state.decoder.decode(await request.body(), LoadLoRAAdapterRequest)
    await state.lora.load(req.lora_name, req.lora_path, state.base_model_names,
                          req.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(state, request: Request) -> Response:
    state.ready_engine()
    req = state.decoder.decode(await request.body(), UnloadLoRAAdapterRequest)
    await state.lora.unload(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
