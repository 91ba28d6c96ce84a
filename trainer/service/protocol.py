"""The contract between the HTTP API (`api/`) and the engine: what a request row holds and what its result must be.

The API accepts a Tinker SDK call, stores it with `Store.submit(owner, kind, body, ...)` and answers with a promise;
an engine process claims the row (`Store.claim`), runs it, and reports back with `Store.complete(request_id, result,
worker_id=...)` or `Store.fail(request_id, message, category=...)`. The API hands `result` to the SDK's
`retrieve_future` verbatim, with the content type of `KINDS[kind].result`, so the result bytes must be exactly what
tinker 0.38 parses for that call (tinker/lib/api_future_impl.py `_fetch_via_rest` / `_handle_outcome`):

kind                      body (Request.body)                          result (Request.result)
create_model              JSON CreateModelRequest, model seq 0          JSON CreateModelResponse {"model_id"}
load_weights              JSON LoadWeightsRequest (model seq 0 when it  JSON LoadWeightsResponse {"path", "model_id"}
                          creates the model: session_id form)
forward                   protobuf ForwardBackwardRequest,              protobuf ForwardBackwardOutput
                          forward_only=True
forward_backward          protobuf ForwardBackwardRequest               protobuf ForwardBackwardOutput
optim_step                JSON OptimStepRequest ("adam_params" or       JSON OptimStepResponse {"metrics"?}
                          "optimizer_params")
save_weights              JSON SaveWeightsRequest                       JSON SaveWeightsResponse {"path"}
save_weights_for_sampler  JSON SaveWeightsForSamplerRequest             JSON {"path"} (path form) or
                                                                        {"sampling_session_id"} (seq form)
save_weights_external     JSON SaveWeightsExternalRequest               JSON {"path", "size_bytes"}
sample                    JSON SampleRequest (sampling_session_id set)  protobuf SampleResponse
delete_checkpoint         JSON DeleteCheckpointFiles (engine-internal)  JSON {} (nobody polls it)

JSON bodies are the SDK's own pydantic request types, dumped canonically (`canonical_json`): parse them back with
`decode_json(kind, body)`. The forward/forward_backward body is the request protobuf, decompressed and re-serialised
deterministically (so a retry with another transport encoding matches the first submission); `decode_forward_backward`
turns it into numpy arrays. Results: `json_result(model)` for JSON kinds, `encode_forward_backward_output` and
`encode_sample_response` for the protobuf ones (the inverses of tinker/proto/response_conv.py).

Ordering and ids: every kind but `sample` and `delete_checkpoint` belongs to a model and carries its seq_id; the store
hands them out strictly in that order (the model's create_model/load_weights is seq 0, the SDK numbers the rest from
1). `Request.model_id` is always set for them: use it, not the body's (a create-via-load body names the session).

`owner` below is `Request.owner_id`: pass it to every owner-scoped store call. What the engine must do beyond
computing, per kind:
* create_model: build the LoRA adapter from the model row (`base_model`, `lora_config` = the request's LoraConfig:
  rank, seed, train_mlp, train_attn, train_unembed) and AdamW state; result {"model_id": Request.model_id}.
* load_weights: resolve `path` with `store.get_checkpoint(owner, path)` (a user error if it is gone), load the LoRA
  (and the Adam state if `optimizer`); result {"path": path, "model_id": Request.model_id}. As the model's seq 0
  (create-via-load) it first builds the adapter like create_model, from the model row (the API copied the
  checkpoint's model's lora_config and base model, or the request's base_model override, into it).
* forward / forward_backward: per datum `loss_fn_outputs[i]["logprobs"]` (float32, one per model-input token, the
  target-token logprobs) plus any other outputs; metric keys MUST carry a reduction suffix ("loss:sum"), since the SDK
  splits every key on ":" to merge chunks (tinker/lib/chunked_fwdbwd_helpers.py `_metrics_reduction`). forward_backward
  accumulates gradients until the next optim_step; forward changes nothing (the store re-queues it after a crash).
* save_weights: write the training state (LoRA + optimizer) under a storage path of its choosing, then
  `store.add_checkpoint(owner, model_id, body.path, "training", storage_path, size_bytes=, ttl_seconds=,
  overwrite=, user_metadata=)`; a `Conflict` there is a user error ("already exists; pass overwrite=True").
  Result {"path": checkpoint.tinker_path}.
* save_weights_for_sampler: path form as save_weights with kind "sampler" (sampler weights, e.g. a PEFT adapter).
  Seq form (`sampling_session_seq_id` set, no path): save under `ephemeral_sampler_name(...)`, record it as a
  sampler checkpoint, then `store.create_sampling_session(owner, model.session_id, sampling_session_seq_id,
  base_model=model.base_model, model_path=checkpoint.tinker_path)`; result {"sampling_session_id": its id}.
* save_weights_external: as the save_weights_for_sampler path form with kind "external" (the PEFT adapter: HF
  format, what the SDK documents). The API refuses age_encryption_recipients, so the body never carries them.
* sample: the sampler is `store.get_sampling_session(owner, body.sampling_session_id)` (base model, or
  `model_path` -> `store.get_checkpoint`). Exactly `num_samples` sequences (the SDK pairs them with the ids the
  promise carried: `sequence_ids(request_id, num_samples)`); prompt logprobs, when asked, one per prompt token with
  NaN first; topk_prompt_logprobs k: per prompt token its k likeliest tokens (the first row the SDK's sentinel).
  Options it does not support (topk_sample_logprobs, target_prompt_logprobs, ...) -> fail, category "user".
* delete_checkpoint: the API has already removed the row; delete the files at `storage_path` unless a live
  checkpoint row uses the same storage_path again (a checkpoint re-saved under the same name meanwhile).
Errors: `store.fail(..., category="user")` for the caller's mistakes (bad loss_fn, missing checkpoint, bad name),
"server" for the engine's own; the SDK raises tinker.RequestFailedError with the message either way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np
import pydantic
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

PROTOBUF: Final = "application/x-protobuf"
JSON: Final = "application/json"

CREATE_MODEL: Final = "create_model"
LOAD_WEIGHTS: Final = "load_weights"
FORWARD: Final = "forward"
FORWARD_BACKWARD: Final = "forward_backward"
OPTIM_STEP: Final = "optim_step"
SAVE_WEIGHTS: Final = "save_weights"
SAVE_WEIGHTS_FOR_SAMPLER: Final = "save_weights_for_sampler"
SAVE_WEIGHTS_EXTERNAL: Final = "save_weights_external"
SAMPLE: Final = "sample"
DELETE_CHECKPOINT: Final = "delete_checkpoint"

Format = Literal["json", "proto"]


class DeleteCheckpointFiles(pydantic.BaseModel):
    """Body of the engine-internal delete_checkpoint request (the SDK has no type for it)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")
    tinker_path: str
    storage_path: str


@dataclass(frozen=True)
class KindSpec:
    kind: str
    body: Format
    body_type: type[Any]  # a tinker pydantic request type, or the protobuf message class
    result: Format
    result_type: type[Any]  # what the SDK deserialises the result into
    ordered: bool  # runs in its model's seq_id order

    @property
    def result_content_type(self) -> str:
        return PROTOBUF if self.result == "proto" else JSON


KINDS: Final[Mapping[str, KindSpec]] = {
    spec.kind: spec
    for spec in (
        KindSpec(CREATE_MODEL, "json", types.CreateModelRequest, "json", types.CreateModelResponse, True),
        KindSpec(LOAD_WEIGHTS, "json", types.LoadWeightsRequest, "json", types.LoadWeightsResponse, True),
        KindSpec(FORWARD, "proto", pb.ForwardBackwardRequest, "proto", types.ForwardBackwardOutput, True),
        KindSpec(FORWARD_BACKWARD, "proto", pb.ForwardBackwardRequest, "proto", types.ForwardBackwardOutput, True),
        KindSpec(OPTIM_STEP, "json", types.OptimStepRequest, "json", types.OptimStepResponse, True),
        KindSpec(SAVE_WEIGHTS, "json", types.SaveWeightsRequest, "json", types.SaveWeightsResponse, True),
        KindSpec(
            SAVE_WEIGHTS_FOR_SAMPLER, "json", types.SaveWeightsForSamplerRequest, "json",
            types.SaveWeightsForSamplerResponseInternal, True,
        ),
        KindSpec(
            SAVE_WEIGHTS_EXTERNAL, "json", types.SaveWeightsExternalRequest, "json",
            types.SaveWeightsExternalResponseInternal, True,
        ),
        KindSpec(SAMPLE, "json", types.SampleRequest, "proto", types.SampleResponse, False),
        KindSpec(DELETE_CHECKPOINT, "json", DeleteCheckpointFiles, "json", dict, False),
    )
}


# -- bodies ----------------------------------------------------------------------------------------------------------


def canonical_json(model: pydantic.BaseModel) -> bytes:
    """The stored form of a JSON request: sorted keys, no spaces, so a client's identical retry hashes the same."""
    return json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


def decode_json(kind: str, body: bytes) -> Any:
    """A JSON kind's body as the SDK's request type (e.g. types.OptimStepRequest)."""
    spec = KINDS[kind]
    if spec.body != "json":
        raise ValueError(f"{kind} has a protobuf body: use decode_forward_backward")
    return spec.body_type.model_validate_json(body)


def canonical_forward_backward(msg: pb.ForwardBackwardRequest) -> bytes:
    # deterministic=True orders map entries (loss_fn_inputs, loss_fn_config), which SerializeToString does not promise.
    return msg.SerializeToString(deterministic=True)


_NP_DTYPE: Final[Mapping[int, np.dtype[Any]]] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


# The most elements one loss_fn_inputs tensor may declare. Checked before anything is allocated: a sparse tensor's
# shape, not its bytes, sets what densifying it costs (a [2^20, 2^20] one would be 4 TiB). 4M float32 is 16 MiB, far
# above any datum the engine takes (its context times a few values per position).
MAX_TENSOR_ELEMENTS: Final = 1 << 22


def tensor_to_numpy(t: pb.Tensor, *, max_elements: int = MAX_TENSOR_ELEMENTS) -> np.ndarray:
    """A request Tensor as a dense array (a sparse CSR one filled with 0, as the SDK's `to_numpy()` does). Every
    length, index and shape is checked before allocating: ValueError (the request's fault) says what is wrong."""
    shape = [int(d) for d in t.shape]
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    declared = int(np.prod(shape, dtype=object)) if shape else None
    if declared is not None and declared > max_elements:
        raise ValueError(f"shape {shape} has {declared} elements; a tensor may have at most {max_elements}")
    sparse = t.WhichOneof("encoding") == "sparse_csr"
    if t.dtype == pb.DTYPE_BFLOAT16:
        if sparse:
            raise ValueError("a bfloat16 tensor must be dense")
        raw = _elements(t.dense, np.dtype(np.uint16), declared, max_elements)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape or [-1])
    dtype = _NP_DTYPE.get(t.dtype)
    if dtype is None:
        raise ValueError(f"unsupported tensor dtype {t.dtype}")
    if not sparse:
        return _elements(t.dense, dtype, declared, max_elements).reshape(shape or [-1]).copy()
    if len(shape) != 2:
        raise ValueError(f"a sparse CSR tensor must be 2-D, not shape {shape}")
    csr = t.sparse_csr
    values = _elements(csr.values, dtype, None, max_elements)
    crow = _elements(csr.crow_indices, np.dtype(np.int64), shape[0] + 1, max_elements)
    cols = _elements(csr.col_indices, np.dtype(np.int64), len(values), max_elements)
    if crow[0] != 0 or crow[-1] != len(values) or np.any(np.diff(crow) < 0):
        raise ValueError(f"sparse CSR crow_indices must rise from 0 to the {len(values)} values")
    if len(cols) and (cols.min() < 0 or cols.max() >= shape[1]):
        raise ValueError(f"sparse CSR col_indices must be in [0, {shape[1]}) for shape {shape}")
    dense = np.zeros(shape, dtype=dtype)
    dense[np.repeat(np.arange(shape[0]), np.diff(crow)), cols] = values
    return dense


def _elements(raw: bytes, dtype: np.dtype[Any], count: int | None, max_elements: int) -> np.ndarray:
    """`raw` as `count` elements of `dtype` (any count when None), within the limit."""
    if len(raw) % dtype.itemsize:
        raise ValueError(f"{len(raw)} bytes are not whole {dtype.name} elements")
    n = len(raw) // dtype.itemsize
    if (count is not None and n != count) or n > max_elements:
        want = f"{count}" if count is not None else f"at most {max_elements}"
        raise ValueError(f"{n} {dtype.name} elements where the shape needs {want}")
    return np.frombuffer(raw, dtype=dtype)


@dataclass(frozen=True)
class FwdBwdDatum:
    tokens: np.ndarray  # int64 (N,): the model input, text chunks concatenated
    loss_fn_inputs: dict[str, np.ndarray]  # e.g. target_tokens (N,) int64, weights (N,) float32, advantages, logprobs
    raw: pb.Datum  # for what the arrays leave out (provenance spans)


@dataclass(frozen=True)
class FwdBwdBody:
    model_id: str
    seq_id: int
    forward_only: bool
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    data: list[FwdBwdDatum] = field(default_factory=list)


def decode_forward_backward(body: bytes) -> FwdBwdBody:
    """A forward/forward_backward body (tinker/proto/request_conv.py `forward_backward_request_to_proto`).

    Image or audio chunks raise ValueError (fail the request as a user error).
    """
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    # The SDK double-writes float configs (legacy map + v2) and puts strings in v2 only; v2 wins where set.
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = []
    for i, datum in enumerate(msg.data):
        parts = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise ValueError(f"datum {i}: only text model inputs are supported, not {chunk.WhichOneof('chunk')}")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise ValueError(f"datum {i}: model_input tokens are {len(raw)} bytes, not whole int32 ids")
            parts.append(np.frombuffer(raw, dtype=np.int32))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        inputs = {}
        for name, t in datum.loss_fn_inputs.items():
            try:
                inputs[name] = tensor_to_numpy(t)
            except ValueError as e:
                raise ValueError(f"datum {i}: loss_fn_inputs[{name!r}]: {e}") from None
        data.append(FwdBwdDatum(tokens=tokens, loss_fn_inputs=inputs, raw=datum))
    return FwdBwdBody(
        model_id=msg.model_id, seq_id=msg.seq_id, forward_only=msg.forward_only, loss_fn=msg.loss_fn,
        loss_fn_config=config, data=data,
    )


# -- results ---------------------------------------------------------------------------------------------------------


def json_result(model: pydantic.BaseModel | Mapping[str, Any]) -> bytes:
    """A JSON kind's result, e.g. json_result(types.SaveWeightsResponse(path=...))."""
    data = model.model_dump(mode="json", exclude_none=True) if isinstance(model, pydantic.BaseModel) else dict(model)
    return json.dumps(data, separators=(",", ":")).encode()


_PB_DTYPE: Final[Mapping[str, pb.DType.ValueType]] = {
    "float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64, "int32": pb.DTYPE_INT32}


def _pb_dtype(arr: np.ndarray) -> pb.DType.ValueType:
    if arr.dtype.name not in _PB_DTYPE:
        raise ValueError(f"output arrays must be float32, int64 or int32, not {arr.dtype}")
    return _PB_DTYPE[arr.dtype.name]


def encode_forward_backward_output(
    loss_fn_outputs: Sequence[Mapping[str, np.ndarray]],
    metrics: Mapping[str, float],
    *,
    loss_fn_output_type: str = "ArrayRecord",
) -> bytes:
    """A forward/forward_backward result: one dict of arrays per datum (leading dim = that datum's tokens).

    Every datum has the same fields; consecutive datums whose dtypes and trailing shapes also match share one
    ArrayRecord (a BatchedTensor per field with byte offsets), which is what tinker/proto/response_conv.py
    `deserialize_forward_backward_output` reads.
    """
    for key in metrics:
        if ":" not in key:
            raise ValueError(f"metric {key!r} needs a reduction suffix such as ':sum' or ':mean' (the SDK splits keys)")
    names = [sorted(d) for d in loss_fn_outputs]
    if any(n != names[0] for n in names):
        # The SDK indexes every field by datum across all records (response_conv.py, per_field_datum_meta[name][i]).
        raise ValueError("every datum's outputs must have the same field names")
    out = pb.ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type)
    out.metrics.update({k: float(v) for k, v in metrics.items()})

    def signature(d: Mapping[str, np.ndarray]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return tuple(sorted((k, np.asarray(v).dtype.name, np.asarray(v).shape[1:]) for k, v in d.items()))

    groups: list[list[Mapping[str, np.ndarray]]] = []
    for datum in loss_fn_outputs:
        if groups and signature(groups[-1][0]) == signature(datum):
            groups[-1].append(datum)
        else:
            groups.append([datum])
    for group in groups:
        record = out.loss_fn_outputs.add(type_tag=loss_fn_output_type, num_datums=len(group))
        for name in group[0]:
            arrays = [np.ascontiguousarray(d[name]) for d in group]
            offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
            bt = record.fields[name]
            bt.dtype = _pb_dtype(arrays[0])
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = offsets.tobytes()
            bt.trailing_shape.extend(arrays[0].shape[1:])
    return out.SerializeToString()


@dataclass(frozen=True)
class SampledOutput:
    tokens: np.ndarray  # the generated token ids
    stop_reason: Literal["stop", "length"]
    logprobs: np.ndarray | None = None  # float32, one per generated token


_STOP_REASON: Final[Mapping[str, int]] = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


# tinker/types/topk_logprobs.py: a position with no top-k (the first prompt token) holds token 0 and this log-prob.
TOPK_MASK_LOGPROB: Final = -99999.0


def encode_sample_response(
    sequences: Sequence[SampledOutput],
    *,
    prompt_logprobs: np.ndarray | None = None,
    topk_prompt_logprobs: tuple[np.ndarray, np.ndarray] | None = None,
) -> bytes:
    """A sample result (tinker/proto/response_conv.py `deserialize_sample_response`): tokens as int32, logprobs
    as float32; prompt_logprobs one per prompt token, NaN where none (the first token); topk_prompt_logprobs (token
    ids int32 [n, k], log-probs float32 [n, k]) one row per prompt token, the first row the SDK's sentinel."""
    msg = pb.SampleResponse()
    for seq in sequences:
        s = msg.sequences.add(
            stop_reason=_STOP_REASON[seq.stop_reason], tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes()
        )
        if seq.logprobs is not None:
            s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk_prompt_logprobs is not None:
        ids, logprobs = (np.asarray(topk_prompt_logprobs[0], np.int32), np.asarray(topk_prompt_logprobs[1], np.float32))
        if ids.shape != logprobs.shape or ids.ndim != 2:
            raise ValueError(f"top-k prompt log-probs need matching [n, k] arrays: {ids.shape}, {logprobs.shape}")
        msg.topk_prompt_logprobs.CopyFrom(pb.TopkLogprobs(
            token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=ids.shape[1], length=ids.shape[0]))
    return msg.SerializeToString()


# -- ids -------------------------------------------------------------------------------------------------------------


def sequence_ids(request_id: str, num_samples: int) -> list[str]:
    """The ids the asample promise hands out, one per sample in result order (tinker 0.38 asserts they are there and
    stamps them on the returned sequences: sampling_client.py `_attach_sequence_ids`). A resubmission of the same
    request gets the same ids."""
    return [f"{request_id}.{i}" for i in range(num_samples)]


def ephemeral_sampler_name(sampling_session_seq_id: int, seq_id: int) -> str:
    """The checkpoint name of a save_weights_and_get_sampling_client() save (the SDK names none)."""
    return f"ss{sampling_session_seq_id}_seq{seq_id}"
