from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_HIT: _ClassVar[Outcome]
    OUTCOME_COMPILED: _ClassVar[Outcome]
    OUTCOME_JOINED: _ClassVar[Outcome]
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_HIT: Outcome
OUTCOME_COMPILED: Outcome
OUTCOME_JOINED: Outcome

class KernelSpec(_message.Message):
    __slots__ = ("kind", "params", "target", "program")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ParamValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ParamValue, _Mapping]] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    kind: str
    params: _containers.MessageMap[str, ParamValue]
    target: str
    program: str
    def __init__(self, kind: _Optional[str] = ..., params: _Optional[_Mapping[str, ParamValue]] = ..., target: _Optional[str] = ..., program: _Optional[str] = ...) -> None: ...

class ParamValue(_message.Message):
    __slots__ = ("int_value", "float_value", "bool_value", "string_value", "null_value")
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    NULL_VALUE_FIELD_NUMBER: _ClassVar[int]
    int_value: int
    float_value: float
    bool_value: bool
    string_value: str
    null_value: _struct_pb2.NullValue
    def __init__(self, int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., bool_value: _Optional[bool] = ..., string_value: _Optional[str] = ..., null_value: _Optional[_Union[_struct_pb2.NullValue, str]] = ...) -> None: ...

class GetKernelRequest(_message.Message):
    __slots__ = ("spec", "app", "no_compile")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    APP_FIELD_NUMBER: _ClassVar[int]
    NO_COMPILE_FIELD_NUMBER: _ClassVar[int]
    spec: KernelSpec
    app: str
    no_compile: bool
    def __init__(self, spec: _Optional[_Union[KernelSpec, _Mapping]] = ..., app: _Optional[str] = ..., no_compile: _Optional[bool] = ...) -> None: ...

class KernelArtifact(_message.Message):
    __slots__ = ("key", "entry_dir", "library", "library_sha256", "library_size", "abi_json", "canonical_spec")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ENTRY_DIR_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_SHA256_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_SIZE_FIELD_NUMBER: _ClassVar[int]
    ABI_JSON_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_SPEC_FIELD_NUMBER: _ClassVar[int]
    key: str
    entry_dir: str
    library: str
    library_sha256: str
    library_size: int
    abi_json: str
    canonical_spec: str
    def __init__(self, key: _Optional[str] = ..., entry_dir: _Optional[str] = ..., library: _Optional[str] = ..., library_sha256: _Optional[str] = ..., library_size: _Optional[int] = ..., abi_json: _Optional[str] = ..., canonical_spec: _Optional[str] = ...) -> None: ...

class GetKernelResponse(_message.Message):
    __slots__ = ("artifact", "cached_result", "outcome", "compile_seconds", "shared_build")
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    CACHED_RESULT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BUILD_FIELD_NUMBER: _ClassVar[int]
    artifact: KernelArtifact
    cached_result: bool
    outcome: Outcome
    compile_seconds: float
    shared_build: SharedBuild
    def __init__(self, artifact: _Optional[_Union[KernelArtifact, _Mapping]] = ..., cached_result: _Optional[bool] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., compile_seconds: _Optional[float] = ..., shared_build: _Optional[_Union[SharedBuild, _Mapping]] = ...) -> None: ...

class SharedBuild(_message.Message):
    __slots__ = ("key", "canonical_spec", "compile_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_SPEC_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    canonical_spec: str
    compile_seconds: float
    def __init__(self, key: _Optional[str] = ..., canonical_spec: _Optional[str] = ..., compile_seconds: _Optional[float] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("specs", "app", "no_compile", "later")
    SPECS_FIELD_NUMBER: _ClassVar[int]
    APP_FIELD_NUMBER: _ClassVar[int]
    NO_COMPILE_FIELD_NUMBER: _ClassVar[int]
    LATER_FIELD_NUMBER: _ClassVar[int]
    specs: _containers.RepeatedCompositeFieldContainer[KernelSpec]
    app: str
    no_compile: bool
    later: bool
    def __init__(self, specs: _Optional[_Iterable[_Union[KernelSpec, _Mapping]]] = ..., app: _Optional[str] = ..., no_compile: _Optional[bool] = ..., later: _Optional[bool] = ...) -> None: ...

class PrefetchEvent(_message.Message):
    __slots__ = ("index", "done", "total", "kernel", "error_code", "error_message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    done: int
    total: int
    kernel: GetKernelResponse
    error_code: str
    error_message: str
    def __init__(self, index: _Optional[int] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., kernel: _Optional[_Union[GetKernelResponse, _Mapping]] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class UsageReport(_message.Message):
    __slots__ = ("local_compiles", "direct_hits")
    LOCAL_COMPILES_FIELD_NUMBER: _ClassVar[int]
    DIRECT_HITS_FIELD_NUMBER: _ClassVar[int]
    local_compiles: int
    direct_hits: int
    def __init__(self, local_compiles: _Optional[int] = ..., direct_hits: _Optional[int] = ...) -> None: ...

class UsageReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportCorruptResponse(_message.Message):
    __slots__ = ("removed", "reason")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    reason: str
    def __init__(self, removed: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("compiles", "hits", "misses", "failures", "in_flight", "workers", "entries", "bytes", "joined", "corrupt", "invalid", "compile_seconds", "cpu_quota", "cache_dir", "address", "uptime_seconds", "version", "toolchain", "inductor_dir", "inductor_entries", "inductor_bytes", "evictions", "failures_cached", "cuda_compiler", "device_compile_seconds", "derived", "stats_since", "workers_ready", "running", "queued", "not_ready", "remote", "remote_state", "remote_read_only", "remote_hits", "remote_misses", "remote_bytes_in", "remote_bytes_out", "remote_lease_waits", "remote_takeovers", "remote_errors", "remote_corrupt", "compile_timeouts", "memory_limit", "memory_builds", "most_builds_running", "build_peak_bytes", "local_compiles", "direct_hits")
    COMPILES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_QUOTA_FIELD_NUMBER: _ClassVar[int]
    CACHE_DIR_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOOLCHAIN_FIELD_NUMBER: _ClassVar[int]
    INDUCTOR_DIR_FIELD_NUMBER: _ClassVar[int]
    INDUCTOR_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    INDUCTOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_CACHED_FIELD_NUMBER: _ClassVar[int]
    CUDA_COMPILER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DERIVED_FIELD_NUMBER: _ClassVar[int]
    STATS_SINCE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_READY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    NOT_READY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_STATE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HITS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_MISSES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_LEASE_WAITS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TAKEOVERS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    COMPILE_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUILDS_FIELD_NUMBER: _ClassVar[int]
    MOST_BUILDS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    BUILD_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_COMPILES_FIELD_NUMBER: _ClassVar[int]
    DIRECT_HITS_FIELD_NUMBER: _ClassVar[int]
    compiles: int
    hits: int
    misses: int
    failures: int
    in_flight: int
    workers: int
    entries: int
    bytes: int
    joined: int
    corrupt: int
    invalid: int
    compile_seconds: float
    cpu_quota: int
    cache_dir: str
    address: str
    uptime_seconds: float
    version: str
    toolchain: str
    inductor_dir: str
    inductor_entries: int
    inductor_bytes: int
    evictions: int
    failures_cached: int
    cuda_compiler: str
    device_compile_seconds: float
    derived: int
    stats_since: float
    workers_ready: int
    running: int
    queued: int
    not_ready: int
    remote: str
    remote_state: str
    remote_read_only: bool
    remote_hits: int
    remote_misses: int
    remote_bytes_in: int
    remote_bytes_out: int
    remote_lease_waits: int
    remote_takeovers: int
    remote_errors: int
    remote_corrupt: int
    compile_timeouts: int
    memory_limit: int
    memory_builds: int
    most_builds_running: int
    build_peak_bytes: int
    local_compiles: int
    direct_hits: int
    def __init__(self, compiles: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., failures: _Optional[int] = ..., in_flight: _Optional[int] = ..., workers: _Optional[int] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., joined: _Optional[int] = ..., corrupt: _Optional[int] = ..., invalid: _Optional[int] = ..., compile_seconds: _Optional[float] = ..., cpu_quota: _Optional[int] = ..., cache_dir: _Optional[str] = ..., address: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., version: _Optional[str] = ..., toolchain: _Optional[str] = ..., inductor_dir: _Optional[str] = ..., inductor_entries: _Optional[int] = ..., inductor_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., failures_cached: _Optional[int] = ..., cuda_compiler: _Optional[str] = ..., device_compile_seconds: _Optional[float] = ..., derived: _Optional[int] = ..., stats_since: _Optional[float] = ..., workers_ready: _Optional[int] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., not_ready: _Optional[int] = ..., remote: _Optional[str] = ..., remote_state: _Optional[str] = ..., remote_read_only: _Optional[bool] = ..., remote_hits: _Optional[int] = ..., remote_misses: _Optional[int] = ..., remote_bytes_in: _Optional[int] = ..., remote_bytes_out: _Optional[int] = ..., remote_lease_waits: _Optional[int] = ..., remote_takeovers: _Optional[int] = ..., remote_errors: _Optional[int] = ..., remote_corrupt: _Optional[int] = ..., compile_timeouts: _Optional[int] = ..., memory_limit: _Optional[int] = ..., memory_builds: _Optional[int] = ..., most_builds_running: _Optional[int] = ..., build_peak_bytes: _Optional[int] = ..., local_compiles: _Optional[int] = ..., direct_hits: _Optional[int] = ...) -> None: ...

class ZeroStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("cache_dir", "inductor_dir", "version", "toolchain", "default_target", "cuda_compiler", "key_fingerprint_json", "config_json", "cache_layers")
    CACHE_DIR_FIELD_NUMBER: _ClassVar[int]
    INDUCTOR_DIR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOOLCHAIN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TARGET_FIELD_NUMBER: _ClassVar[int]
    CUDA_COMPILER_FIELD_NUMBER: _ClassVar[int]
    KEY_FINGERPRINT_JSON_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CACHE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    cache_dir: str
    inductor_dir: str
    version: str
    toolchain: str
    default_target: str
    cuda_compiler: str
    key_fingerprint_json: str
    config_json: str
    cache_layers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cache_dir: _Optional[str] = ..., inductor_dir: _Optional[str] = ..., version: _Optional[str] = ..., toolchain: _Optional[str] = ..., default_target: _Optional[str] = ..., cuda_compiler: _Optional[str] = ..., key_fingerprint_json: _Optional[str] = ..., config_json: _Optional[str] = ..., cache_layers: _Optional[_Iterable[str]] = ...) -> None: ...

class ListKindsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListKindsResponse(_message.Message):
    __slots__ = ("kinds",)
    KINDS_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedCompositeFieldContainer[KindInfo]
    def __init__(self, kinds: _Optional[_Iterable[_Union[KindInfo, _Mapping]]] = ...) -> None: ...

class KindInfo(_message.Message):
    __slots__ = ("name", "doc", "params", "origin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DOC_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    doc: str
    params: _containers.RepeatedCompositeFieldContainer[ParamInfo]
    origin: str
    def __init__(self, name: _Optional[str] = ..., doc: _Optional[str] = ..., params: _Optional[_Iterable[_Union[ParamInfo, _Mapping]]] = ..., origin: _Optional[str] = ...) -> None: ...

class ParamInfo(_message.Message):
    __slots__ = ("name", "type", "doc", "required", "default_json", "nullable", "choices_json", "min", "max")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DOC_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_JSON_FIELD_NUMBER: _ClassVar[int]
    NULLABLE_FIELD_NUMBER: _ClassVar[int]
    CHOICES_JSON_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    doc: str
    required: bool
    default_json: str
    nullable: bool
    choices_json: str
    min: float
    max: float
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., doc: _Optional[str] = ..., required: _Optional[bool] = ..., default_json: _Optional[str] = ..., nullable: _Optional[bool] = ..., choices_json: _Optional[str] = ..., min: _Optional[float] = ..., max: _Optional[float] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: KernelSpec
    def __init__(self, spec: _Optional[_Union[KernelSpec, _Mapping]] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("hit", "key", "canonical_spec", "toolchain", "nearest", "reason", "failure")
    class ToolchainEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HIT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_SPEC_FIELD_NUMBER: _ClassVar[int]
    TOOLCHAIN_FIELD_NUMBER: _ClassVar[int]
    NEAREST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    hit: bool
    key: str
    canonical_spec: str
    toolchain: _containers.ScalarMap[str, str]
    nearest: _containers.RepeatedCompositeFieldContainer[NearEntry]
    reason: str
    failure: str
    def __init__(self, hit: _Optional[bool] = ..., key: _Optional[str] = ..., canonical_spec: _Optional[str] = ..., toolchain: _Optional[_Mapping[str, str]] = ..., nearest: _Optional[_Iterable[_Union[NearEntry, _Mapping]]] = ..., reason: _Optional[str] = ..., failure: _Optional[str] = ...) -> None: ...

class NearEntry(_message.Message):
    __slots__ = ("key", "canonical_spec", "differences")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_SPEC_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCES_FIELD_NUMBER: _ClassVar[int]
    key: str
    canonical_spec: str
    differences: _containers.RepeatedCompositeFieldContainer[FieldDifference]
    def __init__(self, key: _Optional[str] = ..., canonical_spec: _Optional[str] = ..., differences: _Optional[_Iterable[_Union[FieldDifference, _Mapping]]] = ...) -> None: ...

class FieldDifference(_message.Message):
    __slots__ = ("part", "field", "wanted", "found", "text")
    PART_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    WANTED_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    part: str
    field: str
    wanted: str
    found: str
    text: str
    def __init__(self, part: _Optional[str] = ..., field: _Optional[str] = ..., wanted: _Optional[str] = ..., found: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...
