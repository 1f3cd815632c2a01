from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "logprobs", "skip_special_tokens", "n", "logit_bias", "structured_output", "prompt_logprobs", "allowed_token_ids", "bad_words_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    logprobs: int
    skip_special_tokens: bool
    n: int
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    prompt_logprobs: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "value", "starts_after", "waits_if_first")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STARTS_AFTER_FIELD_NUMBER: _ClassVar[int]
    WAITS_IF_FIRST_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: str
    starts_after: _containers.RepeatedScalarFieldContainer[int]
    waits_if_first: int
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[str] = ..., starts_after: _Optional[_Iterable[int]] = ..., waits_if_first: _Optional[int] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("return_token_ids",)
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    return_token_ids: bool
    def __init__(self, return_token_ids: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "cache_salt", "priority", "prefill_peer", "resume_output_token_ids", "output_options", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PEER_FIELD_NUMBER: _ClassVar[int]
    RESUME_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    cache_salt: str
    priority: int
    prefill_peer: str
    resume_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_options: OutputOptions
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., prefill_peer: _Optional[str] = ..., resume_output_token_ids: _Optional[_Iterable[int]] = ..., output_options: _Optional[_Union[OutputOptions, _Mapping]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class KvTransferInfo(_message.Message):
    __slots__ = ("prefill_engine_id", "blocks_pulled", "bytes", "seconds", "fallback_reason", "blocks_local", "blocks_pulled_early")
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_LOCAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PULLED_EARLY_FIELD_NUMBER: _ClassVar[int]
    prefill_engine_id: str
    blocks_pulled: int
    bytes: int
    seconds: float
    fallback_reason: str
    blocks_local: int
    blocks_pulled_early: int
    def __init__(self, prefill_engine_id: _Optional[str] = ..., blocks_pulled: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., fallback_reason: _Optional[str] = ..., blocks_local: _Optional[int] = ..., blocks_pulled_early: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "delta_text", "finish_reason", "stop_reason", "stop_token_id", "logprobs", "prompt_tokens", "completion_tokens", "cached_tokens", "kv_transfer", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DELTA_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    delta_text: str
    finish_reason: str
    stop_reason: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    kv_transfer: KvTransferInfo
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., delta_text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., kv_transfer: _Optional[_Union[KvTransferInfo, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "cache_salt", "priority", "lora_name", "announce_kv", "keepalive_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_KV_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    cache_salt: str
    priority: int
    lora_name: str
    announce_kv: bool
    keepalive_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ..., announce_kv: _Optional[bool] = ..., keepalive_s: _Optional[float] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("model", "dtype", "num_layers", "num_kv_heads", "head_size", "block_size", "fingerprint", "tensor_parallel_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    fingerprint: str
    tensor_parallel_size: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., block_size: _Optional[int] = ..., fingerprint: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("engine_id", "ucx_address", "ucx_port", "block_ids", "num_tokens", "lease_deadline_unix_ms", "layout", "num_cached_tokens", "lease_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UCX_PORT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    ucx_address: str
    ucx_port: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_deadline_unix_ms: int
    layout: KvLayout
    num_cached_tokens: int
    lease_id: str
    def __init__(self, engine_id: _Optional[str] = ..., ucx_address: _Optional[str] = ..., ucx_port: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_deadline_unix_ms: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_token_logprobs", "kv_handle", "prompt_logprobs", "first_block", "keepalive")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_token_logprobs: PositionLogprobs
    kv_handle: KvHandle
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    first_block: int
    keepalive: bool
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[PositionLogprobs, _Mapping]] = ..., kv_handle: _Optional[_Union[KvHandle, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., first_block: _Optional[int] = ..., keepalive: _Optional[bool] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("request_id", "engine_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("min_interval_s", "heartbeat_s")
    MIN_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    min_interval_s: float
    heartbeat_s: float
    def __init__(self, min_interval_s: _Optional[float] = ..., heartbeat_s: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("engine_id", "role", "model", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_free_blocks", "num_total_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "block_size", "kv_events_last_seq", "timestamp", "lora_adapters", "num_prefill_tokens_queued", "prefill_tokens_per_s", "prefill_share", "tensor_parallel_size")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_PERC_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SHARE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: str
    model: str
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    block_size: int
    kv_events_last_seq: int
    timestamp: float
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    num_prefill_tokens_queued: int
    prefill_tokens_per_s: float
    prefill_share: float
    tensor_parallel_size: int
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., kv_cache_usage_perc: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_events_last_seq: _Optional[int] = ..., timestamp: _Optional[float] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., num_prefill_tokens_queued: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefill_share: _Optional[float] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ("since_seq", "incarnation")
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    since_seq: int
    incarnation: str
    def __init__(self, since_seq: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KvCacheSnapshot(_message.Message):
    __slots__ = ("block_hashes", "chunk_index", "num_chunks")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    chunk_index: int
    num_chunks: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("seq", "timestamp", "events", "resync", "snapshot", "incarnation")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    resync: bool
    snapshot: KvCacheSnapshot
    incarnation: str
    def __init__(self, seq: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., resync: _Optional[bool] = ..., snapshot: _Optional[_Union[KvCacheSnapshot, _Mapping]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine_id", "role", "model", "max_model_len", "block_size", "kv_layout", "lora_adapters", "model_summary", "tensor_parallel_size")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: str
    model: str
    max_model_len: int
    block_size: int
    kv_layout: KvLayout
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    model_summary: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel_size: int
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_layout: _Optional[_Union[KvLayout, _Mapping]] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., model_summary: _Optional[_Iterable[str]] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class LoadLoraRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoraAdapters(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...
