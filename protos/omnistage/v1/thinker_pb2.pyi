from omnistage.v1 import common_pb2 as _common_pb2
from omnistage.v1 import encoder_pb2 as _encoder_pb2
from omnistage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatPrompt
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ...) -> None: ...

class MultimodalEmbedding(_message.Message):
    __slots__ = ("placeholder_token_id", "embeddings", "merged_grids", "caller_keeps_lease")
    PLACEHOLDER_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MERGED_GRIDS_FIELD_NUMBER: _ClassVar[int]
    CALLER_KEEPS_LEASE_FIELD_NUMBER: _ClassVar[int]
    placeholder_token_id: int
    embeddings: _tensor_pb2.TensorRef
    merged_grids: _containers.RepeatedCompositeFieldContainer[_encoder_pb2.GridTHW]
    caller_keeps_lease: bool
    def __init__(self, placeholder_token_id: _Optional[int] = ..., embeddings: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., merged_grids: _Optional[_Iterable[_Union[_encoder_pb2.GridTHW, _Mapping]]] = ..., caller_keeps_lease: _Optional[bool] = ...) -> None: ...

class ThinkerRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "multimodal", "hidden_states")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatPrompt
    sampling: _common_pb2.SamplingParams
    multimodal: _containers.RepeatedCompositeFieldContainer[MultimodalEmbedding]
    hidden_states: HiddenStatesRequest
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., multimodal: _Optional[_Iterable[_Union[MultimodalEmbedding, _Mapping]]] = ..., hidden_states: _Optional[_Union[HiddenStatesRequest, _Mapping]] = ...) -> None: ...

class HiddenStatesRequest(_message.Message):
    __slots__ = ("allow_cuda_ipc",)
    ALLOW_CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    allow_cuda_ipc: bool
    def __init__(self, allow_cuda_ipc: _Optional[bool] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("tensor",)
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.TensorRef
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("pieces",)
    PIECES_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedCompositeFieldContainer[PromptPiece]
    def __init__(self, pieces: _Optional[_Iterable[_Union[PromptPiece, _Mapping]]] = ...) -> None: ...

class PromptPiece(_message.Message):
    __slots__ = ("template", "text", "tokens", "client_tokens")
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    template: str
    text: str
    tokens: TokenIds
    client_tokens: TokenIds
    def __init__(self, template: _Optional[str] = ..., text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., client_tokens: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ThinkerFinish(_message.Message):
    __slots__ = ("reason", "usage", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    message: str
    def __init__(self, reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("engine_request_id", "prompt_tokens")
    ENGINE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_request_id: str
    prompt_tokens: int
    def __init__(self, engine_request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ThinkerEvent(_message.Message):
    __slots__ = ("delta", "finish", "started", "hidden_states")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    delta: TokenDelta
    finish: ThinkerFinish
    started: Started
    hidden_states: HiddenStates
    def __init__(self, delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., finish: _Optional[_Union[ThinkerFinish, _Mapping]] = ..., started: _Optional[_Union[Started, _Mapping]] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ...) -> None: ...
