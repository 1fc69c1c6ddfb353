"""OpenAI-compatible request and response schemas (msgspec), with vLLM's extra sampling fields.

Requests are decoded strictly by type (a string where a number belongs is a 400 that names the
field); fields vLLM defines but actorlm does not implement are refused (``refused``), unknown
ones ignored and logged once (``decoding``), as vLLM does. The fields that constrain the output
live in ``structured``, the tool types in ``protocol_tools``. Value ranges are checked by
``SamplingParams``, whose ValueError names the field; integers it never sees are bounded here
(``Meta``) or in serving (token ids, max_tokens), since JSON integers come in any size. Most
request fields accept an explicit ``null`` as "use the default", since many clients send one.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import Meta, Struct

from actorlm.api.errors import ApiError
from actorlm.api.protocol_tools import DeltaToolCall, Tool, ToolCall, ToolChoice
from actorlm.api.refused import CHAT_FIELDS, COMPLETION_FIELDS
from actorlm.api.structured import StructuredFields
from actorlm.beam_search import BeamSearchParams
from actorlm.generation_config import SamplingDefaults
from actorlm.prompt_rules import empty_prompt
from actorlm.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 128  # the most choices (n, best_of) one request may ask for


# --- requests ------------------------------------------------------------------------------------


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]  # OpenAI's
REASONING_EFFORTS = get_args(ReasoningEffort)


class StreamOptions(Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# the sampling fields a beam search does not combine with
_NOT_WITH_BEAMS = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "stop", "stop_token_ids", "bad_words",
                   "min_tokens", "allowed_token_ids", "prompt_logprobs")


class _SamplingRequest(StructuredFields, kw_only=True):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    # logprobs' tokens as "token_id:<id>"; None: as the server's --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the prompt's and the answer's token ids beside the text (agents and RL read them)
    return_token_ids: bool | None = False
    # vLLM's: stream this many tokens a chunk at least (never fewer than --stream-interval)
    stream_interval: Annotated[int, Meta(ge=1)] | None = None
    # keep only the prompt's last k tokens (-1: as many as the context holds), as vLLM does;
    # its first k with truncation_side "right"
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # its prefix-cache tenant: cached prefixes are shared only with requests of the same salt
    cache_salt: Annotated[str, Meta(min_length=1)] | None = None
    # smaller is served first, under --scheduling-policy priority (else it must be 0)
    priority: Annotated[int, Meta(ge=-2**63, le=2**63 - 1)] = 0
    # vLLM's beam search: n beams, ranked by cumulative logprob over length ** length_penalty
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0

    def beam_search(self, params: SamplingParams, constrained: bool,
                    max_logprobs: int) -> BeamSearchParams | None:
        """``use_beam_search``'s parameters (None without it) from the request's sampling
        ``params``; a 400 naming a field it does not combine with (the search ranks raw
        logprobs: filters, penalties, stops and constraints would change them), or a width
        the engine's ``max_logprobs`` does not allow."""
        if not self.use_beam_search:
            return None
        defaults = {f.name: f.default for f in msgspec.structs.fields(_SamplingRequest)}
        for name in _NOT_WITH_BEAMS:
            if getattr(self, name) != defaults[name]:
                raise ApiError(400, f"{name}: not supported with use_beam_search", name)
        if constrained:
            raise ApiError(400, "use_beam_search: not supported with structured outputs or "
                                "a forced tool call", "use_beam_search")
        try:
            beams = BeamSearchParams(params.n, params.max_tokens, params.ignore_eos,
                                     params.temperature, or_default(self.length_penalty, 1.0),
                                     params.include_stop_str_in_output)
            beams.step_params(max_logprobs)
            return beams
        except ValueError as e:
            raise ApiError(400, f"use_beam_search: {e}", "use_beam_search") from None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options can only be set when stream is true",
                           "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise ApiError(400, "prompt_logprobs is not supported when streaming",
                           "prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        defaults: SamplingDefaults | None = None) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError naming the field that is out of range.
        A sampling field the request leaves out takes the model's default (``defaults``, from
        its generation config), else vLLM's."""
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias: keys must be token ids (integers as strings)") \
                    from None
        d = or_default
        model = defaults or SamplingDefaults()
        return SamplingParams(
            n=d(self.n, 1), temperature=d(self.temperature, model.get("temperature", 1.0)),
            top_p=d(self.top_p, model.get("top_p", 1.0)),
            top_k=d(self.top_k, model.get("top_k", 0)),
            min_p=d(self.min_p, model.get("min_p", 0.0)),
            presence_penalty=d(self.presence_penalty, 0.0),
            frequency_penalty=d(self.frequency_penalty, 0.0),
            repetition_penalty=d(self.repetition_penalty, model.get("repetition_penalty", 1.0)),
            seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, bad_words=self.bad_words,
            include_stop_str_in_output=d(self.include_stop_str_in_output, False),
            ignore_eos=d(self.ignore_eos, False), max_tokens=max_tokens,
            min_tokens=d(self.min_tokens, 0), logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=d(self.skip_special_tokens, True),
            spaces_between_special_tokens=d(self.spaces_between_special_tokens, True),
            logit_bias=logit_bias, allowed_token_ids=self.allowed_token_ids,
            structured_outputs=structured_outputs)


class CompletionRequest(_SamplingRequest, kw_only=True):
    # text, a list of texts, token ids, or a list of token-id lists (checked in prompts())
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: Annotated[int, Meta(ge=0)] | None = None  # at most --max-logprobs
    echo: bool | None = False
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None  # only best_of == n runs
    add_special_tokens: bool | None = True
    prompt_embeds: Any = None  # vLLM's: refused (``refused.COMPLETION_FIELDS``)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ApiError(400, empty_prompt("prompt"), "prompt")
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(_is_int(x) for x in p):
            return [list(p)]
        if all(isinstance(x, list) and all(_is_int(t) for t in x) for x in p):
            return [list(x) for x in p]
        raise ApiError(400, "prompt: expected a string, a list of strings, a list of token ids "
                            "or a list of token-id lists", "prompt")

    def check_supported(self) -> None:
        self.check_stream_options()
        self.check_refused(COMPLETION_FIELDS)
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != or_default(self.n, 1):
            raise ApiError(400, "best_of: only best_of == n is supported", "best_of")
        if self.echo and self.logprobs is not None and self.stream:
            raise ApiError(400, "echo together with logprobs is not supported when streaming",
                           "echo")

    @property
    def echo_only(self) -> bool:
        """vLLM's echo without generation (``echo`` with ``max_tokens`` 0): the answer is the
        prompt, with its logprobs if asked; the engine computes one token, which is dropped."""
        return bool(self.echo) and self.max_tokens == 0

    def sampling_params(self, *args, **kwargs) -> SamplingParams:
        """As every request's; with ``echo`` and ``logprobs``, the prompt's logprobs too (as
        many alternatives), which the answer puts before the completion's, as vLLM's does."""
        params = super().sampling_params(*args, **kwargs)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            params = msgspec.structs.replace(params, prompt_logprobs=self.logprobs)
        return params


class ContentPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def as_dict(self, index: int) -> dict:
        """The message as a chat template reads it (HF's conventions)."""
        content = self.content
        if isinstance(content, list):  # (in the template's form when rendered: chat_content)
            for part in content:
                if part.type != "text" or part.text is None:
                    field = f"messages[{index}].content"
                    raise ApiError(400, f"{field}: only text parts are supported, "
                                        f"got {part.type!r}", field)
            content = [{"type": "text", "text": part.text} for part in content]
        out = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c, f"messages[{index}].tool_calls[{j}]")
                                 for j, c in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _template_call(call: ToolCall, field: str) -> dict:
    """A call as templates expect it: HF templates read the arguments as a mapping (they
    render them with ``tojson`` or iterate them), where OpenAI sends JSON text."""
    text = call.function.arguments
    try:
        arguments = json.loads(text) if text.strip() else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{field}.function.arguments: must be a JSON object as text",
                       f"{field}.function.arguments")
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0)] | None = None  # at most --max-logprobs
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False  # beyond the template's: refused
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    # OpenAI's; as vLLM, a variable of the chat template (GPT-OSS's, for one, reads it)
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: false leaves the think out of the answer (still split from the content)
    include_reasoning: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # without it: "auto" when there are tools
    parallel_tool_calls: bool | None = True  # false: at most one call
    # the deprecated functions and documents: refused (``refused.CHAT_FIELDS``)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    echo: bool | None = False  # vLLM's: refused (``refused.CHAT_FIELDS``)

    def check_supported(self) -> None:
        self.check_stream_options()
        self.check_refused(CHAT_FIELDS)
        if not self.messages:
            raise ApiError(400, "messages: the conversation is empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: logprobs must be true when top_logprobs is set",
                           "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return or_default(self.top_logprobs, 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them."""
    return [m.as_dict(i) for i, m in enumerate(messages)]


def num_chars(messages: list[ChatMessage], conversation: list[dict]) -> int:
    """The characters of a conversation's texts: contents and call arguments."""
    arguments = sum(len(c.function.arguments) for m in messages for c in m.tool_calls or ())
    return sum(_num_chars(m["content"]) for m in conversation) + arguments


def _num_chars(content: str | list[dict]) -> int:
    return sum(len(part["text"]) for part in content) if isinstance(content, list) else \
        len(content)


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # for the chat template, with messages
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    return_token_strs: bool | None = False  # vLLM's: each token as the tokenizer writes it


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# --- responses -----------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class UsageInfo(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(Struct):
    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # vLLM's shape: one entry per prompt token


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None


class CompletionStreamChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamChoiceIds(CompletionStreamChoice):
    """With return_token_ids: the chunk's tokens (and in a choice's first, the prompt's)."""

    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = []
    # with --reasoning-parser: the think, under vLLM's older name and its newer one
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # the same text as reasoning (vLLM's older name)
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChunkChoiceIds(ChatChunkChoice):
    """With return_token_ids: the tokens of the chunk's delta."""

    token_ids: list[int] | None = None


class ChatCompletionChunk(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids, in the first chunk


class ModelCard(Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int | None  # None on an adapter's card, as vLLM's
    parent: str | None = None  # an adapter's base model


class ModelList(Struct):
    object: str
    data: list[ModelCard]


class TokenizeResponse(Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs (vLLM leaves it out else)


class DetokenizeResponse(Struct):
    prompt: str


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def or_default(value, default):
    """``default`` when a field was omitted or sent as null."""
    return default if value is None else value
